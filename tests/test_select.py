"""The selection core against plain Python oracles: random scores full of ties, signed zeros and
half precision; pruned candidates never come back; k = 0 and k = all; valid N:M patterns."""

from __future__ import annotations

import pytest
import torch

from fairprune.pruning.select import lowest_k, magnitude, n_m, top_k, top_k_per_row

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# ---------------------------------------------------------------------------------------------
# Oracles: rank by (score descending, index) or (value ascending, index), take the first k.
# ---------------------------------------------------------------------------------------------


def keep_oracle(scores: list[float], k: int, candidates: list[bool] | None = None) -> list[bool]:
    pool = [i for i in range(len(scores)) if candidates is None or candidates[i]]
    kept = set(sorted(pool, key=lambda i: (-scores[i], i))[:k])
    return [i in kept for i in range(len(scores))]


def lowest_oracle(values: list[float], k: int) -> list[int]:
    return sorted(sorted(range(len(values)), key=lambda i: (values[i], i))[:k])


def random_scores(shape, seed: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # a handful of distinct values: ties everywhere, also at the cut
        return torch.randint(0, 4, shape, generator=g).double()
    if kind == "signed_zero":  # -0.0 and +0.0 must tie
        x = torch.randint(0, 2, shape, generator=g).double()
        return torch.where(torch.rand(shape, generator=g) < 0.5, -x, x)  # ±0.0 and ±1.0
    if kind == "negative":  # GraSP scores can be negative
        return torch.randint(-3, 3, shape, generator=g).double()
    if kind == "half":
        return (torch.randint(0, 5, shape, generator=g) * 0.25).half()
    if kind == "bfloat16":
        return (torch.randint(0, 5, shape, generator=g) * 0.5).bfloat16()
    return torch.randn(shape, generator=g).float()


KINDS = ["ties", "signed_zero", "negative", "half", "bfloat16", "continuous"]


def as_list(t: torch.Tensor) -> list:
    return t.detach().cpu().double().flatten().tolist()


# ---------------------------------------------------------------------------------------------
# top_k
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1,), (7,), (5, 6), (3, 4, 5)])
def test_top_k_matches_oracle(kind, shape, device):
    scores = random_scores(shape, seed=len(shape) * 31 + shape[0], kind=kind).to(device)
    n = scores.numel()
    for k in sorted({0, 1, n // 3, n // 2, n - 1, n} & set(range(n + 1))):
        got = top_k(scores, k)
        assert got.dtype == torch.bool and got.shape == scores.shape and got.device == scores.device
        assert got.flatten().tolist() == keep_oracle(as_list(scores), k), f"k={k}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_top_k_never_revives_a_pruned_candidate(kind, device):
    g = torch.Generator().manual_seed(11)
    scores = random_scores((6, 9), 5, kind).to(device)
    scores[0, 0] = 100  # a pruned weight with the best score stays pruned
    candidates = (torch.rand(6, 9, generator=g) < 0.6).to(device)
    candidates[0, 0] = False
    alive = int(candidates.sum())
    for k in (0, 1, alive // 2, alive - 1, alive, alive + 5, scores.numel()):
        got = top_k(scores, k, candidates)
        assert not (got & ~candidates).any(), "a pruned weight came back"
        assert int(got.sum()) == min(k, alive)
        assert got.flatten().tolist() == keep_oracle(as_list(scores), k, candidates.flatten().tolist())


def test_top_k_over_a_flat_concatenation():
    scores = {"a": random_scores((3, 4), 1, "ties"), "b": random_scores((5,), 2, "ties"),
              "c": random_scores((2, 2, 2), 3, "ties")}
    candidates = {name: torch.rand(s.shape, generator=torch.Generator().manual_seed(7)) < 0.7
                  for name, s in scores.items()}
    flat = [v for s in scores.values() for v in as_list(s)]
    cands = [c for m in candidates.values() for c in m.flatten().tolist()]
    for k in (0, 3, 10, sum(cands), len(flat)):
        got = top_k(scores, k, candidates)
        assert list(got) == list(scores) and all(got[n].shape == scores[n].shape for n in scores)
        assert [b for m in got.values() for b in m.flatten().tolist()] == keep_oracle(flat, k, cands)
    plain = top_k(scores, 7)
    assert [b for m in plain.values() for b in m.flatten().tolist()] == keep_oracle(flat, 7)


def test_top_k_tie_rule_example():
    scores = torch.tensor([2.0, 5.0, 2.0, 5.0, 2.0])
    assert top_k(scores, 1).tolist() == [False, True, False, False, False]
    assert top_k(scores, 3).tolist() == [True, True, False, True, False]
    assert top_k(scores, 3, torch.tensor([False, True, True, True, True])).tolist() == [False, True, True, True, False]


def test_top_k_rejects_bad_k_and_shapes():
    for k in (-1, 5, 1.5, True):
        with pytest.raises(ValueError, match="k must"):
            top_k(torch.ones(4), k)
    with pytest.raises(ValueError, match="candidates shape"):
        top_k(torch.ones(2, 3), 1, torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="same keys"):
        top_k({"a": torch.ones(2)}, 1, {"b": torch.ones(2, dtype=torch.bool)})


# ---------------------------------------------------------------------------------------------
# top_k_per_row and N:M
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 1), (4, 1), (1, 9), (6, 10), (3, 33)])
def test_top_k_per_row_matches_oracle(kind, shape, device):
    scores = random_scores(shape, seed=shape[0] * 100 + shape[1], kind=kind).to(device)
    rows, cols = shape
    for k in sorted({0, 1, cols // 2, cols - 1, cols} & set(range(cols + 1))):
        got = top_k_per_row(scores, k)
        assert got.dtype == torch.bool and got.shape == scores.shape
        for r in range(rows):
            assert got[r].tolist() == keep_oracle(as_list(scores[r]), k), f"k={k}, row {r}"


def test_top_k_per_row_by_fraction_floors():
    scores = random_scores((5, 10), 3, "ties")
    for fraction in (0.0, 0.25, 0.35, 0.5, 0.99, 1.0):
        got = top_k_per_row(scores, fraction=fraction)
        assert torch.equal(got, top_k_per_row(scores, int(10 * fraction)))
    with pytest.raises(ValueError, match="exactly one"):
        top_k_per_row(scores, 3, fraction=0.3)
    with pytest.raises(ValueError, match="2-D"):
        top_k_per_row(torch.ones(3), 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (1, 4), (3, 4), (3, 8), (0, 4), (4, 4)])
def test_n_m_matches_oracle_and_is_valid(kind, n, m, device):
    scores = random_scores((5, 4 * m), seed=n * 10 + m, kind=kind).to(device)
    got = n_m(scores, n, m)
    # Valid N:M: exactly n pruned (m − n kept) in every group of m consecutive columns.
    assert (got.view(5, 4, m).sum(-1) == m - n).all()
    for r in range(5):
        for group in range(4):
            block = as_list(scores[r, group * m: (group + 1) * m])
            assert got[r, group * m: (group + 1) * m].tolist() == keep_oracle(block, m - n)


def test_n_m_prunes_the_n_lowest():
    scores = torch.tensor([[4.0, 1.0, 3.0, 2.0, 0.0, 0.0, 0.0, 9.0]])
    assert n_m(scores, 2, 4).tolist() == [[True, False, True, False, True, False, False, True]]
    with pytest.raises(ValueError, match="multiple of 4"):
        n_m(torch.ones(2, 6), 2, 4)
    with pytest.raises(ValueError, match="N:M"):
        n_m(torch.ones(2, 8), 5, 4)


# ---------------------------------------------------------------------------------------------
# lowest_k (heads to remove) and magnitude
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_lowest_k_matches_oracle(kind):
    values = random_scores((4, 6), seed=9, kind=kind)
    for k in range(values.numel() + 1):
        assert lowest_k(values, k).tolist() == lowest_oracle(as_list(values), k), f"k={k}"
    with pytest.raises(ValueError, match="k must"):
        lowest_k(values, values.numel() + 1)


def test_magnitude_is_abs_and_detached():
    w = torch.tensor([[-2.0, 0.5], [0.0, -0.0]], requires_grad=True)
    score = magnitude(w)
    assert not score.requires_grad and score.tolist() == [[2.0, 0.5], [0.0, 0.0]]
    assert top_k(score, 1).tolist() == [[True, False], [False, False]]
