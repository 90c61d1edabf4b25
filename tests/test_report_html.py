"""``report.html`` as a person reads it: laid out by a real browser (headless Chromium) at 1280 px,
the headline figures and their intervals fit without sideways scrolling, per-group accuracies have a
table of their own, warnings and left-out data come first, settings are readable, names from the
data stay text. And the plots it embeds: legends beside the data, error bars inside the axes, each
point of the error-rate chart tied to its group, target shares visible over kept shares, and the
LM comparison's perplexity / stereotype-score chart."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import matplotlib
import pandas as pd
import pytest

from fairprune.reporting import plots
from fairprune.reporting.compare import Statistics, write_comparison

matplotlib.use("Agg")

#: Seven groups (FairFace's races), one name with markup characters: names come from the data.
GROUPS = ["White", "Black", "Latino_Hispanic", "East Asian", "Southeast Asian", "Indian", 'Middle <Eastern> & "x"']
CELLS = [("dense", 0.0), ("dense +3 epochs", 0.0), ("magnitude", 0.5), ("fairgrape", 0.5), ("magnitude", 0.7), ("fairgrape", 0.7)]
SKIPPED = {"malformed_name": 3, "others": 0, "unreadable": 1}

# Run after layout, in a copy of the page (report.html itself holds no script): what a reader
# would have to scroll sideways to see, and what each table shows, written onto <body>.
PROBE = """<script>
addEventListener("load", () => {
  const fits = el => el.scrollWidth <= el.clientWidth && el.getBoundingClientRect().right <= innerWidth;
  const tables = [...document.querySelectorAll("table")].map(t => ({
    cls: t.className,
    fits: fits(t.parentElement) && t.getBoundingClientRect().right <= t.parentElement.getBoundingClientRect().right + 1,
    top: t.getBoundingClientRect().top,
    heads: [...t.querySelectorAll("thead th")].map(th => (th.innerText || th.textContent).replace(/\\s+/g, " ").trim()),
    rights: [...t.querySelectorAll("thead th")].map(th => th.getBoundingClientRect().right),
    box: {scroll: t.parentElement.scrollWidth, client: t.parentElement.clientWidth},
    folded: !!t.closest("details:not([open])"),
    first: [...t.querySelectorAll("tbody tr")].map(tr => tr.cells[0].innerText.trim()),
    text: t.innerText}));
  const warning = document.querySelector(".warnings");
  const data = document.querySelector(".data");
  document.body.dataset.probe = JSON.stringify({
    page_fits: document.documentElement.scrollWidth <= innerWidth,
    width: innerWidth, tables,
    warning: warning && {text: warning.innerText, top: warning.getBoundingClientRect().top},
    data: data && {text: data.innerText, top: data.getBoundingClientRect().top},
    images: [...document.images].map(i => ({alt: i.alt, shown: i.naturalWidth > 0 && fits(i.parentElement)})),
    settings: [...document.querySelectorAll(".settings dt")].map(dt => dt.innerText.trim()),
    notes: [...document.querySelectorAll("p.note")].map(p => p.innerText),
    pre: document.querySelectorAll("pre").length,
    injected: document.querySelectorAll("eastern").length + document.scripts.length - 1});
});
</script>"""


def browse(page: Path, tmp_path: Path) -> dict:
    """The probe's findings on ``page`` as laid out by headless Chromium in a 1280 × 900 window."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("needs a headless browser: install chromium (apt-get install -y chromium)")
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    result = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                             "--disable-component-update", "--disable-sync", "--no-first-run",
                             f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1280,900",
                             "--virtual-time-budget=2000", "--dump-dom", probe.as_uri()],
                            capture_output=True, text=True, timeout=120)
    found = re.search(r'data-probe="([^"]*)"', result.stdout)
    assert found, f"the page did not load in chromium: {result.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def vision_rows(seeds: int) -> tuple[list[dict], list, list]:
    """Rows of a vision compare (one per seed and cell; ``seed`` only for several), their
    intervals and the paired differences of fairgrape against magnitude."""
    rows, intervals, paired = [], [], []
    for seed in range(seeds):
        for i, (method, sparsity) in enumerate(CELLS):
            acc = 0.86 - 0.05 * i - 0.013 * seed
            row = {"method": method, "target_sparsity": sparsity, "achieved_sparsity": sparsity * 0.999, "accuracy": acc}
            row.update({f"acc/{g}": min(1.0, acc + 0.03 * (j - 3) + 0.01 * seed) for j, g in enumerate(GROUPS)})
            row.update(acc_gap=0.18 - 0.01 * i, degradation_std=None if method == "dense" else 0.021 + 0.003 * i,
                       seconds=1234.5 * i + seed)
            rows.append({**row, "seed": seed} if seeds > 1 else row)
    for i, (method, sparsity) in enumerate(CELLS):
        acc = 0.86 - 0.05 * i
        ci = {"accuracy": [acc - 0.021, acc + 0.019], "acc_gap": [0.104, 0.251]}
        if method != "dense":
            ci["degradation_std"] = [0.011, 0.043]
        intervals.append(({"method": method, "target_sparsity": sparsity}, ci))
        if method == "fairgrape":
            paired.append(({"method": method, "target_sparsity": sparsity},
                           {f: {"difference": d, "ci": [d - 0.031, d + 0.032], "excludes_zero": abs(d) > 0.031}
                            for f, d in (("accuracy", 0.051), ("acc_gap", -0.012), ("degradation_std", -0.004))}))
    return rows, intervals, paired


@pytest.mark.parametrize("seeds", [1, 3], ids=["one-seed", "mean-sd-over-seeds"])
def test_vision_report_reads_at_1280_px(tmp_path, seeds):
    rows, intervals, paired = vision_rows(seeds)
    extra = {"runs": {f"{m}_s{s:g}": f"/runs/compare/{m}_s{s:g}" for m, s in CELLS[1:]}, "seeds": [0],
             "dense_per_seed": False, "bn_recalibration": 100, "reference": "dense",
             "warnings": ["group 'Middle <Eastern>' has 12 test items (fewer than 30): read its figures as noise"],
             "data": {"skipped": SKIPPED, "samples": {"train": 8000, "val": 1000, "test": 1000}},
             "seconds": {"total": 3600.5}}
    write_comparison(rows, tmp_path, extra, keys=["method", "target_sparsity"], title="Vision <comparison>",
                     statistics=Statistics(intervals, paired, "magnitude"), echo=False)
    seen = browse(tmp_path / "report.html", tmp_path)

    assert seen["width"] == 1280 and seen["page_fits"]
    assert [t["cls"] for t in seen["tables"]][:2] == ["headline", "groups"]
    headline, groups = seen["tables"][:2]
    for table in seen["tables"]:
        assert table["fits"] or table["folded"], f"the {table['cls']} table scrolls sideways at 1280 px: {table['heads']}"
    for table in (headline, groups):
        assert table["first"] == [m for m, _ in CELLS]
    # The headline: accuracy with its interval, the worst group, gap, degradation std and the paired
    # difference of accuracy; no group column, no time (those are in the full table).
    heads = " | ".join(headline["heads"])
    for name in ("accuracy 95% CI", "worst group", "accuracy gap", "degradation std", "Δ accuracy vs magnitude", "paired"):
        assert name in heads, (name, heads)
    assert not any(g in heads for g in GROUPS) and "seconds" not in heads
    assert "[0.84, 0.88]" in headline["text"] and "+0.051 *" in headline["text"] and "[+0.02, +0.08]" in headline["text"]
    # Every column, folded: the full table, as comparison.md has it.
    full = next(t for t in seen["tables"] if t["cls"] == "full")
    assert full["folded"] and {"Δ acc_gap vs magnitude", "Δ degradation_std vs magnitude", "seconds"} <= set(full["heads"])
    # Two sparsities per method: the trade-off curve comes first.
    assert seen["images"][0]["alt"].startswith("The trade-off curve") and (tmp_path / "accuracy_sparsity.png").is_file()
    # The per-group table: one column per group, names as text.
    assert [h for h in groups["heads"] if h not in ("method", "target_sparsity", "target sparsity")] == GROUPS
    assert seen["injected"] == 0
    # Warnings and left-out data before the tables; settings as a definition list, not a JSON dump.
    assert seen["warning"] and "Middle <Eastern>" in seen["warning"]["text"] and seen["warning"]["top"] < headline["top"]
    assert seen["data"] and seen["data"]["top"] < headline["top"]
    for reason, count in SKIPPED.items():
        if count:
            assert f"{count} {reason}" in seen["data"]["text"]
    assert "8000 train" in seen["data"]["text"]
    assert {"runs", "seeds", "bn_recalibration", "reference", "seconds"} <= set(seen["settings"]) and seen["pre"] == 0
    assert seen["images"] and all(i["shown"] for i in seen["images"])


#: The demo's groups (the bundled synthetic UTKFace) and the deploy figures a vision compare measures.
DEMO_GROUPS = ["White", "Black", "Asian", "Indian"]
DEPLOY = {"params (M)": 2.2, "MB": 8.9, "MMACs": 96.0, "ms/img b1 (torch)": 3.1, "ms/img b32 (torch)": 0.9,
          "ms/img b1 (ort)": 1.2, "ms/img b32 (ort)": 0.4}


def demo_rows(granularity: str) -> tuple[list[dict], list, list]:
    """A ``make demo`` comparison (dense, its continued reference, magnitude and FairGRAPE at 80 %)
    as the vision compare writes it: weight pruning keeps the dense sizes; channel pruning
    shrinks the network, and its rows say so in a granularity column."""
    cells = [("dense", 0.0), ("dense +1 epochs", 0.0), ("magnitude", 0.8), ("fairgrape", 0.8)]
    rows, intervals, paired = [], [], []
    for i, (method, sparsity) in enumerate(cells):
        acc = 0.9 - 0.04 * i
        row = {"method": method, **({"granularity": "" if sparsity == 0 else granularity} if granularity == "channel" else {}),
               "target_sparsity": sparsity, "achieved_sparsity": sparsity * 0.998, "accuracy": acc}
        row.update({f"acc/{g}": acc - 0.05 * j for j, g in enumerate(DEMO_GROUPS)})
        row.update(acc_gap=0.15 + 0.01 * i, degradation_std=None if sparsity == 0 else 0.02 + 0.01 * i, seconds=95.5 * i)
        shrink = 0.3 if granularity == "channel" and sparsity else 1.0
        row.update({k: v * (shrink if k != "ms/img b1 (torch)" else 1.0) + (0.01 * i if k.startswith("ms/") else 0)
                    for k, v in DEPLOY.items()})
        rows.append(row)
        key = {k: row[k] for k in ("method", "granularity", "target_sparsity") if k in row and row[k] != ""}
        intervals.append((key, {"accuracy": [acc - 0.03, acc + 0.03], "acc_gap": [0.1, 0.2],
                                "groups": {g: [acc - 0.05 * j - 0.04, acc - 0.05 * j + 0.04] for j, g in enumerate(DEMO_GROUPS)}}))
        if method == "fairgrape":
            paired.append((key, {f: {"difference": d, "ci": [d - 0.02, d + 0.02], "excludes_zero": abs(d) > 0.02}
                                 for f, d in (("accuracy", 0.031), ("acc_gap", -0.012), ("degradation_std", -0.004))}))
    return rows, intervals, paired


@pytest.mark.parametrize("granularity", ["weight", "channel"])
def test_demo_report_shows_the_paired_difference_without_scrolling_at_1280_px(tmp_path, granularity):
    rows, intervals, paired = demo_rows(granularity)
    keys = ["method", "granularity", "target_sparsity"] if granularity == "channel" else ["method", "target_sparsity"]
    extra = {"runs": {"magnitude_s0.8": "/runs/demo/compare/magnitude_s0.8"}, "seeds": [0], "reference": "continued",
             "seconds": {"total": 190.0}}
    write_comparison(rows, tmp_path, extra, keys=keys, title="Vision pruning comparison (magnitude, fairgrape)",
                     statistics=Statistics(intervals, paired, "magnitude"), echo=False)
    seen = browse(tmp_path / "report.html", tmp_path)

    assert seen["page_fits"]
    headline = seen["tables"][0]
    assert headline["cls"] == "headline" and headline["first"][:2] == ["dense", "dense +1 epochs"]
    assert headline["box"]["scroll"] <= headline["box"]["client"], headline["box"]  # no horizontal overflow
    paired_at = next(i for i, h in enumerate(headline["heads"]) if h.startswith("Δ accuracy vs magnitude"))
    assert headline["rights"][paired_at] <= seen["width"], (headline["heads"], headline["rights"])
    assert "+0.031 *" in headline["text"] and "Indian" in headline["text"]  # the worst group, named
    assert not {"MB", "MMACs", "seconds"} & set(headline["heads"])
    full = next(t for t in seen["tables"] if t["cls"] == "full")
    assert full["folded"] and {"MMACs", "ms/img b32 (ort)", "seconds"} <= set(full["heads"])
    deploy = [t for t in seen["tables"] if t["cls"] == "deploy"]
    latency = [i for i in seen["images"] if "latency" in i["alt"]]
    if granularity == "weight":  # every row has the dense sizes: no size table, no latency plot, one line
        assert not deploy and not latency and not (tmp_path / "latency_tradeoff.png").exists()
        assert any("Size, MACs and latency are left out" in n for n in seen["notes"])
    else:
        assert len(deploy) == 1 and deploy[0]["fits"] and {"MB", "MMACs", "ms/img b32 (ort)"} <= set(deploy[0]["heads"])
        assert [f.split()[0] for f in deploy[0]["first"]] == ["dense", "dense", "magnitude", "fairgrape"]
        assert latency and latency[0]["shown"]
    assert all(i["shown"] for i in seen["images"])


def test_lm_report_reads_at_1280_px_with_its_plot(tmp_path):
    rows = [{"method": "dense", "sparsity": "0", "achieved_sparsity": 0.0, "perplexity": 31.2, "stereotype_score": 0.61,
             "stereotype_score_stereo": 0.63, "stereotype_score_antistereo": 0.55, "stereotype_pairs_neutral": 2,
             "prune_seconds": 0.0, "seconds": 12.1}]
    for method in ("magnitude", "wanda", "sparsegpt"):
        for sparsity, factor in (("0.5", 1.5), ("2:4", 3.0)):
            rows.append({"method": method, "sparsity": sparsity, "achieved_sparsity": 0.5, "perplexity": 31.2 * factor,
                         "stereotype_score": 0.6 - 0.01 * factor, "stereotype_score_stereo": 0.62,
                         "stereotype_score_antistereo": 0.5, "stereotype_pairs_neutral": 3, "prune_seconds": 40.2,
                         "seconds": 55.0})
    extra = {"reference": {"method": "dense", "metrics": {"perplexity": 31.2}, "from_cache": True},
             "evaluation": {"tokens": 40000, "window": 1024, "pairs": 1508}, "seconds": {"total": 400.0}}
    write_comparison(rows, tmp_path, extra, echo=False)
    seen = browse(tmp_path / "report.html", tmp_path)

    assert seen["page_fits"] and len(seen["tables"]) >= 1
    table = seen["tables"][0]
    assert table["fits"], table["heads"]
    assert table["first"] == [r["method"] for r in rows]
    assert (tmp_path / "perplexity_bias.png").is_file()
    assert any("perplexity" in i["alt"].lower() and i["shown"] for i in seen["images"])
    assert {"reference", "evaluation", "seconds"} <= set(seen["settings"]) and seen["pre"] == 0


# The plots, as figures (each plot_* function saves the figure its *_figure builder draws).

def _outside(fig, ax, legend) -> bool:
    """The legend lies entirely to the right of, or below, the axes' data area."""
    fig.canvas.draw()
    box, area = legend.get_window_extent(), ax.get_window_extent()
    return box.x0 >= area.x1 - 1 or box.y1 <= area.y0 + 1


def test_group_accuracy_keeps_error_bars_in_view_and_the_legend_off_the_bars():
    table = pd.DataFrame({"method": ["dense", "magnitude"], "target_sparsity": [0.0, 0.5],
                          "acc/a_mean": [0.99, 0.8], "acc/a_sd": [0.04, 0.02], "acc/b_mean": [0.97, 0.7], "acc/b_sd": [0.05, 0.1]})
    fig = plots.group_accuracy_figure(table)
    ax = fig.axes[0]
    assert ax.get_ylim()[1] >= 0.97 + 0.05
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]
    assert _outside(fig, ax, ax.get_legend())


def test_error_rate_points_say_which_group_they_are():
    def report(shift):
        groups = {g: {"fpr": 0.1 + shift * k, "fnr": 0.2 - shift * k} for k, g in enumerate(("Black", "White", "Asian"))}
        return {"groups": groups, "reference": {"groups": {g: {"fpr": 0.1, "fnr": 0.2} for g in groups}}}

    fig = plots.error_rate_figure({"magnitude": report(0.01), "fairgrape": report(0.02)})
    ax = fig.axes[0]
    legends = [child for child in [*ax.get_children(), *fig.legends] if isinstance(child, matplotlib.legend.Legend)]
    labels = [t.get_text() for legend in legends for t in legend.get_texts()] + [t.get_text() for t in ax.texts]
    for name in ("Black", "White", "Asian", "magnitude", "fairgrape"):
        assert any(name in label for label in labels), (name, labels)
    assert legends and all(_outside(fig, ax, legend) for legend in legends)


def test_target_shares_are_drawn_over_the_kept_shares_in_another_style():
    shares = pd.DataFrame([{"step": 1, "layer": f"l{k}", "group": g, "share": 0.5, "target": 0.5}
                           for k in range(4) for g in ("a", "b")])
    fig = plots.group_shares_figure(shares)
    ax = fig.axes[0]
    kept = [line for line in ax.get_lines() if "kept" in str(line.get_label())]
    target = [line for line in ax.get_lines() if "target" in str(line.get_label())]
    assert len(kept) == len(target) == 2
    assert min(t.get_zorder() for t in target) > max(k.get_zorder() for k in kept)
    assert all(t.get_linestyle() != k.get_linestyle() for t, k in zip(target, kept))
    assert _outside(fig, ax, ax.get_legend())


def test_quality_bias_plot_marks_dense_and_draws_intervals_when_rows_carry_them():
    table = pd.DataFrame({"method": ["dense", "wanda", "wanda"], "sparsity": ["0", "0.5", "2:4"],
                          "perplexity": [30.0, 45.0, 90.0], "stereotype_score": [0.6, 0.58, 0.55]})
    fig = plots.quality_bias_figure(table)
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("perplexity") and "stereotype" in ax.get_ylabel()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "dense" in labels and "wanda" in labels and not ax.containers  # no error bars without intervals
    assert {"0.5", "2:4"} <= {t.get_text() for t in ax.texts}
    with_ci = table.assign(perplexity_ci_low=[29.0, 44.0, 85.0], perplexity_ci_high=[31.0, 46.0, 95.0],
                           stereotype_score_ci_low=[0.55, 0.53, 0.5], stereotype_score_ci_high=[0.65, 0.63, 0.6])
    assert plots.quality_bias_figure(with_ci).axes[0].containers
    heads = pd.DataFrame({"method": ["dense", "fasp"], "alpha": [0.0, 0.5], "perplexity": [30.0, 33.0],
                          "bias/gender": [0.2, 0.1], "bias/race": [0.3, 0.2]})
    assert "bias" in plots.quality_bias_figure(heads).axes[0].get_ylabel()
    assert plots.quality_bias_figure(pd.DataFrame({"method": ["dense"], "accuracy": [0.9]})) is None
