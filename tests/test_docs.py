"""The documentation stays true: every command it shows runs a subcommand, options and a make target
that exist; every ``report.json`` key a run writes is described in docs/outputs.md; the site builds.

The commands are taken from the fenced code blocks and the inline code spans of README.md, every
page under docs/ and data/README.md (which docs/data.md includes). Each distinct subcommand's
``--help`` is read once, in this process."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "data" / "README.md", *(ROOT / "docs").rglob("*.md")])
OUTPUTS = ROOT / "docs" / "outputs.md"

FENCE = re.compile(r"^ *(`{3,})[^\n]*\n(.*?)^ *\1 *$", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
COMMAND = re.compile(r"(?:^|[\s;&(=])(?:python3?|torchrun(?: +--\S+(?: +\d+)?)*) +(prune|train)\.py\b([^#\n]*)")
MAKE = re.compile(r"(?:^|[\s;&(=])make +([a-z][\w-]*)")


def _snippets(text: str) -> list[str]:
    """Code from fenced blocks (continuation lines joined) and inline spans (line breaks as spaces)."""
    blocks = [m.group(2).replace("\\\n", " ") for m in FENCE.finditer(text)]
    prose = FENCE.sub("", text)
    return blocks + [m.group(1).replace("\n", " ") for m in INLINE.finditer(prose)]


def _commands() -> list[tuple[str, str, str, list[str]]]:
    """(page, script, subcommand, options) of every ``python prune.py|train.py …`` in the pages."""
    found = []
    for page in PAGES:
        for code in _snippets(page.read_text()):
            for match in COMMAND.finditer(code):
                try:
                    words = shlex.split(match.group(2), comments=True)
                except ValueError:  # a span that ends inside a quote: the words before it
                    words = match.group(2).split()
                sub = next((w for w in words if not w.startswith("-")), None) if words[:1] != ["--help"] else None
                if sub and sub.startswith(("<", "…", "...")):  # a placeholder (`prune.py <subcommand> --help`)
                    continue
                if match.group(1) == "train" and sub not in (None, "fit", "validate", "test", "predict"):
                    sub = None  # `train.py --config x fit` does not occur; a bare word is not a subcommand
                options = sorted({w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2})
                found.append((str(page.relative_to(ROOT)), match.group(1), sub or "", options))
    return found


def _make_uses() -> list[tuple[str, str]]:
    """(page, target) of every ``make <target>`` in the pages' code, shell comments left out."""
    return [(str(page.relative_to(ROOT)), target) for page in PAGES for code in _snippets(page.read_text())
            for target in MAKE.findall(re.sub(r"(^|\s)#.*", "", code))]


@cache
def _help(script: str, sub: str) -> str:
    """``<script>.py [sub] --help`` as printed, run in this process."""
    if script == "prune":
        from fairprune.cli.prune import main
    else:
        from fairprune.cli.train import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main([*([sub] if sub else []), "--help"])
        except SystemExit:
            pass
    return out.getvalue()


@cache
def _init_args(kind: str) -> frozenset[str]:
    """Parameter names of every model / data class a shipped config names (what ``--model.X`` and
    ``--data.X`` set on train.py; its --help lists them only per class)."""
    names: set[str] = set()
    for config in (ROOT / "configs").rglob("*.yaml"):
        section = (yaml.safe_load(config.read_text()) or {}).get(kind)
        if isinstance(section, dict) and "class_path" in section:
            module, _, attr = section["class_path"].rpartition(".")
            cls = getattr(importlib.import_module(module), attr)
            for klass in cls.__mro__:
                if "__init__" in vars(klass):
                    names |= set(inspect.signature(klass.__init__).parameters) - {"self", "args", "kwargs"}
    return frozenset(names)


def _known(script: str, sub: str, option: str) -> bool:
    text = _help(script, sub).replace(".init_args.", ".")
    name = option.replace(".init_args.", ".")
    if re.search(re.escape(name) + r"(?![\w.-])", text):
        return True
    parts = name[2:].split(".")
    if script == "train" and parts[0] in ("model", "data") and len(parts) > 1:
        return parts[1] in _init_args(parts[0])
    # A nested key of a class- or dict-typed option (--trainer.logger.init_args.name): the option itself.
    return any(re.search(re.escape("--" + ".".join(parts[:n])) + r"(?![\w.-])", text) for n in range(2, len(parts)))


def test_the_pages_show_commands():
    commands = _commands()
    assert len({(c[1], c[2]) for c in commands}) >= 10, commands  # the parser still finds them
    assert any(c[1] == "train" for c in commands) and _make_uses()


def test_the_check_catches_what_does_not_exist():
    assert not _help("prune", "no-such-command").startswith("usage:")
    assert not _known("prune", "vision", "--pruning.no_such_option") and not _known("prune", "sparsegpt", "--no_such")
    assert not _known("train", "fit", "--data.no_such_option") and not _known("train", "fit", "--trainer.no_such")
    assert _known("prune", "sparsegpt", "--sparsity") and _known("train", "fit", "--model.init_args.backbone")


def test_every_documented_command_uses_subcommands_and_options_that_exist():
    problems = []
    for page, script, sub, options in _commands():
        text = _help(script, sub)
        if not text.startswith("usage:"):
            problems.append(f"{page}: `{script}.py {sub}`: no such subcommand")
            continue
        problems += [f"{page}: `{script}.py {sub}` has no option {option}" for option in options
                     if option not in ("--help", "--print_config") and not _known(script, sub, option)]
    assert not problems, "\n".join(sorted(set(problems)))


def test_every_make_target_the_pages_name_exists():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    missing = sorted({f"{page}: make {target}" for page, target in _make_uses() if target not in targets})
    assert not missing, "\n".join(missing)


def test_every_file_the_readme_links_exists():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert local and not [link for link in local if not (ROOT / link).exists()]


def test_every_snippet_the_docs_include_exists():
    included = [m for page in PAGES for m in re.findall(r'^--8<-- "([^":]+)', page.read_text(), re.M)]
    assert included and all((ROOT / path).is_file() for path in included), included
    for result in (ROOT / "bench" / "results").glob("*.md"):  # every measured table is on the benchmarks page
        assert f"bench/results/{result.name}" in included, result.name


@pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None,
                    reason="mkdocs is not installed (the docs extra: pip install -e '.[docs]')")
def test_the_site_builds_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    result = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                            capture_output=True, text=True, env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING" not in result.stderr, result.stderr[-3000:]


# --- every report.json key a run writes is in docs/outputs.md -----------------------------------

VISION_FAST = {"limit_train_batches": 2, "limit_val_batches": 1, "limit_test_batches": 1, "accelerator": "cpu",
               "enable_progress_bar": False, "enable_model_summary": False}
NAMED_BY_DATA = {"groups", "runs", "figures", "comparison", "aggregate",  # their keys are groups, layers, cells, tasks
                 "versions"}  # environment.versions: distribution names


@pytest.fixture(scope="module")
def reports(tmp_path_factory, one_thread) -> dict[str, dict]:
    """Real reports of tiny runs: a dense vision fit, a channel-pruned vision compare
    (its cell and its own report), an LM compare with lm-eval tasks (cell and report), an LM
    evaluate and a FASP run."""
    from fairprune.cli.prune import main as prune_main
    from fairprune.cli.train import main as train_main
    from fairprune.data.prompts import holistic_prompts
    from tiny_models import tiny_gpt2_folder

    out = tmp_path_factory.mktemp("reports")
    vision = ["--config", str(ROOT / "configs/vision/demo.yaml"), "--trainer.accelerator", "cpu",
              "--trainer.limit_test_batches", "1", "--trainer.enable_progress_bar", "false",
              "--trainer.logger.init_args.save_dir", str(out), "--data.synthetic_size", "160",
              "--data.image_size", "32", "--data.batch_size", "16"]
    assert train_main(["fit", *vision, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
                       "--trainer.limit_val_batches", "1"]) == 0
    dense = out / "demo" / "dense"
    assert prune_main(["compare", "--ckpt", str(dense / "checkpoints" / "last.ckpt"), "--methods", "[fairgrape]",
                       "--sparsities", "[0.5]", "--granularities", "[channel]", "--quiet", "true",
                       "--pruning", json.dumps({"keep_per_iter": 0.5, "bn_recalibration": 1}),
                       "--trainer", json.dumps(VISION_FAST), "--output", str(out / "vc")]) == 0

    tiny_gpt2_folder(out / "lm")
    lm = ["--model", str(out / "lm" / "dense"), "--eval_text", str(out / "lm" / "eval.txt"), "--nsamples", "2",
          "--seqlen", "32", "--eval_tokens", "256", "--device", "cpu", "--quiet", "true"]
    assert prune_main(["compare", *lm, "--methods", "[sparsegpt]", "--sparsities", '["0.5"]',
                       "--tasks", "[mmlu, bbq_ambig_cloze3]", "--limit", "4", "--output", str(out / "lc")]) == 0
    assert prune_main(["evaluate", *lm, "--output", str(out / "le")]) == 0
    holistic_prompts(["gender_and_sex"]).groupby("bucket").head(4).to_csv(out / "prompts.csv", index=False)
    assert prune_main(["fasp", "--model", str(out / "lm" / "dense"), "--prompts", str(out / "prompts.csv"),
                       "--max_new_tokens", "2", "--seqlen", "32", "--device", "cpu", "--gamma", "0.25", "--alpha", "0.25",
                       "--calib_text", str(out / "lm" / "eval.txt"), "--scorer", "lexicon", "--quiet", "true",
                       "--output", str(out / "fasp")]) == 0
    files = {"train.py fit": dense / "report.json",
             "vision compare cell": out / "vc" / "fairgrape_channel_s0.5" / "report.json",
             "vision compare": out / "vc" / "report.json", "LM compare cell": out / "lc" / "sparsegpt_0.5" / "report.json",
             "LM compare": out / "lc" / "report.json", "evaluate": out / "le" / "report.json",
             "fasp": out / "fasp" / "report.json"}
    return {name: json.loads(path.read_text()) for name, path in files.items()}


def _data_names(report: dict) -> set[str]:
    """Keys that are names from the data or the settings: groups, tasks, axes, runtimes, batch sizes."""
    reference = report.get("reference")
    names = set(report.get("groups", {})) | set(reference.get("groups", {}) if isinstance(reference, dict) else {})
    names |= set((report.get("fairness") or {}).get("bias", {}))
    tasks = report.get("tasks") or {}
    names |= set(tasks.get("figures", {})) | {k for k, v in tasks.items() if isinstance(v, dict) and "scoring" in v}
    return names | {"torch", "ort"}


def _pattern(key: str) -> str:
    """A key built from names, as the outputs page writes it."""
    if "/" in key:
        return "bias/<axis>" if key.startswith("bias/") else "<task>/<metric>"
    return key


def _report_keys(report: dict, names: set[str], depth: int = 3, prefix: str = "") -> set[tuple[str, str]]:
    """(where, key) for every key down to ``depth`` levels, names from the data left out."""
    found = set()
    for key, value in report.items():
        if key in names or key.isdigit():
            continue
        found.add((prefix + key, _pattern(key)))
        if isinstance(value, dict) and depth > 1 and key not in NAMED_BY_DATA:
            found |= _report_keys(value, names, depth - 1, f"{prefix}{key}.")
    return found


def _documented() -> set[str]:
    text = FENCE.sub("", OUTPUTS.read_text())
    return {word for span in INLINE.findall(text) for word in re.findall(r"[\w<>/]+", span)}


def test_every_report_key_is_in_the_outputs_page(reports):
    documented = _documented()
    assert "achieved_sparsity" in documented and "no_such_key" not in documented
    missing = sorted({f"{name}: {where}" for name, report in reports.items()
                      for where, key in _report_keys(report, _data_names(report)) if key not in documented})
    assert not missing, "report.json keys not described in docs/outputs.md:\n" + "\n".join(missing)
    # The runs wrote what the page's sections are about.
    assert {"channels_kept", "deploy", "ci", "reference", "dense"} <= set(reports["vision compare cell"])
    assert {"paired", "tasks", "weights", "memory"} <= set(reports["LM compare cell"]) and "dto" in reports["LM compare"]
    assert {"size", "removal", "paired"} <= set(reports["fasp"])


def test_every_report_records_the_versions_and_the_machine_it_ran_on(reports):
    """Each kind of report (a fit, vision and LM compare cells and compares, evaluate, FASP) names
    the installed libraries, torch by its real version, and the hardware, under ``environment``."""
    import os

    import torch

    for name, report in reports.items():
        environment = report.get("environment")
        assert isinstance(environment, dict), f"{name}: no environment"
        versions, hardware = environment["versions"], environment["hardware"]
        assert versions["torch"] == torch.__version__, name
        assert all(isinstance(versions[lib], str) for lib in ("fairprune", "torchvision", "lightning", "torchmetrics",
                                                             "transformers", "lm_eval", "numpy", "accelerate",
                                                             "compressed-tensors", "python")), (name, versions)
        assert hardware["logical_cores"] == os.cpu_count() and hardware["torch_threads"] >= 1, (name, hardware)
        assert isinstance(hardware["cpu"], str) and isinstance(hardware["gpus"], list) and hardware["os"], (name, hardware)
