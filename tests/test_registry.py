"""The method table does the work: a method registered through the public API runs end to end from
the command line, and a sparsity is one typed value parsed where it enters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fairprune.cli.prune import main as prune_main
from fairprune.errors import UserError
from fairprune.pruning import registry
from fairprune.pruning.registry import Method
from fairprune.pruning.sparsity import Sparsity
from tiny_models import tiny_gpt2_folder

ROOT = Path(__file__).resolve().parents[1]
FAST = '{limit_train_batches: 2, limit_val_batches: 2, limit_test_batches: 2, accelerator: cpu, enable_progress_bar: false}'


# --------------------------------------------------------------------------------------------
# Sparsity: one parse, one message per mistake


@pytest.mark.parametrize("value, fraction, nm", [(0.5, 0.5, None), ("0.9", 0.9, None), (0, 0.0, None),
                                                 ("2:4", 0.5, (2, 4)), ("1:8", 0.125, (1, 8))])
def test_sparsity_parses_fractions_and_patterns(value, fraction, nm):
    parsed = Sparsity.parse(value)
    assert (parsed.fraction, parsed.nm) == (fraction, nm)
    assert Sparsity.parse(parsed) is parsed  # a parsed value passes through unchecked
    assert Sparsity.parse(str(parsed)) == parsed  # str() is what the reports and configs write


@pytest.mark.parametrize("value, needle", [
    (1.0, "fraction in [0, 1), e.g. 0.9"), (-0.1, "fraction in [0, 1)"), (True, "got True"),
    ("half", "got 'half'"), ("4:4", "1 <= N < M"), ("a:b", "two whole numbers"),
    (124, "base-60 (sexagesimal) number 124; quote the pattern"),
])
def test_sparsity_mistakes_are_one_line(value, needle):
    with pytest.raises(UserError) as err:
        Sparsity.parse(value)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_vision_sparsity_refuses_patterns():
    with pytest.raises(UserError, match="not an N:M pattern"):
        Sparsity.parse("2:4", nm=False)
    with pytest.raises(UserError, match="sexagesimal.*not an N:M pattern"):
        Sparsity.parse(182, what="target_sparsity", nm=False)


def test_labels_name_folders():
    assert [Sparsity.parse(v).label for v in ("0.5", "2:4", 0.75)] == ["0.5", "2of4", "0.75"]


# --------------------------------------------------------------------------------------------
# The registry


def test_every_builtin_entry_resolves_its_behaviour():
    for method in list(registry.REGISTRY.values()):
        for ref in (method.importance, method.selection, method.statistic, method.options):
            if isinstance(ref, str):
                assert callable(registry._resolve(ref)), f"{method.key}: {ref}"


def test_lookups_name_the_kind_and_suggest():
    assert registry.get("magnitude", "lm").kind == "lm"
    assert registry.get("fasp", ("lm", "heads")).kind == "heads"
    with pytest.raises(UserError, match="did you mean: sparsegpt"):
        registry.get("sparsgpt", ("lm", "heads"))


def test_register_checks_what_a_kind_needs():
    with pytest.raises(UserError, match="needs importance"):
        registry.register(Method("half-done", "vision", "no scores", selection="x:y"))
    with pytest.raises(UserError, match="needs statistic"):
        registry.register(Method("no-stat", "lm", "data but no statistic", selection="x:y"))
    with pytest.raises(UserError, match="exists already"):
        registry.register(Method("magnitude", "vision", "again", importance="x:y", selection="x:y"))


def test_no_name_chains_outside_the_registry():
    """Callers dispatch through the entry: no ``method == "..."`` outside the registry."""
    found = subprocess.run(["git", "grep", "-nE", r"method ==|method in \(", "--", "src/"], cwd=ROOT,
                           capture_output=True, text=True)
    assert found.returncode in (0, 1), found.stderr
    hits = [line for line in found.stdout.splitlines() if not line.startswith("src/fairprune/pruning/registry.py")]
    assert not hits, hits


# --------------------------------------------------------------------------------------------
# A toy vision method, registered through the API, run by prune.py vision


def index_order(context):
    """Keep the lowest flat indices: score = −index (no data)."""
    return {t.name: -torch.arange(t.weight.numel(), dtype=torch.float32).view_as(t.weight) for t in context.targets}


@pytest.fixture
def toy_vision():
    method = registry.register(Method("toy-index", "vision", "keep the first weights of every layer",
                                      importance=index_order, selection="fairprune.pruning.steps:per_layer",
                                      uses_data=False))
    yield method
    registry.unregister("toy-index", "vision")


def test_toy_vision_method_runs_from_the_command_line(toy_vision, dense_ckpt, tmp_path):
    from fairprune.pruning.fairgrape import layer_quota

    assert prune_main(["vision", "--ckpt", str(dense_ckpt), "--pruning.method", "toy-index",
                       "--pruning.target_sparsity", "0.75", "--pruning.keep_per_iter", "0.5",
                       "--pruning.bn_recalibration", "0", "--trainer", FAST, "--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "toy-index" / "report.json").read_text())
    assert report["method"] == "toy-index" and report["achieved_sparsity"] == pytest.approx(0.75, abs=1e-3)
    state = torch.load(tmp_path / "toy-index" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)  # written by this test
    masks = {name: mask.flatten() for name, mask in state["state_dict"].items() if name.endswith("weight_mask")}
    assert masks
    for name, keep in masks.items():
        k = layer_quota(keep.numel(), 0.25)
        assert keep[:k].all() and not keep[k:].any(), name  # exactly the toy's choice


# --------------------------------------------------------------------------------------------
# A toy LM method in a plugin module, registered by FAIRPRUNE_PLUGINS, run by prune.py in a process

PLUGIN = '''
import torch
from fairprune.pruning import registry
from fairprune.pruning.registry import Method


class ColumnMass:
    """Mean |x| per input column over the calibration tokens."""

    def __init__(self, columns, device=None):
        self.total, self.count = torch.zeros(columns, device=device), 0

    def add_batch(self, x, mask=None):
        x = x.reshape(-1, x.shape[-1]).float()
        self.total += x.abs().sum(0)
        self.count += x.shape[0]

    def value(self):
        return self.total / max(self.count, 1)


def drop_quiet_columns(W, mass, sparsity, **_):
    """Zero whole input columns, the least used first."""
    k = int(sparsity.fraction * W.shape[1])
    quiet = mass.argsort()[:k]
    W = W.clone()
    W[:, quiet] = 0
    return W


registry.register(Method("toy-columns", "lm", "zero the input columns with the least mean |x|",
                         statistic=ColumnMass, selection=drop_quiet_columns))
'''


def test_toy_lm_method_plugin_runs_from_the_command_line(tmp_path):
    import transformers as tf

    from fairprune.causal.families import family_of, linear_weight

    tiny_gpt2_folder(tmp_path)
    (tmp_path / "plugins").mkdir()
    (tmp_path / "plugins" / "toy_columns.py").write_text(textwrap.dedent(PLUGIN))
    env = {**os.environ, "FAIRPRUNE_PLUGINS": "toy_columns", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "plugins"), os.environ.get("PYTHONPATH", "")])}
    args = ["--model", str(tmp_path / "dense"), "--sparsity", "0.25", "--nsamples", "4", "--seqlen", "32",
            "--eval_text", str(tmp_path / "eval.txt"), "--device", "cpu", "--quiet", "--dense_cache", "false"]
    done = subprocess.run([sys.executable, str(ROOT / "prune.py"), "toy-columns", *args, "--output", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["method"] == "toy-columns" and report["achieved_sparsity"] == pytest.approx(0.25, abs=0.01)
    pruned = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    family = family_of(pruned)
    for block in family.block_list(pruned):
        for name, layer in family.block_linears(block).items():
            W = linear_weight(layer)  # [out, in]
            assert int((W == 0).all(0).sum()) == int(0.25 * W.shape[1]), name  # whole columns, as the toy solves
    # compare takes the plugin's method like a built-in one
    done = subprocess.run([sys.executable, str(ROOT / "prune.py"), "compare", "--methods", "[toy-columns, magnitude]",
                           "--sparsities", '["0.25"]', *args[:2], *args[4:], "--output", str(tmp_path / "cmp")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "cmp" / "toy-columns_0.25" / "report.json").is_file()
    # without the plugin the name is unknown, in one line
    env.pop("FAIRPRUNE_PLUGINS")
    done = subprocess.run([sys.executable, str(ROOT / "prune.py"), "toy-columns", *args, "--output", str(tmp_path / "x")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "unknown subcommand 'toy-columns'" in done.stderr.strip().splitlines()[-1]


def test_prune_help_lists_every_subcommand_without_loading_torch():
    """``prune.py --help`` reads the table as it is (a registered method included), no torch."""
    code = ("import sys; from fairprune.cli.prune import main; status = main(['--help']); "
            "print('torch' in sys.modules, status)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False 0"
    for name in (*registry.names("lm"), "vision", "fasp", "compare", "evaluate"):
        assert name in done.stdout
