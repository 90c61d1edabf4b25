"""The LM commands under ``torchrun``: two processes with a real gloo process group give the
result of one process exactly (weights, masks, perplexity, stereotype score), and only rank 0
writes.

``python -m torch.distributed.run --nproc_per_node 2 --standalone prune.py ...`` is spawned as a
subprocess in the test's temporary folder against a tiny GPT-2 trained for a few steps here (a
locally trained BPE tokenizer, saved with ``save_pretrained``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from fairprune.cli.prune import main as prune_main

ROOT = Path(__file__).resolve().parents[1]
SEQLEN = 32
TIMEOUT = 300  # seconds per command: far above the ~15 s it takes, bounded if a rank ever hangs


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> dict:
    """A 2-layer GPT-2 (width 64) trained for 200 steps on the bundled corpus, with its tokenizer,
    and small evaluation files (text and CrowS-Pairs CSV)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from fairprune.data.text import join_documents, lm_corpus, stereo_pairs, train_bpe_tokenizer

    folder = tmp_path_factory.mktemp("torchrun-lm")
    corpus = lm_corpus(train_docs=150, validation_docs=12, seed=3)
    tokenizer = train_bpe_tokenizer(corpus.train, 400)
    ids = torch.tensor(tokenizer(join_documents(corpus.train)).input_ids)
    windows = ids[: len(ids) // SEQLEN * SEQLEN].view(-1, SEQLEN)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=len(tokenizer),
                                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id))
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        batch = windows[torch.randint(0, len(windows), (8,), generator=generator)]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    (folder / "eval.txt").write_text(corpus.validation)
    rows = ["sent_more,sent_less,stereo_antistereo"] + [f'"{a}","{b}",stereo' for a, b in stereo_pairs()[::6]]
    (folder / "pairs.csv").write_text("\n".join(rows) + "\n")
    return {"model": folder / "model", "lm": ["--seqlen", str(SEQLEN), "--device", "cpu", "--eval_text",
                                             str(folder / "eval.txt"), "--pairs", str(folder / "pairs.csv")]}


def torchrun(args: list[str], cwd: Path, nproc: int = 2) -> subprocess.Popen:
    """Start ``prune.py args`` under torchrun (``nproc`` processes, gloo) in ``cwd``; its console
    output prefixes each line with the rank that printed it (``[default0]:``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--monitor_interval", "0.1", "--tee", "3", str(ROOT / "prune.py"), *args]
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> str:
    """Wait (bounded) for a torchrun started by :func:`torchrun`; its output, once it succeeded."""
    try:
        out, _ = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT} s:\n{out[-3000:]}")
    assert process.returncode == 0, out[-5000:]
    return out


@pytest.fixture(scope="module")
def runs(tiny_lm, tmp_path_factory, one_thread) -> dict:
    """SparseGPT 2:4 under torchrun (2 ranks) into ``A`` and in this process into ``B`` (measuring
    the dense model again: ``--dense_cache false``), and ``evaluate`` of the dense model under
    torchrun into ``E`` (its figures from the cache A's rank 0 wrote), one after the other (run side
    by side on two cores they take longer)."""
    root = tmp_path_factory.mktemp("torchrun-runs")
    # 2:4 is the pattern where near-ties flip most easily: the strictest agreement check.
    sgpt = ["sparsegpt", "--model", str(tiny_lm["model"]), "--sparsity", "2:4", "--nsamples", "16", *tiny_lm["lm"]]
    evaluate = ["evaluate", "--model", str(tiny_lm["model"]), *tiny_lm["lm"], "--output", "E"]
    printed = {"A": finish(torchrun([*sgpt, "--output", "A"], root / "a")), "E": finish(torchrun(evaluate, root / "e"))}
    assert prune_main([*sgpt, "--output", str(root / "b" / "B"), "--dense_cache", "false"]) == 0  # one process, no group
    return {"A": root / "a" / "A", "B": root / "b" / "B", "E": root / "e" / "E", "printed": printed}


def masks(folder: Path) -> dict[str, torch.Tensor]:
    """Zero masks of every prunable block layer of the saved model."""
    from fairprune.causal.families import family_of, linear_weight
    from fairprune.pruning.llm import block_targets

    model = AutoModelForCausalLM.from_pretrained(folder)
    return {t.name: linear_weight(t.module) == 0 for t in block_targets(model, family_of(model))}


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def report(folder: Path) -> dict:
    return json.loads((folder / "report.json").read_text())


def test_sparsegpt_under_torchrun_matches_one_process(runs):
    a, b = report(runs["A"]), report(runs["B"])
    # Only rank 0 wrote: the run folder holds B's files and nothing else was written beside it,
    # and the one "written to" line is rank 0's and carries the report's figures.
    assert files(runs["A"]) == files(runs["B"])
    assert files(runs["A"].parent) == [f"A/{name}" for name in files(runs["A"])]
    written = [line for line in runs["printed"]["A"].splitlines() if "written to" in line]
    assert len(written) == 1 and written[0].startswith("[default0]:"), runs["printed"]["A"]
    assert f"{a['metrics']['perplexity']:.2f}" in written[0]

    got, want = masks(runs["A"]), masks(runs["B"])
    differ = {k: int((got[k] != want[k]).sum()) for k in want if not torch.equal(got[k], want[k])}
    assert not differ, f"mask entries that differ from one process's: {differ}"
    got, want = weights(runs["A"]), weights(runs["B"])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert a["achieved_sparsity"] == b["achieved_sparsity"] == pytest.approx(0.5)
    assert a["metrics"] == b["metrics"] and a["reference"]["metrics"] == b["reference"]["metrics"]
    assert a["calibration"] == b["calibration"]  # the reported sample counts are the whole run's


def test_evaluate_under_torchrun_matches_one_process(runs):
    """``evaluate`` of the dense model on two ranks gives what one process measured for it (B's
    reference); both ranks took it from the cache A's rank 0 wrote (a rank that disagreed would
    hang the other, or measure alone)."""
    assert files(runs["E"].parent) == ["E/eval_items.npz", "E/report.json"]
    evaluated = report(runs["E"])
    assert evaluated["ci"]["perplexity"][0] < evaluated["metrics"]["perplexity"] < evaluated["ci"]["perplexity"][1]
    assert evaluated["from_cache"] is True and report(runs["A"])["reference"]["from_cache"] is False
    assert evaluated["metrics"] == report(runs["A"])["reference"]["metrics"]
    got, want = evaluated["metrics"], report(runs["B"])["reference"]["metrics"]
    assert got == want
    printed = [line for line in runs["printed"]["E"].splitlines() if re.search(r"\[evaluate\].*perplexity", line)]
    assert len(printed) == 1 and printed[0].startswith("[default0]:"), runs["printed"]["E"]


# --------------------------------------------------------------------------------------------
# Two ranks reach one process bit for bit: GPT-2 and Llama, three methods, 50 % and 2:4
# --------------------------------------------------------------------------------------------

# SparseGPT on both families at both sparsities; Wanda's and Debias-SparseGPT's statistics once each way.
RUNS = [(family, "sparsegpt", sparsity) for family in ("gpt2", "llama") for sparsity in ("0.5", "2:4")] + [
    ("gpt2", "wanda", "2:4"), ("llama", "wanda", "0.5"), ("gpt2", "debias-sparsegpt", "0.5"),
    ("llama", "debias-sparsegpt", "2:4")]


def tiny_data() -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """33 calibration windows of 16 tokens, 40 evaluation windows' ids, 12 aligned pairs with a mask."""
    from tiny_models import VOCAB

    g = torch.Generator().manual_seed(1)
    calib, eval_ids = torch.randint(0, VOCAB, (33, 16), generator=g), torch.randint(0, VOCAB, (40 * 16,), generator=g)
    pairs = (torch.randint(0, VOCAB, (12, 10), generator=g), torch.randint(0, VOCAB, (12, 10), generator=g),
             torch.rand(12, 10, generator=g) > 0.2)
    return calib, eval_ids, pairs


def prune_tiny_models() -> dict[str, dict]:
    """Each of :data:`RUNS` (family, method, sparsity) from 33 calibration windows (in batches of two:
    ragged shares, and each rank's batches differ from one process's unless batches are cut before
    they are dealt out) and 12 aligned pairs (in batches of five: both ranks get pairs); per run the weights and the perplexity of 40 windows
    (batches of three). Collective under a process group, alone otherwise."""
    from fairprune.metrics.language import perplexity
    from fairprune.pruning.llm import Batching, prune_causal_lm
    from fairprune.pruning.sparsity import Sparsity
    from tiny_models import BUILDERS

    calib, eval_ids, pairs = tiny_data()
    out = {}
    for family, method, sparsity in RUNS:
        torch.manual_seed(0)
        model = BUILDERS[family]().eval()
        prune_causal_lm(model, method, Sparsity.parse(sparsity), calib_ids=calib,
                        pairs=pairs if method == "debias-sparsegpt" else None, progress=False,
                        batching=Batching(windows=2, pairs=5))
        out[f"{family} {method} {sparsity}"] = {"weights": {k: v.clone() for k, v in model.state_dict().items()},
                                                "perplexity": perplexity(model, eval_ids, seqlen=16, batch_size=3)}
    return out


_WORKER = """
import sys, torch
sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
import test_torchrun
from fairprune import distributed
with distributed.process_group("cpu") as (rank, size):
    assert size == 2
    out = getattr(test_torchrun, sys.argv[3])(*sys.argv[4:])
if rank == 0:
    torch.save(out, sys.argv[2])
"""


def on_two_ranks(tmp_path: Path, function: str, *args: str):
    """``test_torchrun.<function>(*args)`` run by two gloo ranks under torchrun (one thread each);
    rank 0's result."""
    (tmp_path / "worker.py").write_text(_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--monitor_interval",
           "0.1", str(tmp_path / "worker.py"), str(ROOT / "tests"), str(tmp_path / "two.pt"), function, *args]
    finish(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return torch.load(tmp_path / "two.pt")


def test_two_ranks_prune_tiny_models_bit_for_bit(tmp_path, one_thread):
    """Calibration statistics and perplexity do not depend on the rank count: two gloo ranks under
    torchrun give one process's weights (so masks) and perplexity exactly, not merely close."""
    two, one = on_two_ranks(tmp_path, "prune_tiny_models"), prune_tiny_models()
    assert two.keys() == one.keys() and len(one) == len(RUNS)
    differ = {}
    for run, want in one.items():
        got = two[run]
        assert got["weights"].keys() == want["weights"].keys()
        weights = [k for k in want["weights"] if not torch.equal(got["weights"][k], want["weights"][k])]
        masks = sum(int(((got["weights"][k] == 0) != (want["weights"][k] == 0)).sum()) for k in weights)
        if weights or got["perplexity"] != want["perplexity"]:
            differ[run] = f"{len(weights)} tensors, {masks} mask entries, perplexity {got['perplexity']!r} vs {want['perplexity']!r}"
    assert not differ, differ


def test_each_rank_works_on_its_shard(monkeypatch, one_thread):
    """As rank 1 of 2 (reductions left out): calibration gets batches 1, 3, ... (cut before they are
    dealt out, so each holds the windows it holds in one process), perplexity covers windows 1, 3, ...
    and the stereotype score pairs 1, 3, ..."""
    from fairprune import distributed
    from fairprune.data.pairs import Pair
    from fairprune.metrics import language
    from fairprune.pruning import llm
    from fairprune.pruning.sparsity import Sparsity
    from tiny_models import BUILDERS, VOCAB

    torch.manual_seed(0)
    model = BUILDERS["gpt2"]().eval()
    ids = torch.randint(0, VOCAB, (4 * 8,))
    share = language.perplexity(model, ids.view(4, 8)[1::2].flatten(), seqlen=8)  # windows 1 and 3, alone
    calib = torch.randint(0, VOCAB, (5, 8))
    pairs = (torch.randint(0, VOCAB, (3, 6)), torch.randint(0, VOCAB, (3, 6)), torch.ones(3, 6, dtype=torch.bool))
    seen = []
    modify = llm.modify
    monkeypatch.setattr(llm, "modify", lambda model, inputs, *a, **k:
                        seen.extend(inputs or []) or modify(model, inputs, *a, **k))
    # each sentence's token ids (the tokenizer left out); a3 and b3 are one sentence: a tie
    sentence_ids = {s: [k % VOCAB, (3 * k + 1) % VOCAB, (7 * k + 2) % VOCAB] for k, s in enumerate(
        ["a0", "b0", "a1", "b1", "a2", "b2", "a3"])}
    sentence_ids["b3"] = sentence_ids["a3"]
    monkeypatch.setattr(language, "encode_sentence", lambda tokenizer, sentence: sentence_ids[sentence])
    four = [Pair("a0", "b0"), Pair("a1", "b1", "antistereo"), ("a2", "b2"), Pair("a3", "b3")]
    alone = language.pair_outcomes(model, None, four, batch_size=2)  # one process: every pair
    monkeypatch.setattr(distributed, "world", lambda: (1, 2))
    monkeypatch.setattr(distributed, "all_reduce_sum", lambda tensor: tensor)
    monkeypatch.setattr(distributed, "broadcast", lambda tensor, src=0: tensor)

    assert language.perplexity(model, ids, seqlen=8) == pytest.approx(share, rel=1e-6)
    # Rank 1's pairs: 1 and 3 (a tie: neutral), each in its own slot as one process scores it; the
    # slots of rank 0's pairs (0 and 2) stay empty, as the reductions are left out. Pairs one to a
    # batch (batch_size 2: two sentences) are dealt out 0, 2 / 1, 3.
    outcomes = language.pair_outcomes(model, None, four, batch_size=2)
    for key in ("win", "decided"):
        assert outcomes[key].tolist() == [False, bool(alone[key][1]), False, bool(alone[key][3])], key
    assert bool(alone["decided"][1]) and not bool(alone["decided"][3])
    assert outcomes["anti"].tolist() == [False, True, False, False]
    llm.prune_causal_lm(model, "debias-sparsegpt", Sparsity.parse(0.5), calib_ids=calib, pairs=pairs, progress=False,
                        batching=llm.Batching(windows=2, pairs=2))
    # Batches of two: windows 0-1, 2-3, 4 and pairs 0-1, 2; rank 1 gets windows 2-3 and pair 2.
    plain, paired = seen
    assert torch.equal(plain.ids, calib[2:4]) and not plain.paired
    assert torch.equal(paired.ids, torch.cat([pairs[0][2:], pairs[1][2:]])) and paired.paired
    assert torch.equal(paired.mask, pairs[2][2:])


# --------------------------------------------------------------------------------------------
# FASP: heads scored in shares across two ranks
# --------------------------------------------------------------------------------------------


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


@pytest.mark.slow  # three launches of two processes: about a minute on two cores
def test_fasp_under_torchrun_matches_one_process(tiny_lm, tmp_path, one_thread):
    """``prune.py fasp`` on two ranks (each scores every other head and measures every other γ-search
    trial, rank 0 writes) gives one process's head_scores.csv byte for byte, the same γ search,
    heads removed, report and saved model; a rerun on a cut journal keeps its rows, scores the rest
    and ends with the same journal."""
    from fairprune.data.prompts import holistic_prompts, write_prompts

    frame = holistic_prompts(["gender_and_sex", "religion"])
    prompts = write_prompts(tmp_path / "prompts.csv", frame[frame.descriptor.isin(
        ["female", "male", "trans", "nonbinary", "Christian", "Muslim", "Jewish", "Hindu"])])
    fasp = ["fasp", "--model", str(tiny_lm["model"]), "--gamma", "null", "--alpha", "0.25", "--axis", "all",
            "--scorer", "lexicon", "--prompts", str(prompts), "--max_new_tokens", "4", "--max_batch", "24", "--calib_text", str(tiny_lm["model"].parent / "eval.txt"),
            *tiny_lm["lm"]]  # 24 rows: one head per rank and round, rounds of two heads
    printed = finish(torchrun([*fasp, "--output", "A"], tmp_path / "a"))
    assert prune_main([*fasp, "--output", str(tmp_path / "b" / "B")]) == 0  # one process, no group
    a, b = tmp_path / "a" / "A", tmp_path / "b" / "B"

    assert (a / "head_scores.csv").read_text() == (b / "head_scores.csv").read_text()
    assert (a / "head_scores.json").read_text() == (b / "head_scores.json").read_text()
    ra, rb = report(a), report(b)
    assert ra["heads_removed"] == rb["heads_removed"] and len(ra["heads_removed"]) == 2
    assert ra["protected"] == rb["protected"]
    assert ra["gamma_search"] == rb["gamma_search"] and len(ra["gamma_search"]["trials"]) >= 5
    assert {k: ra[k] for k in ("metrics", "fairness", "reference", "removal")} == {k: rb[k] for k in ("metrics", "fairness", "reference", "removal")}
    got, want = weights(a), weights(b)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # Only rank 0 wrote, and printed the summary once.
    assert files(a) == files(b) and files(a.parent) == [f"A/{name}" for name in files(a)]
    summary = [line for line in printed.splitlines() if "[fasp]" in line and "written to" in line]
    assert len(summary) == 1 and summary[0].startswith("[default0]:"), printed

    # Resume: keep the header and three rows of the journal; the rerun scores the other six heads.
    c = tmp_path / "c" / "C"
    c.mkdir(parents=True)
    lines = (b / "head_scores.csv").read_text().splitlines(keepends=True)
    (c / "head_scores.csv").write_text("".join(lines[:4]))
    (c / "head_scores.json").write_text((b / "head_scores.json").read_text())
    finish(torchrun([*fasp, "--output", "C"], tmp_path / "c"))
    assert (c / "head_scores.csv").read_text() == (b / "head_scores.csv").read_text()
    assert report(c)["heads_removed"] == rb["heads_removed"]


@pytest.mark.slow  # one launch of two processes and one run in this process
def test_fasp_streamed_under_torchrun_matches_one_process_in_memory(tiny_lm, tmp_path, one_thread):
    """``prune.py fasp --stream true`` on two ranks (every rank streams and measures the pruned
    model from the files rank 0 writes) gives one in-memory process's journal, heads, figures and
    weights."""
    fasp = ["fasp", "--model", str(tiny_lm["model"]), "--gamma", "0.25", "--alpha", "0.5", "--scorer", "lexicon",
            "--max_new_tokens", "3", "--max_batch", "24", "--calib_text", str(tiny_lm["model"].parent / "eval.txt"),
            *tiny_lm["lm"]]
    finish(torchrun([*fasp, "--stream", "true", "--output", "A"], tmp_path / "a"))
    assert prune_main([*fasp, "--stream", "false", "--output", str(tmp_path / "b" / "B")]) == 0
    a, b = tmp_path / "a" / "A", tmp_path / "b" / "B"
    assert (a / "head_scores.csv").read_text() == (b / "head_scores.csv").read_text()
    ra, rb = report(a), report(b)
    assert ra["stream"] is True and rb["stream"] is False and ra["heads_removed"] == rb["heads_removed"]
    assert {k: ra[k] for k in ("metrics", "fairness", "reference", "removal")} == {k: rb[k] for k in ("metrics", "fairness", "reference", "removal")}
    got, want = weights(a), weights(b)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert files(a.parent) == [f"A/{name}" for name in files(a)]  # rank 0 alone wrote, no staging folder left


# --------------------------------------------------------------------------------------------
# Streamed pruning (--stream true) under torchrun: every rank streams, rank 0 writes
# --------------------------------------------------------------------------------------------

# Llama (untied head, several shards), GPT-2 (tied head); a plain and a paired statistic.
STREAMED_RUNS = [("llama", "sparsegpt", "2:4"), ("gpt2", "debias-sparsegpt", "0.5"), ("llama", "wanda", "0.5")]


def save_tiny_models(root: Path) -> None:
    """The families of :data:`STREAMED_RUNS` saved by ``save_pretrained`` into ``root/<family>``."""
    from tiny_models import BUILDERS

    for family in {family for family, _, _ in STREAMED_RUNS}:
        torch.manual_seed(0)
        BUILDERS[family]().save_pretrained(root / family, max_shard_size="100KB")


def prune_tiny_models_streamed(root: Path | str, tag: str) -> dict[str, dict]:
    """Each of :data:`STREAMED_RUNS` streamed from ``root/<family>`` (33 calibration windows in
    batches of two, 12 aligned pairs), written by rank 0 (or the only process) into
    ``root/<tag>-<run>``; per run that folder and the per-window NLL of 40 windows measured streamed
    from it. Collective under a process group, alone otherwise."""
    from fairprune import distributed
    from fairprune.causal.streamed import StreamedModel
    from fairprune.hub.shards import ShardWriter
    from fairprune.metrics.language import window_losses
    from fairprune.pruning.llm import Batching, prune_causal_lm
    from fairprune.pruning.sparsity import Sparsity

    calib, eval_ids, pairs = tiny_data()
    root, out = Path(root), {}
    for family, method, sparsity in STREAMED_RUNS:
        sm = StreamedModel(root / family)
        folder = root / f"{tag}-{family}-{method}-{sparsity.replace(':', 'of')}"
        writer = ShardWriter(folder, sm.output_tensors(), total_parameters=sm.num_parameters()) if distributed.is_main() else None
        prune_causal_lm(sm, method, Sparsity.parse(sparsity), calib_ids=calib, progress=False, writer=writer, batching=Batching(windows=2),
                        pairs=pairs if method == "debias-sparsegpt" else None)
        if writer is not None:
            writer.close()
            sm.write_model_files(folder)
        written = Path(distributed.broadcast_text(str(folder) if writer is not None else None))
        nll, count = window_losses(StreamedModel(written), eval_ids, seqlen=16)
        out[f"{family} {method} {sparsity}"] = {"folder": str(written), "nll": nll, "count": count}
    return out


def test_two_ranks_stream_tiny_models_bit_for_bit(tmp_path, one_thread):
    """Streamed under torchrun, every rank reading the blocks from disk and rank 0 alone writing:
    the written weights and the streamed per-window NLL equal one process's streamed run exactly
    (Llama and GPT-2, SparseGPT 2:4, Debias-SparseGPT and Wanda)."""
    from fairprune.hub.shards import ShardReader

    save_tiny_models(tmp_path)
    two = on_two_ranks(tmp_path, "prune_tiny_models_streamed", str(tmp_path), "two")
    one = prune_tiny_models_streamed(tmp_path, "one")
    assert two.keys() == one.keys() and len(one) == len(STREAMED_RUNS)
    for run, want in one.items():
        got_folder, want_folder = Path(two[run]["folder"]), Path(want["folder"])
        assert got_folder.name.startswith("two-") and got_folder.name[4:] == want_folder.name[4:]
        got, expected = ShardReader(got_folder), ShardReader(want_folder)
        assert sorted(got.keys()) == sorted(expected.keys()), run
        differ = [k for k in expected.keys() if not torch.equal(got.read(k), expected.read(k))]
        assert not differ, f"{run}: tensors that differ from one process's: {differ}"
        assert sorted(p.name for p in got_folder.iterdir()) == sorted(p.name for p in want_folder.iterdir())
        assert torch.equal(two[run]["nll"], want["nll"]) and torch.equal(two[run]["count"], want["count"]), run


@pytest.mark.slow  # about 40 s; make test keeps test_two_ranks_stream_tiny_models_bit_for_bit
def test_streamed_cli_under_torchrun_matches_one_process(tiny_lm, tmp_path, one_thread):
    """``prune.py sparsegpt --stream true`` on two ranks writes, from rank 0 alone, the folder and
    figures one streamed process writes (bit for bit), and reports each rank's peak memory;
    ``evaluate --stream true`` on two ranks measures that folder as one process does."""
    sgpt = ["sparsegpt", "--model", str(tiny_lm["model"]), "--sparsity", "2:4", "--nsamples", "16", "--stream", "true",
            "--dense_cache", "false", *tiny_lm["lm"]]
    printed = finish(torchrun([*sgpt, "--output", "A"], tmp_path / "a"))
    assert prune_main([*sgpt, "--output", str(tmp_path / "b" / "B"), "--quiet"]) == 0
    a, b = report(tmp_path / "a" / "A"), report(tmp_path / "b" / "B")
    assert files(tmp_path / "a") == [f"A/{name}" for name in files(tmp_path / "b" / "B")]
    written = [line for line in printed.splitlines() if "written to" in line]
    assert len(written) == 1 and written[0].startswith("[default0]:"), printed
    got, want = weights(tmp_path / "a" / "A"), weights(tmp_path / "b" / "B")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert a["metrics"] == b["metrics"] and a["reference"]["metrics"] == b["reference"]["metrics"]
    assert a["ci"] == b["ci"] and a["paired"] == b["paired"] and a["achieved_sparsity"] == b["achieved_sparsity"]
    peaks = a["memory"]["peak_rss_bytes_per_rank"]
    assert len(peaks) == 2 and all(p > 0 for p in peaks) and a["memory"]["peak_rss_bytes"] == peaks[0]
    assert "peak_rss_bytes_per_rank" not in b["memory"]

    evaluate = ["evaluate", "--model", str(tmp_path / "b" / "B"), "--stream", "true", "--dense_cache", "false",
                *tiny_lm["lm"], "--output", "E"]
    finish(torchrun(evaluate, tmp_path / "e"))
    assert files(tmp_path / "e") == ["E/eval_items.npz", "E/report.json"]
    evaluated = report(tmp_path / "e" / "E")
    assert evaluated["metrics"] == b["metrics"] and evaluated["achieved_sparsity"] == b["achieved_sparsity"]

    # compare --stream true on two ranks: one process's table (each run streamed, rank 0 writing).
    compare = ["compare", "--model", str(tiny_lm["model"]), "--methods", "[magnitude, sparsegpt]", "--sparsities", "[0.5]",
               "--nsamples", "16", "--stream", "true", *tiny_lm["lm"]]
    finish(torchrun([*compare, "--output", "C"], tmp_path / "c"))
    assert prune_main([*compare, "--output", str(tmp_path / "d" / "C"), "--quiet"]) == 0
    two = pd.read_csv(tmp_path / "c" / "C" / "comparison.csv").drop(columns=["prune_seconds", "seconds"])
    one = pd.read_csv(tmp_path / "d" / "C" / "comparison.csv").drop(columns=["prune_seconds", "seconds"])
    pd.testing.assert_frame_equal(two, one)


def prune_with_one_window() -> dict[str, torch.Tensor]:
    """A tiny Llama pruned by SparseGPT from one calibration window: under two ranks, rank 1's share
    is empty, and it must still reduce the same (shared) statistics as rank 0."""
    from fairprune.pruning.llm import prune_causal_lm
    from fairprune.pruning.sparsity import Sparsity
    from tiny_models import BUILDERS

    calib, _, _ = tiny_data()
    torch.manual_seed(0)
    model = BUILDERS["llama"]().eval()
    prune_causal_lm(model, "sparsegpt", Sparsity.parse("0.5"), calib_ids=calib[:1], progress=False)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_rank_without_calibration_batches_agrees_on_shared_statistics(tmp_path, one_thread):
    """One calibration window on two ranks: rank 1 sees no batch, takes rank 0's answer on which
    layers share a statistic, and both end with one process's weights."""
    two, one = on_two_ranks(tmp_path, "prune_with_one_window"), prune_with_one_window()
    assert two.keys() == one.keys() and all(torch.equal(two[k], one[k]) for k in one)


# --------------------------------------------------------------------------------------------
# Mixture-of-experts: each expert's statistics (every token, or the routed ones) summed across ranks
# --------------------------------------------------------------------------------------------

MOE_RUNS = [("mixtral", "sparsegpt", "0.5", "all"), ("qwen3_moe", "wanda", "2:4", "routed"),
            ("olmoe", "sparsegpt", "0.5", "routed"), ("qwen2_moe", "debias-sparsegpt", "0.5", "all")]


def prune_moe_models() -> dict[str, dict]:
    """Each of :data:`MOE_RUNS` (family, method, sparsity, --moe_calibrate) on :func:`tiny_data`, as
    :func:`prune_tiny_models` runs the dense families: the weights and the expert token counts."""
    from fairprune.pruning.llm import Batching, prune_causal_lm
    from fairprune.pruning.options import SolverOptions
    from fairprune.pruning.sparsity import Sparsity
    from tiny_models import moe_model

    calib, _, pairs = tiny_data()
    out = {}
    for family, method, sparsity, mode in MOE_RUNS:
        torch.manual_seed(0)
        model = moe_model(family).eval()
        result = prune_causal_lm(model, method, Sparsity.parse(sparsity), calib_ids=calib,
                                 pairs=pairs if method == "debias-sparsegpt" else None, progress=False,
                                 solver=SolverOptions(moe_calibrate=mode), batching=Batching(windows=2, pairs=5))
        out[f"{family} {method} {sparsity} {mode}"] = {"weights": {k: v.clone() for k, v in model.state_dict().items()},
                                                       "experts": result["experts"]}
    return out


def test_two_ranks_prune_moe_models_bit_for_bit(tmp_path, one_thread):
    two, one = on_two_ranks(tmp_path, "prune_moe_models"), prune_moe_models()
    assert two.keys() == one.keys() and len(one) == len(MOE_RUNS)
    for run, want in one.items():
        got = two[run]
        assert got["experts"] == want["experts"], run
        assert all(torch.equal(got["weights"][k], want["weights"][k]) for k in want["weights"]), run
