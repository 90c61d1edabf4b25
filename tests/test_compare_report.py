"""Comparisons: repeated runs over seeds (mean ± sd, n), the single-seed layout, and ``report.html``
as one self-contained page for a vision and an LM compare."""

from __future__ import annotations

import base64
import json
import statistics
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import torch

from fairprune.cli.prune import main as prune_main
from fairprune.reporting.compare import aggregate, write_comparison
from fairprune.reporting.headline import number
from fairprune.reporting.records import LMRow, VisionRow
from processes import clean_env

ROOT = Path(__file__).resolve().parents[1]
FAST = {"limit_train_batches": 2, "limit_val_batches": 2, "limit_test_batches": 2, "accelerator": "cpu",
        "enable_progress_bar": False, "enable_model_summary": False}
ONE_STEP = {"keep_per_iter": 0.5, "bn_recalibration": 2}


class _Page(HTMLParser):
    """Every tag and the URL-bearing attributes of an HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.urls: list[str] = []
        self.cells: list[str] = []
        self._in_cell = False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.urls += [v or "" for k, v in attrs if k in ("src", "href", "srcset", "data", "action")]
        self._in_cell = tag == "td"

    def handle_endtag(self, tag):
        self._in_cell = False if tag == "td" else self._in_cell

    def handle_data(self, data):
        if self._in_cell:
            self.cells.append(data)


def assert_self_contained(page: Path, names: list[str], images: int) -> None:
    """Loads nothing from anywhere: no scripts, no style sheets, every image a PNG data URI; every
    name in ``names`` is a table cell; at least ``images`` images."""
    text = page.read_text()
    parsed = _Page()
    parsed.feed(text)
    assert "script" not in parsed.tags and "link" not in parsed.tags and "iframe" not in parsed.tags
    assert "http://" not in text and "https://" not in text and "url(" not in text and "@import" not in text
    assert all(u.startswith("data:image/png;base64,") for u in parsed.urls), [u[:40] for u in parsed.urls]
    assert parsed.tags.count("img") >= images
    for url in parsed.urls:
        assert base64.b64decode(url.split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n")
    assert set(names) <= set(parsed.cells), set(names) - set(parsed.cells)


def test_aggregate_gives_mean_sd_and_n_per_method_and_setting():
    rows = [{"method": m, "sparsity": s, "seed": seed, "accuracy": acc, "gap": None if m == "dense" else acc / 10}
            for seed, accs in enumerate([(0.9, 0.7, 0.5), (0.8, 0.6, 0.45), (0.85, 0.65, 0.4)])
            for (m, s), acc in zip([("dense", "0"), ("magnitude", "0.5"), ("magnitude", "2:4")], accs)]
    table = aggregate(rows, ["method", "sparsity"])
    assert list(zip(table["method"], table["sparsity"])) == [("dense", "0"), ("magnitude", "0.5"), ("magnitude", "2:4")]
    assert list(table["n"]) == [3, 3, 3]
    assert table["accuracy_mean"].tolist() == pytest.approx([0.85, 0.65, 0.45])
    assert table["accuracy_sd"].tolist() == pytest.approx([statistics.stdev([0.9, 0.8, 0.85]),
                                                           statistics.stdev([0.7, 0.6, 0.65]),
                                                           statistics.stdev([0.5, 0.45, 0.4])])
    assert table["gap_mean"].isna().iloc[0] and table["gap_mean"].iloc[2] == pytest.approx(0.045)


def test_vision_compare_over_seeds(dense_ckpt, tmp_path, one_thread):
    out = tmp_path / "cmp"
    assert prune_main(["compare", "--ckpt", str(dense_ckpt), "--methods", "[magnitude, fairgrape]", "--sparsities", "[0.5]",
                       "--seeds", "[0, 1]", "--dense_per_seed", "true", "--pruning", json.dumps(ONE_STEP),
                       "--trainer", json.dumps(FAST), "--output", str(out)]) == 0
    # Every seed's runs in its own folder, with its own dense model (a different initialisation).
    for seed in (0, 1):
        for run in ("magnitude_s0.5", "fairgrape_s0.5"):
            assert (out / f"seed{seed}" / run / "report.json").is_file()
    dense = [torch.load(out / f"seed{s}" / "dense" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
             for s in (0, 1)]
    assert not all(torch.equal(dense[0][k], dense[1][k]) for k in dense[0] if k.endswith("weight"))
    # The table against the per-seed reports.
    table = pd.read_csv(out / "comparison.csv")
    # The dense checkpoint, the compute-matched reference (it trained as long as the schedule retrains), the methods.
    assert list(table["method"]) == ["dense", "dense +1 epochs", "magnitude", "fairgrape"] and (table["n"] == 2).all()
    for method in ("magnitude", "fairgrape"):
        reports = [json.loads((out / f"seed{s}" / f"{method}_s0.5" / "report.json").read_text()) for s in (0, 1)]
        records = [VisionRow.from_report(r, method, 0.5, seed=s) for s, r in zip((0, 1), reports)]
        accs = [r.accuracy for r in records]
        row = table.set_index("method").loc[method]
        assert row["accuracy_mean"] == pytest.approx(statistics.mean(accs))
        assert row["accuracy_sd"] == pytest.approx(statistics.stdev(accs), abs=1e-12)
        group = next(iter(records[0].group_accuracy))
        assert row[f"acc/{group}_mean"] == pytest.approx(statistics.mean(r.group_accuracy[group] for r in records))
        dense_accs = [VisionRow.dense(r).accuracy for r in reports]
    assert table.set_index("method").loc["dense", "accuracy_mean"] == pytest.approx(statistics.mean(dense_accs))
    assert len(pd.read_csv(out / "comparison_runs.csv")) == 8  # dense, reference, magnitude, fairgrape × 2 seeds
    assert "±" in (out / "comparison.md").read_text()
    saved = json.loads((out / "report.json").read_text())
    assert saved["seeds"] == [0, 1] and saved["dense_per_seed"] is True and saved["bn_recalibration"] == 2
    for plot in ("group_accuracy.png", "error_rate_changes.png", "group_shares.png"):
        assert (out / plot).is_file(), plot
    # Weight pruning keeps the dense shapes: latency differs by noise alone, so no latency plot.
    assert "MMACs_mean" in table.columns and not (out / "latency_tradeoff.png").exists()
    assert_self_contained(out / "report.html", ["dense", "magnitude", "fairgrape"], images=3)


def table_block(out: str, title: str) -> list[str]:
    """The printed table: the lines from its title to the line that says where the files are."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == title)
    end = next(i for i, line in enumerate(lines) if line.startswith("[compare] written to") and i > start)
    return lines[start:end]


def test_the_compare_command_prints_the_headline_in_100_columns_without_library_warnings(dense_ckpt, tmp_path):
    """``prune.py compare`` as a user runs it (its own process, as ``make demo`` does): the printed
    table holds the headline figures within 100 columns, and no library deprecation notes."""
    out = tmp_path / "cmp"
    env = clean_env(OMP_NUM_THREADS="1", COLUMNS="200")  # a wide terminal: the table stays within 100
    run = subprocess.run([sys.executable, str(ROOT / "prune.py"), "compare", "--ckpt", str(dense_ckpt),
                          "--methods", "[magnitude, fairgrape]", "--sparsities", "[0.5]", "--pruning", json.dumps(ONE_STEP),
                          "--trainer", json.dumps(FAST), "--output", str(out)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for text in ("DeprecationWarning", "FutureWarning", "LeafSpec", "deprecated"):
        assert text not in run.stdout + run.stderr, (text, (run.stdout + run.stderr)[-3000:])
    block = table_block(run.stdout, "Vision pruning comparison (magnitude, fairgrape)")
    assert all(len(line) <= 100 for line in block), "\n".join(block)
    table = pd.read_csv(out / "comparison.csv")
    rows = {line.split("  ")[0].strip(): line for line in block}
    for _, row in table.iterrows():
        line = rows[row["method"]]
        accuracy = f"{row['accuracy']:.3f} [{row['accuracy_ci_low']:.2f}, {row['accuracy_ci_high']:.2f}]"
        worst = min((row[c], c[4:]) for c in table.columns
                    if c.startswith("acc/") and not c.endswith(("_low", "_high")) and row[c] == row[c])
        assert accuracy in line and f"{worst[0]:.3f} {worst[1]}" in line and f"{row['acc_gap']:.3f}" in line, line
    fairgrape = table.set_index("method").loc["fairgrape"]
    assert f"{fairgrape['accuracy_diff']:+.3f} [{fairgrape['accuracy_diff_ci_low']:+.2f}," in rows["fairgrape"]
    assert f"{fairgrape['degradation_std']:.3f}" in rows["fairgrape"]
    heads = " ".join(block[:4])
    for head in ("sparsity", "acc", "worst", "gap", "std", "Δ acc vs", "magnitude"):
        assert head in heads, (head, block[:4])
    assert "MMACs" not in "\n".join(block) and "MMACs" in (out / "comparison.md").read_text()  # the full table


def test_one_seed_keeps_the_single_run_layout(dense_ckpt, tmp_path, one_thread):
    from fairprune.workflows.options import VisionCompareOptions
    from fairprune.workflows.vision import compare_vision

    table = compare_vision(str(dense_ckpt), VisionCompareOptions(["magnitude"], [0.5], ONE_STEP, FAST, seeds=[3]), str(tmp_path))
    assert list(table["method"]) == ["dense", "dense +1 epochs", "magnitude"]
    assert "accuracy" in table and "n" not in table and "seed" not in table
    assert (tmp_path / "magnitude_s0.5" / "report.json").is_file() and not list(tmp_path.glob("seed*"))
    report = json.loads((tmp_path / "magnitude_s0.5" / "report.json").read_text())
    assert report["bn_recalibration"]["batches"] == 2
    # The table's rows are the records of the run's report, of the dense checkpoint and of the continued
    # reference, column for column (the intervals follow them).
    records = [VisionRow.dense(report), VisionRow.continued(report), VisionRow.from_report(report, "magnitude", 0.5)]
    for row, record in zip(table.to_dict(orient="records"), records):
        expected = record.as_dict()
        assert list(row)[:len(expected)] == list(expected)
        assert all(c.endswith(("_ci_low", "_ci_high", "_diff")) for c in list(row)[len(expected):])
        got = {k: row[k] for k in expected if not pd.isna(row[k])}
        assert got == pytest.approx({k: v for k, v in expected.items() if v is not None})
        assert row["accuracy_ci_low"] <= row["accuracy"] <= row["accuracy_ci_high"]
    assert_self_contained(tmp_path / "report.html", ["dense", "magnitude"], images=2)


def test_lm_compare_writes_a_self_contained_page(tmp_path, capsys):
    from fairprune.cli.train import main as train_main

    gpt2 = '{"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64}'
    assert train_main(["fit", "--config", str(ROOT / "configs/lm/tiny_gpt2.yaml"), "--data.corpus_docs", "150",
                       "--data.seqlen", "32", "--data.batch_size", "8", "--data.bpe_vocab_size", "400",
                       "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
                       "--trainer.accelerator", "cpu", "--model.init_args.config", gpt2,
                       "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]) == 0
    model = next((tmp_path / "runs").glob("**/model/config.json")).parent
    from fairprune.data.text import lm_corpus, stereo_pairs

    (tmp_path / "eval.txt").write_text(lm_corpus(train_docs=1, validation_docs=4, seed=5).validation)
    pairs = ["sent_more,sent_less,stereo_antistereo"] + [f'"{a}","{b}",stereo' for a, b in stereo_pairs()[::40]]
    (tmp_path / "pairs.csv").write_text("\n".join(pairs) + "\n")
    out = tmp_path / "cmp"
    assert prune_main(["compare", "--model", str(model), "--methods", "[magnitude, wanda]", "--sparsities", '["0.5"]',
                       "--nsamples", "2", "--seqlen", "32", "--device", "cpu", "--eval_text", str(tmp_path / "eval.txt"),
                       "--pairs", str(tmp_path / "pairs.csv"), "--output", str(out)]) == 0
    table = pd.read_csv(out / "comparison.csv")
    assert list(table["method"]) == ["dense", "magnitude", "wanda"]
    wanda = LMRow.from_report(json.loads(next(out.glob("wanda_*/report.json")).read_text()), "wanda", "0.5").as_dict()
    assert list(table.columns[: len(wanda)]) == list(wanda)  # then the intervals and the paired differences
    assert {"perplexity_ci_low", "stereotype_score_ci_high", "perplexity_ratio_diff"} <= set(table.columns)
    figures = [c for c in wanda if c not in ("method", "sparsity")]
    # A figure without data (no antistereo pair: that part of the stereotype score) is null in
    # report.json and an empty cell in the CSV.
    expected = [float("nan") if wanda[c] is None else wanda[c] for c in figures]
    assert table.iloc[2][figures].tolist() == pytest.approx(expected, nan_ok=True)
    assert_self_contained(out / "report.html", ["dense", "magnitude", "wanda"], images=0)
    # The printed table: the LM headline (perplexity with its interval, stereotype score, the perplexity
    # ratio against the baseline) within 100 columns.
    block = table_block(capsys.readouterr().out, "Language-model pruning comparison")
    assert all(len(line) <= 100 for line in block), "\n".join(block)
    printed = "\n".join(block)
    for _, row in table.iterrows():
        assert f"{number(row['perplexity'])} [{number(row['perplexity_ci_low'], 2)}, " in printed, (row, printed)
        assert f"{row['stereotype_score']:.3f}" in printed, (row, printed)
    assert "ppl × vs " in printed and f"×{table.iloc[2]['perplexity_ratio_diff']:.3f}" in printed


def test_latency_tradeoff_plot_reads_the_deploy_columns(tmp_path):
    """With measured latency of networks of different sizes (channel pruning) the comparison plots
    accuracy and the worst group (the lowest group accuracy of each row) against it, error bars over
    seeds; without latency, or where every network has the dense size, there is no such plot."""
    from fairprune.reporting.plots import latency_tradeoff_figure

    rows = [{"method": m, "seed": seed, "accuracy": acc + 0.01 * seed, "acc/A": a, "acc/B": b + 0.02 * seed,
             "MB": mb, "ms/img b32 (ort)": ms * (1 + 0.1 * seed)}
            for seed in (0, 1) for m, acc, a, b, ms, mb in (("dense", 0.9, 0.95, 0.85, 0.4, 8.9),
                                                            ("fairgrape", 0.88, 0.8, 0.9, 0.2, 2.7))]
    write_comparison(rows, tmp_path, echo=False)
    assert (tmp_path / "latency_tradeoff.png").is_file()
    table = pd.read_csv(tmp_path / "comparison.csv")
    fig = latency_tradeoff_figure(table)
    worst = [line for line in fig.axes[0].get_legend_handles_labels()[1] if "worst group" in line]
    assert worst == ["dense: worst group (B)", "fairgrape: worst group (A)"]  # B is dense's lowest, A fairgrape's
    write_comparison([{k: v for k, v in r.items() if not k.startswith("ms/")} for r in rows], tmp_path / "plain", echo=False)
    assert not (tmp_path / "plain" / "latency_tradeoff.png").exists()
    write_comparison([{**r, "MB": 8.9} for r in rows], tmp_path / "same_size", echo=False)
    assert not (tmp_path / "same_size" / "latency_tradeoff.png").exists()


def test_a_page_with_an_external_reference_fails_the_check(tmp_path):
    """The check itself can fail: a remote image is caught."""
    write_comparison([{"method": "dense", "accuracy": 0.9}, {"method": "magnitude", "accuracy": 0.8}], tmp_path, echo=False)
    assert_self_contained(tmp_path / "report.html", ["dense", "magnitude"], images=0)
    page = tmp_path / "report.html"
    page.write_text(page.read_text().replace("</body>", '<img src="https://example.org/x.png"></body>'))
    with pytest.raises(AssertionError):
        assert_self_contained(page, ["dense", "magnitude"], images=0)


VISION_CONFIGS = sorted(p.name for p in (ROOT / "configs" / "compare").glob("*.yaml") if "ckpt:" in p.read_text())


@pytest.mark.parametrize("config", VISION_CONFIGS)
def test_every_vision_compare_config_parses_into_valid_pruning_settings(config):
    from fairprune.callbacks.pruning import IterativePruning
    from fairprune.cli.prune import build_parser

    cfg = build_parser("compare").parse_args(["--config", str(ROOT / "configs" / "compare" / config)])
    assert cfg.methods and cfg.sparsities
    for method in cfg.methods:
        for sparsity in cfg.sparsities:
            callback = IterativePruning(**{**dict(cfg.pruning), "method": method, "target_sparsity": float(sparsity)})
            assert callback.bn_recalibration > 0  # on in every shipped config
    if config == "demo_seeds.yaml":
        assert cfg.seeds == [0, 1, 2]
