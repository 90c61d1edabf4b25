"""GroupRates, group_rates, per_group_frame and binary_fairness against a plain pandas reference."""

from __future__ import annotations

import doctest
import io
import math

import numpy as np
import pandas as pd
import pytest
import torch
import torchmetrics

from fairprune.errors import UserError
from fairprune.metrics.group import GroupRates, binary_fairness, group_rates, per_group_frame
from fairprune.metrics.group import functional as group_functional
from fairprune.metrics.group import metric as group_metric

NAMES = ["asian", "black", "indian", "white"]


# ----------------------------------------------------------------------------------------------
# Data and the reference computation


def make_data(seed: int, num_classes: int, n: int = 240):
    """Logits, targets and groups where group 2 is tiny (one sample), group 3 absent, some unknown.

    The tiny group has no sample of most classes, so it hits the zero-denominator cases of FPR
    and FNR; the absent group checks that nothing turns into NaN.
    """
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, num_classes, generator=g)
    target = torch.randint(num_classes, (n,), generator=g)
    # Make the model better than chance so accuracies differ from group to group.
    hit = torch.rand(n, generator=g) < 0.5
    logits[hit, target[hit]] += 3.0
    groups = torch.randint(-1, 2, (n,), generator=g)
    groups[0], target[0] = 2, 0
    return logits, target, groups


def reference_rates(labels, target, groups, num_classes, names, reference=None) -> dict[str, float]:
    """The expected result, computed sample by sample with pandas."""
    df = pd.DataFrame({"p": np.asarray(labels), "t": np.asarray(target), "g": np.asarray(groups)})
    df = df[df.g >= 0]
    out = {"acc": float((df.p == df.t).mean()) if len(df) else 0.0}
    accs, pos_rates, tprs = {}, [], []
    for gi, name in enumerate(names):
        d = df[df.g == gi]
        out[f"count/{name}"] = float(len(d))
        out[f"present/{name}"] = float(len(d) > 0)
        if len(d) == 0:
            continue
        accs[name] = float((d.p == d.t).mean())
        out[f"acc/{name}"] = accs[name]
        positive_classes = [1] if num_classes == 2 else range(num_classes)
        fprs = [((d.p == c) & (d.t != c)).sum() / (d.t != c).sum() for c in positive_classes if (d.t != c).any()]
        fnrs = [((d.p != c) & (d.t == c)).sum() / (d.t == c).sum() for c in positive_classes if (d.t == c).any()]
        out[f"fpr/{name}"] = float(np.mean(fprs)) if fprs else 0.0
        out[f"fnr/{name}"] = float(np.mean(fnrs)) if fnrs else 0.0
        pos_rates.append((d.p == 1).mean())
        if (d.t == 1).any():
            tprs.append((d.p[d.t == 1] == 1).mean())
    values = np.array(list(accs.values()))
    out["acc_gap"] = float(values.max() - values.min()) if len(values) > 1 else 0.0
    out["acc_std"] = float(values.std()) if len(values) > 1 else 0.0
    if num_classes == 2:
        ratio = lambda r: float(min(r) / max(r)) if r and max(r) > 0 else 0.0  # noqa: E731
        out["demographic_parity"] = ratio(pos_rates)
        out["equal_opportunity"] = ratio(tprs)
    if reference is not None:
        drops = {g: reference[g] - a for g, a in accs.items() if g in reference}
        out.update({f"degradation/{g}": v for g, v in drops.items()})
        spread = np.array(list(drops.values()))
        out["degradation_var"] = float(spread.var()) if len(spread) > 1 else 0.0
        out["degradation_std"] = float(spread.std()) if len(spread) > 1 else 0.0
    return out


def assert_matches(result: dict, expected: dict) -> None:
    assert set(result) == set(expected)
    for key, value in expected.items():
        got = float(result[key])
        assert not math.isnan(got), key
        assert got == pytest.approx(value, abs=1e-6), key


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("num_classes", [2, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_pandas_reference(seed, num_classes):
    logits, target, groups = make_data(seed, num_classes)
    result = group_rates(logits, target, groups, num_classes, len(NAMES), NAMES)
    expected = reference_rates(logits.argmax(1), target, groups, num_classes, NAMES)
    assert_matches(result, expected)
    assert result["present/white"] == 0 and result["count/white"] == 0
    assert all(f"{m}/white" not in result for m in ("acc", "fpr", "fnr"))


def test_labels_and_scores_give_the_same_result():
    logits, target, groups = make_data(3, 4)
    as_scores = group_rates(logits.softmax(1), target, groups, 4, 4)
    as_labels = group_rates(logits.argmax(1), target, groups, 4, 4)
    assert_same(as_scores, as_labels)
    assert "acc/0" in as_labels  # default names are the group ids


def test_only_unknown_groups_gives_zeros_not_nan():
    result = group_rates(torch.tensor([0, 1]), torch.tensor([1, 1]), torch.tensor([-1, -1]), 2, 2)
    assert result["acc"] == 0 and result["acc_gap"] == 0 and result["present/0"] == 0
    assert not any(torch.isnan(v) for v in result.values())


# ----------------------------------------------------------------------------------------------
# Accumulation: batches, forward, merging


@pytest.mark.parametrize("num_classes", [2, 5])
def test_batches_equal_one_call_equal_functional(num_classes):
    logits, target, groups = make_data(4, num_classes)
    chunks = [(0, 17), (17, 100), (100, 240)]
    by_batches, by_forward, at_once = (GroupRates(num_classes, 4, NAMES) for _ in range(3))
    for start, stop in chunks:
        by_batches.update(logits[start:stop], target[start:stop], groups[start:stop])
        by_forward(logits[start:stop], target[start:stop], groups[start:stop])
    at_once.update(logits, target, groups)
    functional = group_rates(logits, target, groups, num_classes, 4, NAMES)
    assert_same(by_batches.compute(), functional)
    assert_same(by_forward.compute(), functional)
    assert_same(at_once.compute(), functional)


def test_forward_returns_the_batch_value():
    logits, target, groups = make_data(5, 3)
    metric = GroupRates(3, 4, NAMES)
    metric(logits[:50], target[:50], groups[:50])
    batch = metric(logits[50:], target[50:], groups[50:])
    assert_same(batch, group_rates(logits[50:], target[50:], groups[50:], 3, 4, NAMES))


def test_merge_state_equals_one_metric_on_all_data():
    logits, target, groups = make_data(6, 5)
    first, second, whole = (GroupRates(5, 4, NAMES) for _ in range(3))
    first.update(logits[:120], target[:120], groups[:120])
    second.update(logits[120:], target[120:], groups[120:])
    whole.update(logits, target, groups)
    summed = first.confusion + second.confusion
    first.merge_state(second)
    assert torch.equal(first.confusion, summed)
    assert_same(first.compute(), whole.compute())


def test_state_is_one_long_confusion_tensor_summed_across_processes():
    metric = GroupRates(3, 4)
    assert metric.confusion.shape == (4, 3, 3) and metric.confusion.dtype == torch.long
    assert metric._reductions["confusion"] is torchmetrics.utilities.dim_zero_sum
    assert metric.full_state_update is False


# ----------------------------------------------------------------------------------------------
# Reference and degradation


@pytest.mark.parametrize("num_classes", [2, 5])
def test_degradation_against_a_reference_by_hand(num_classes):
    logits, target, groups = make_data(7, num_classes)
    # "indian" is given as a tensor entry of NaN and "white" is absent: neither has a degradation.
    reference = {"asian": 0.9, "black": 0.55, "white": 0.8}
    metric = GroupRates(num_classes, 4, NAMES)
    metric.update(logits, target, groups)
    metric.set_reference(torch.tensor([0.9, 0.55, float("nan"), 0.8]))
    expected = reference_rates(logits.argmax(1), target, groups, num_classes, NAMES, reference)
    assert_matches(metric.compute(), expected)
    assert_matches(group_rates(logits, target, groups, num_classes, 4, NAMES, reference=reference), expected)


def test_reference_from_compute_of_the_same_model_gives_zero_degradation():
    logits, target, groups = make_data(8, 3)
    dense = group_rates(logits, target, groups, 3, 4, NAMES)
    metric = GroupRates(3, 4, NAMES)
    metric.reference_from_compute(dense)
    metric.update(logits, target, groups)
    result = metric.compute()
    assert {k for k in result if k.startswith("degradation/")} == {"degradation/asian", "degradation/black", "degradation/indian"}
    assert all(result[k] == 0 for k in result if k.startswith("degradation"))


def test_set_reference_invalidates_the_cached_result():
    logits, target, groups = make_data(9, 2)
    metric = GroupRates(2, 4, NAMES)
    metric.update(logits, target, groups)
    assert "degradation_std" not in metric.compute()
    metric.set_reference({"asian": 1.0})
    assert "degradation/asian" in metric.compute()
    metric.set_reference(None)
    assert not metric.has_reference and "degradation_std" not in metric.compute()


def test_reference_survives_reset_and_state_dict_round_trip():
    logits, target, groups = make_data(10, 3)
    metric = GroupRates(3, 4, NAMES)
    metric.set_reference({"asian": 0.7, "black": 0.6})
    metric.update(logits, target, groups)
    before = metric.compute()
    metric.reset()
    assert metric.confusion.sum() == 0 and metric.has_reference

    # Inside a parent module, as in a LightningModule checkpoint, through torch.save.
    buffer = io.BytesIO()
    torch.save(torch.nn.ModuleDict({"rates": metric}).state_dict(), buffer)
    buffer.seek(0)
    restored = torch.nn.ModuleDict({"rates": GroupRates(3, 4, NAMES)})
    restored.load_state_dict(torch.load(buffer))
    torch.testing.assert_close(restored["rates"].reference, metric.reference, equal_nan=True)
    restored["rates"].update(logits, target, groups)
    assert_same(restored["rates"].compute(), before)


def test_state_dict_without_reference_loads_strictly_as_no_reference():
    metric = GroupRates(2, 4, NAMES)
    metric.set_reference({"asian": 0.5})
    state = metric.state_dict()
    del state["reference"]
    metric.load_state_dict(state, strict=True)
    assert not metric.has_reference


# ----------------------------------------------------------------------------------------------
# Tables


def test_per_group_frame_rows_match_the_result():
    logits, target, groups = make_data(11, 3)
    result = group_rates(logits, target, groups, 3, 4, NAMES, reference={"asian": 0.9})
    frame = per_group_frame(result)
    assert list(frame.index) == NAMES
    assert list(frame.columns) == ["accuracy", "fpr", "fnr", "count", "present", "degradation"]
    for name in NAMES[:3]:
        assert frame.loc[name, "accuracy"] == pytest.approx(float(result[f"acc/{name}"]))
        assert frame.loc[name, "fnr"] == pytest.approx(float(result[f"fnr/{name}"]))
        assert frame.loc[name, "count"] == int(result[f"count/{name}"])
    assert frame.loc["asian", "degradation"] == pytest.approx(float(result["degradation/asian"]))
    assert np.isnan(frame.loc["black", "degradation"])
    assert not frame.loc["white", "present"] and frame.loc["white", "count"] == 0
    assert frame.loc["white", ["accuracy", "fpr", "fnr"]].isna().all()


# ----------------------------------------------------------------------------------------------
# Binary fairness through torchmetrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_binary_fairness_matches_pandas_and_group_rates(seed):
    logits, target, groups = make_data(seed, 2)
    expected = reference_rates(logits.argmax(1), target, groups, 2, NAMES)
    for preds in (logits, logits.argmax(1), logits.softmax(1)[:, 1]):
        result = binary_fairness(preds, target, groups, num_groups=4)
        assert list(result) == ["demographic_parity", "equal_opportunity"]
        assert float(result["demographic_parity"]) == pytest.approx(expected["demographic_parity"], abs=1e-6)
        assert float(result["equal_opportunity"]) == pytest.approx(expected["equal_opportunity"], abs=1e-6)
    metric = GroupRates(2, 4, NAMES)
    metric.update(logits, target, groups)
    out = metric.compute()
    assert float(out["demographic_parity"]) == pytest.approx(expected["demographic_parity"], abs=1e-6)
    assert float(out["equal_opportunity"]) == pytest.approx(expected["equal_opportunity"], abs=1e-6)


def test_binary_fairness_with_every_group_present_equals_plain_torchmetrics():
    logits, target, groups = make_data(12, 2)
    groups = groups.clamp(min=0)
    groups[0] = 1  # only groups 0 and 1, both with positives
    labels = logits.argmax(1)
    plain = torchmetrics.functional.classification.binary_fairness(labels, target, groups)
    ours = binary_fairness(labels, target, groups, num_groups=2)
    assert sorted(plain) and [float(v) for v in plain.values()] == pytest.approx([float(v) for v in ours.values()])


# ----------------------------------------------------------------------------------------------
# Mistakes


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: GroupRates(1, 2), "num_classes"),
        (lambda: GroupRates(3, 2, group_names=["a"]), "group_names"),
        (lambda: GroupRates(3, 2, group_names=["a", "a"]), "distinct"),
        (lambda: GroupRates(3, 2, class_names=["x"]), "class_names"),
        (lambda: group_rates(torch.randn(4, 3), torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), 2, 1), "num_classes"),
        (lambda: group_rates(torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), torch.tensor([0, 0]), 2, 1), "integer labels"),
        (lambda: group_rates(torch.tensor([0, 3]), torch.tensor([0, 1]), torch.tensor([0, 0]), 3, 1), "preds labels"),
        (lambda: group_rates(torch.tensor([0, 1]), torch.tensor([0, 5]), torch.tensor([0, 0]), 3, 1), "target labels"),
        (lambda: group_rates(torch.tensor([0, 1]), torch.tensor([0, 1, 1]), torch.tensor([0, 0]), 3, 1), "target must be"),
        (lambda: group_rates(torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([0, 2]), 3, 2), "group id 2"),
        (lambda: group_rates(torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([0.0, 1.0]), 3, 2), "groups must be"),
        (lambda: GroupRates(2, 2, ["male", "female"]).set_reference({"femal": 0.9}), "did you mean: female"),
        (lambda: GroupRates(2, 2).set_reference([0.9]), "one accuracy per group"),
        (lambda: GroupRates(2, 2).set_reference([0.9, 90.0]), "[0, 1]"),
        (lambda: GroupRates(2, 2, ["a", "b"]).reference_from_compute({"acc": torch.tensor(1.0)}), "compute()"),
        (lambda: per_group_frame({"acc": torch.tensor(1.0)}), "count/<group>"),
        (lambda: binary_fairness(torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([0, 0]), 1), "target labels"),
    ],
)
def test_mistakes_raise_one_line_user_errors(call, words):
    with pytest.raises(ValueError) as info:
        call()
    assert isinstance(info.value, UserError)
    message = str(info.value)
    assert words in message and "\n" not in message


# ----------------------------------------------------------------------------------------------
# Documentation


def test_docstring_examples_run():
    results = [doctest.testmod(module, raise_on_error=False) for module in (group_functional, group_metric)]
    failed, attempted = (sum(counts) for counts in zip(*results))
    assert attempted >= 10 and failed == 0
