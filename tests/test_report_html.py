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
from fairprune.reporting.compare import write_comparison

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
    heads: [...t.querySelectorAll("thead th")].map(th => th.innerText.replace(/\\s+/g, " ").trim()),
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
                     intervals=intervals, paired=paired, baseline="magnitude", echo=False)
    seen = browse(tmp_path / "report.html", tmp_path)

    assert seen["width"] == 1280 and seen["page_fits"]
    assert [t["cls"] for t in seen["tables"]][:2] == ["headline", "groups"]
    headline, groups = seen["tables"][:2]
    for table in seen["tables"]:
        assert table["fits"], f"the {table['cls']} table scrolls sideways at 1280 px: {table['heads']}"
    for table in (headline, groups):
        assert table["first"] == [m for m, _ in CELLS]
    # The headline: every figure with its interval, the paired differences, the time; no group column.
    heads = " | ".join(headline["heads"])
    for name in ("accuracy", "acc_gap", "degradation_std", "Δ accuracy vs magnitude", "Δ acc_gap vs magnitude",
                 "Δ degradation_std vs magnitude", "seconds", "95% CI"):
        assert name in heads, (name, heads)
    assert not any(g in heads for g in GROUPS)
    for lo, hi in ((0.839, 0.879), (0.104, 0.251), (0.011, 0.043)):
        assert f"[{lo:.3f}, {hi:.3f}]" in headline["text"]
    assert "+0.051" in headline["text"] and "[+0.020, +0.083]" in headline["text"]
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
