"""Faults found by probing the commands with hostile inputs (issue #32): names that look like
mathtext, crafted per-item files of a compare, sizes that cannot fit in memory, and channel
pruning settings that make the model slower."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fairprune.errors import UserError

#: Group and method names matplotlib would read as mathtext (unbalanced, a fraction, sub/superscripts).
MATH_NAMES = ["x$\\frac{1}{$y", "50%_$", "a_b^c", "$\\alpha$"]


def _texts(fig) -> list:
    from matplotlib.text import Text

    return [t for t in fig.findobj(Text) if t.get_text()]


def _assert_literal(fig, names) -> None:
    """Every name is drawn by a text object as written, none parsed as mathtext or TeX."""
    texts = _texts(fig)
    shown = {t.get_text() for t in texts}
    for name in names:
        assert any(name in s for s in shown), (name, shown)
    assert not [t.get_text() for t in texts if t.get_parse_math() or t.get_usetex()]


def test_group_names_with_dollars_are_drawn_literally_in_every_plot(tmp_path):
    """A ``$`` in a group or method name is data: every plot is written and shows the name as it is."""
    from fairprune.reporting import plots

    a, b, c, d = MATH_NAMES
    report = {"groups": {n: {"accuracy": 0.8, "fpr": 0.1 + 0.01 * i, "fnr": 0.2 - 0.01 * i} for i, n in enumerate(MATH_NAMES)},
              "reference": {"groups": {n: {"accuracy": 0.9, "fpr": 0.1, "fnr": 0.2} for n in MATH_NAMES}}}
    path = plots.plot_error_rate_changes({a: report, b: report}, tmp_path / "errors.png")
    assert path.is_file() and path.stat().st_size > 0
    _assert_literal(plots.error_rate_figure({a: report, b: report}), MATH_NAMES)

    table = pd.DataFrame([{"method": m, "target_sparsity": 0.5, "accuracy": 0.8, "ms/img b32 (ort)": 0.2 + i,
                           **{f"acc/{n}": 0.7 + 0.01 * j for j, n in enumerate(MATH_NAMES)}}
                          for i, m in enumerate((c, d))])
    assert plots.plot_group_accuracy(table, tmp_path / "acc.png").is_file()
    _assert_literal(plots.group_accuracy_figure(table), MATH_NAMES)
    assert plots.plot_latency_tradeoff(table, tmp_path / "latency.png").is_file()
    _assert_literal(plots.latency_tradeoff_figure(table), [c, d])

    shares = pd.DataFrame([{"step": 1, "layer": f"layer{i}", "group": n, "share": 0.25, "target": 0.25}
                           for i in range(3) for n in MATH_NAMES])
    assert plots.plot_group_shares(shares, tmp_path / "shares.png").is_file()
    _assert_literal(plots.group_shares_figure(shares), MATH_NAMES)

    lm = pd.DataFrame([{"method": m, "sparsity": s, "perplexity": 20.0 + 10 * s + i, "bias/" + b: 0.1 + s}
                       for i, m in enumerate((a, c)) for s in (0.3, 0.5)])
    assert plots.plot_quality_bias(lm, tmp_path / "quality.png").is_file()
    _assert_literal(plots.quality_bias_figure(lm), [a, c, b])

    assert plots.plot_head_heatmap(np.zeros((2, 3)), [a, b], path=tmp_path / "heads.png").is_file()
    bias = pd.DataFrame(np.random.default_rng(0).normal(size=(6, 3)), columns=[a, b, c])
    assert plots.plot_axis_correlation(bias, tmp_path / "corr.png").is_file()


def test_a_comparison_with_dollar_group_names_writes_its_table_page_and_plots(tmp_path):
    """compare's last step (the one writer of the table, page and plots) finishes with such names."""
    from fairprune.reporting.compare import write_comparison

    rows = [{"method": m, "target_sparsity": s, "accuracy": 0.8, **{f"acc/{n}": 0.7 + 0.01 * j for j, n in enumerate(MATH_NAMES)}}
            for m, s in (("dense", 0.0), ("magnitude", 0.5))]
    write_comparison(rows, tmp_path, echo=False)
    for name in ("comparison.md", "report.html", "group_accuracy.png"):
        assert (tmp_path / name).is_file(), name


# -- crafted test_items.npz in a vision compare -------------------------------------------------

GROUPS = ["A", "B", "C"]


def _items(n: int = 60, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"correct": rng.random(n) < 0.7, "group": np.arange(n, dtype=np.int64) % len(GROUPS),
            "item": np.arange(n, dtype=np.int64)}


def _cell(tmp_path, name: str, **arrays) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    np.savez(folder / "test_items.npz", **arrays)
    return folder


def _report(accuracy: float = 0.7) -> dict:
    groups = {g: {"accuracy": accuracy, "fpr": 0.1, "fnr": 0.2, "count": 20} for g in GROUPS}
    return {"metrics": {"accuracy": accuracy}, "groups": groups, "reference": {"groups": groups}}


CRAFTED = {
    "reversed ids": lambda a: {**a, "item": a["item"][::-1].copy()},
    "short arrays": lambda a: {**a, "correct": a["correct"][:10]},
    "group ids out of range": lambda a: {**a, "group": a["group"] + 7},
    "object dtype": lambda a: {**a, "correct": a["correct"].astype(object)},
    "2-D": lambda a: {**a, "group": a["group"].reshape(6, 10)},
    "float outcomes": lambda a: {**a, "correct": a["correct"] + 0.5},
    "all arrays cut short": lambda a: {k: v[:30] for k, v in a.items()},
    "no group array": lambda a: {k: v for k, v in a.items() if k != "group"},
}


def _compare(tmp_path, crafted, remeasure):
    from fairprune.workflows.options import VisionCompareOptions
    from fairprune.workflows.paired import compare_statistics

    good = _items()
    folders = {"magnitude_s0.5": [_cell(tmp_path, "magnitude_s0.5", **good)],
               "fairgrape_s0.5": [_cell(tmp_path, "fairgrape_s0.5", **crafted(good))],
               "snip_s0.5": [_cell(tmp_path, "snip_s0.5", **_items(seed=1))]}
    reports = {name: [_report()] for name in folders}
    notes: list[str] = []
    compare = VisionCompareOptions(["magnitude", "fairgrape", "snip"], [0.5], baseline="magnitude")
    paired = compare_statistics(reports, folders, [_report()], compare, [], remeasure=remeasure, notes=notes).paired
    return {row["method"] for row, _ in paired}, notes


@pytest.mark.parametrize("fault", list(CRAFTED))
def test_a_crafted_items_file_is_measured_again(tmp_path, capsys, fault):
    """A compare cell's test_items.npz that is not what the run wrote (reversed ids, arrays of
    different or shorter lengths, group ids past the groups, Python objects, ...) is one warning
    line saying what is wrong, the cell is measured again, and its paired columns are there."""
    measured = []

    def remeasure(folder):
        measured.append(folder.name)
        np.savez(folder / "test_items.npz", **_items(seed=2))

    methods, notes = _compare(tmp_path, CRAFTED[fault], remeasure)
    assert measured == ["fairgrape_s0.5"]
    assert methods == {"fairgrape", "snip"}
    printed = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(printed) == 1 and "fairgrape_s0.5" in printed[0] and "measured again" in printed[0], printed
    assert notes and "Traceback" not in printed[0]


@pytest.mark.parametrize("fault", ["reversed ids", "object dtype", "all arrays cut short"])
def test_a_crafted_items_file_that_cannot_be_measured_again_drops_its_paired_columns(tmp_path, capsys, fault):
    """When measuring again fails too, the cell's paired columns are left out, with a warning; the
    other cells keep theirs."""
    def remeasure(folder):
        raise UserError(f"checkpoint '{folder}/checkpoints/last.ckpt' does not exist")

    methods, notes = _compare(tmp_path, CRAFTED[fault], remeasure)
    assert methods == {"snip"}
    printed = capsys.readouterr().out
    assert "measured again" in printed and "paired columns are left out" in printed and len(notes) == 2


def test_measure_items_again_rewrites_a_pruning_runs_items(dense_ckpt, tmp_path):
    """The re-measure compare uses: a pruning run's checkpoints/last.ckpt tested again item by item
    gives the items file the run wrote."""
    from fairprune.workflows.paired import read_items
    from fairprune.workflows.vision import measure_items_again, prune_vision

    fast = {"limit_train_batches": 2, "limit_val_batches": 2, "limit_test_batches": 2, "accelerator": "cpu",
            "enable_progress_bar": False, "enable_model_summary": False}
    prune_vision(str(dense_ckpt), {"method": "magnitude", "target_sparsity": 0.5, "keep_per_iter": 0.5,
                                   "bn_recalibration": 2}, str(tmp_path), "cell", fast, reference="dense", deploy=False)
    folder = tmp_path / "cell"
    written = read_items(folder)
    np.savez(folder / "test_items.npz", **{**dict(zip(("correct", "group", "item"), written)), "item": written[2][::-1]})
    measure_items_again(folder)
    for before, after in zip(written, read_items(folder)):
        np.testing.assert_array_equal(before, after)


# -- sizes that cannot fit in memory --------------------------------------------------------------

GB = 1_000_000_000


def test_export_refuses_an_image_size_that_cannot_fit(dense_ckpt, tmp_path, capsys, monkeypatch):
    """prune.py export estimates the check batch's input and activations before allocating them:
    over the memory available it is one line naming the size, and no file is written."""
    from cli_output import last_error
    from fairprune.cli.prune import main as prune_main

    monkeypatch.setattr("fairprune.workflows.export.available_memory", lambda: 8 * GB, raising=False)
    output = tmp_path / "model.onnx"
    assert prune_main(["export", "--ckpt", str(dense_ckpt), "--output", str(output), "--image_size", "100000"]) == 2
    line = last_error(capsys)
    assert "100000" in line and "600.0 GB" in line and "8.0 GB" in line and "--image_size" in line
    # The activations count too: 64 px fit as an input, not with the network's outputs, in 1 MB.
    monkeypatch.setattr("fairprune.workflows.export.available_memory", lambda: 1_000_000, raising=False)
    assert prune_main(["export", "--ckpt", str(dense_ckpt), "--output", str(output), "--image_size", "64"]) == 2
    assert "activations" in last_error(capsys)
    assert not output.exists() and not list(tmp_path.iterdir())


def test_an_lm_folder_whose_config_cannot_fit_is_refused_before_loading(tmp_path, monkeypatch):
    """A transformers config with hidden_size 1e6: the parameters are estimated from the config
    (built on the meta device) before from_pretrained, and refused in one line naming the size and
    --stream true."""
    import json

    from fairprune.hub import load_model

    monkeypatch.setattr("fairprune.hub.checks.available_memory", lambda swap=False: 16 * GB, raising=False)
    folder = tmp_path / "huge"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 1_000_000, "n_layer": 2, "n_head": 4,
                                                    "vocab_size": 1000}))
    with pytest.raises(UserError, match=r"e\+13 parameters .*TB.*16\.0 GB.*--stream true") as err:
        load_model(str(folder))
    assert "\n" not in str(err.value)


def test_a_small_lm_config_is_not_refused(tmp_path, monkeypatch):
    """The estimate is of the config's own sizes: a tiny model loads under a tight limit."""
    import transformers

    from fairprune.hub import load_model

    monkeypatch.setattr("fairprune.hub.checks.available_memory", lambda swap=False: 50_000_000, raising=False)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "tiny")
    assert sum(p.numel() for p in load_model(str(tmp_path / "tiny")).parameters()) > 0


# -- channel pruning that makes the model slower ---------------------------------------------------

def test_channel_multiple_defaults_to_what_cpu_kernels_block_by():
    """The default rounds kept channel counts to multiples of 8 (1 made MobileNet-V2 slower than dense)."""
    import inspect

    from fairprune.callbacks.pruning import IterativePruning

    assert inspect.signature(IterativePruning).parameters["channel_multiple"].default == 8
    assert IterativePruning("magnitude", granularity="channel").channel_multiple == 8


def _deploy(pruned_ms: float, dense_ms: float) -> dict:
    def figures(ms):
        return {"parameters": 1, "ms_per_image": {"torch": {"1": ms, "32": ms / 2}, "ort": {"1": ms / 2, "32": ms / 4}}}

    return {"pruned": figures(pruned_ms), "dense": figures(dense_ms), "settings": {}}


def test_a_pruned_network_slower_than_dense_is_one_warning_line():
    """Deploy figures with the pruned network 2.5x slower than dense (ONNX Runtime, batch 32) give
    one warning line saying by how much and suggesting channel_multiple 8 or 16; faster, equal
    within timing noise, missing or failed figures give none."""
    from fairprune.models.deploy import slower_than_dense

    line = slower_than_dense(_deploy(2.5, 1.0), "channel", 1)
    assert line is not None and "\n" not in line
    assert "2.5x slower" in line and "ONNX Runtime at batch 32" in line and "--pruning.channel_multiple 8 or 16" in line
    assert "(this run: 1)" in line
    assert slower_than_dense(_deploy(1.5, 1.0), "weight") is None  # the same shapes: a gap is timing noise
    for deploy in (_deploy(0.6, 1.0), _deploy(1.02, 1.0), {"error": "no image_size"}, None, {"pruned": {}, "dense": {}}):
        assert slower_than_dense(deploy, "channel", 8) is None
    only_torch = {k: v for k, v in _deploy(3.0, 1.0).items()}
    for name in ("pruned", "dense"):
        only_torch[name] = {"ms_per_image": {"torch": {"1": 3.0 if name == "pruned" else 1.0}}}
    assert "3x slower than the dense one in PyTorch at batch 1" in slower_than_dense(only_torch, "channel")


def test_a_vision_run_whose_deploy_figures_are_slower_prints_the_warning(dense_ckpt, tmp_path, capsys, monkeypatch):
    """prune.py vision: the run's own deploy figures (here made 2.5x slower) put the line in the
    report's warnings and print it as a warning."""
    from fairprune.workflows import vision

    monkeypatch.setattr(vision, "deploy_report", lambda models, shape, *a, **k: _deploy(2.5, 1.0))
    fast = {"limit_train_batches": 2, "limit_val_batches": 2, "limit_test_batches": 2, "accelerator": "cpu",
            "enable_progress_bar": False, "enable_model_summary": False}
    report = vision.prune_vision(str(dense_ckpt), {"method": "magnitude", "target_sparsity": 0.5, "keep_per_iter": 0.5,
                                                   "granularity": "channel", "bn_recalibration": 2},
                                 str(tmp_path), "cell", fast, reference="dense")
    slower = [w for w in report["warnings"] if "slower than the dense one" in w]
    assert len(slower) == 1 and "(this run: 8)" in slower[0]
    assert f"[prune] warning: {slower[0]}" in capsys.readouterr().out
