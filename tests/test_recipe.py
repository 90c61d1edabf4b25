"""Modifiers and recipes: ``prune.py recipe --recipe FILE`` gives the folder the flags give (in
memory and streamed), a recipe's mistakes are one line each, and a modifier of one's own (the
example the extending guide shows, ``examples/rescale_modifier.py``) runs in the block pass,
checked against an oracle computed from the dense model's own layer inputs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from cli_output import last_error
from fairprune.causal.families import family_of, linear_weight
from fairprune.cli.prune import main
from fairprune.pruning.llm import prune_with
from fairprune.pruning.modifiers import MODIFIERS, Prune
from fairprune.pruning.sparsity import Sparsity
from tiny_models import BUILDERS, builder, lm_folder

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rescale_modifier.py"
COMMON = ["--nsamples", "4", "--seqlen", "32", "--eval_tokens", "256", "--threads", "1", "--quiet", "--dense_cache", "false"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("recipe")
    torch.manual_seed(0)
    lm_folder(root, lambda v, e: builder("llama", vocab_size=v, bos_token_id=e, eos_token_id=e, pad_token_id=e)(), "dense")
    return root


@pytest.fixture
def rescale():
    """The guide's example modifier, imported (which registers ``rescale``) and unregistered after."""
    spec = importlib.util.spec_from_file_location("rescale_modifier", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    MODIFIERS.pop("rescale", None)
    spec.loader.exec_module(module)
    sys.modules["rescale_modifier"] = module
    yield module
    MODIFIERS.pop("rescale", None)
    sys.modules.pop("rescale_modifier", None)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def run(llama: Path, output: Path, *args: str) -> int:
    return main([*args, "--model", str(llama / "dense"), "--eval_text", str(llama / "eval.txt"), "--output", str(output),
                 *COMMON])


@pytest.mark.parametrize("stream", ["false", pytest.param("true", marks=pytest.mark.slow)])
def test_a_recipe_of_two_modifiers_equals_the_flags(llama, tmp_path, stream):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("- sparsegpt:\n    sparsity: '2:4'\n- quantize:\n    scheme: w4a16-gptq\n    group_size: 64\n")
    assert run(llama, tmp_path / "flags", "sparsegpt", "--sparsity", "2:4", "--quantize", "w4a16-gptq",
               "--quant_group_size", "64", "--stream", stream) == 0
    assert run(llama, tmp_path / "recipe", "recipe", "--recipe", str(recipe), "--stream", stream) == 0
    got, want = tensors(tmp_path / "recipe"), tensors(tmp_path / "flags")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    report = json.loads((tmp_path / "recipe" / "report.json").read_text())
    flags = json.loads((tmp_path / "flags" / "report.json").read_text())
    assert report["quantization"]["scheme"] == "w4a16-gptq" and report["achieved_sparsity"] == flags["achieved_sparsity"]
    assert "recipe:" in (tmp_path / "recipe" / "config.yaml").read_text()


@pytest.mark.parametrize(("text", "says"), [
    ("sparsegpt: 0.5\n", "holds no list of modifiers"),
    ("- sparsgpt:\n    sparsity: 0.5\n", "no modifier 'sparsgpt'"),
    ("- quantize:\n    scheme: w4a16\n- sparsegpt:\n    sparsity: 0.5\n", "one pruning method, first"),
    ("- sparsegpt:\n    sparsity: 0.5\n- wanda:\n    sparsity: 0.5\n", "one pruning method, first"),
    ("- sparsegpt:\n    sparsity: 0.5\n- quantize:\n    scheme: w4a16\n- quantize:\n    scheme: w8a16\n", "quantizes once"),
    ("- sparsegpt: {}\n", "sparsegpt takes sparsity"),
    ("- sparsegpt:\n    sparsity: 1.5\n", "sparsity"),
    ("- quantize:\n    scheme: w3a16\n", "w3a16"),
    ("- [sparsegpt\n", "is not YAML"),
])
def test_recipe_mistakes_are_one_line(llama, tmp_path, capsys, text, says):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    assert run(llama, tmp_path / "out", "recipe", "--recipe", str(recipe)) == 2
    assert says in last_error(capsys)
    assert not (tmp_path / "out").exists()


def test_a_missing_recipe_is_one_line(llama, tmp_path, capsys):
    assert run(llama, tmp_path / "out", "recipe", "--recipe", str(tmp_path / "none.yaml")) == 2
    assert "cannot read it" in last_error(capsys)


def _block0_inputs(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each block-0 layer's inputs on ``ids`` in the dense model's own forward, one window per
    forward: the oracle's data."""
    linears = family_of(model).block_linears(family_of(model).block_list(model)[0])
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in linears}

    def keep(name: str):
        def hook(module, args, output) -> None:
            seen[name].append(args[0].detach().reshape(-1, args[0].shape[-1]))
        return hook

    handles = [layer.register_forward_hook(keep(name)) for name, layer in linears.items()]
    with torch.no_grad():
        for row in ids:
            model(input_ids=row[None])
    for handle in handles:
        handle.remove()
    return {name: torch.cat(xs) for name, xs in seen.items()}


def test_a_modifier_of_ones_own_runs_in_the_pass(rescale, tmp_path, llama):
    """The guide's ``Rescale`` after SparseGPT: every block-0 row keeps SparseGPT's zeros and has
    the dense row's energy ``w XᵀX wᵀ`` on the layer's calibration inputs, computed here from the
    dense model's own forward; it runs from a recipe too."""
    torch.manual_seed(0)
    dense = BUILDERS["llama"]().eval()
    pruned, alone = BUILDERS["llama"]().eval(), BUILDERS["llama"]().eval()
    pruned.load_state_dict(dense.state_dict())
    alone.load_state_dict(dense.state_dict())
    ids = torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(1))
    half = Sparsity.parse("0.5")
    prune_with(alone, [Prune("sparsegpt", half)], ids, progress=False)
    prune_with(pruned, [Prune("sparsegpt", half), rescale.Rescale({}, {})], ids, progress=False)
    inputs = _block0_inputs(dense, ids)
    family = family_of(dense)
    layers = [family.block_linears(family.block_list(m)[0]) for m in (dense, alone, pruned)]
    for name, x in inputs.items():
        W0, W1, W2 = (linear_weight(ls[name]).double() for ls in layers)
        assert torch.equal(W2 == 0, W1 == 0), name  # the mask is SparseGPT's
        X = x.double()
        energy = lambda W, X=X: ((W @ X.T) ** 2).sum(1)  # noqa: E731
        torch.testing.assert_close(energy(W2), energy(W0), rtol=1e-4, atol=1e-8)
        assert not torch.allclose(energy(W1), energy(W0), rtol=1e-3)  # SparseGPT alone does not match it
    recipe = tmp_path / "r.yaml"
    recipe.write_text("- sparsegpt:\n    sparsity: 0.5\n- rescale: {}\n")
    assert run(llama, tmp_path / "out", "recipe", "--recipe", str(recipe)) == 0
    assert "rescale" in (tmp_path / "out" / "config.yaml").read_text()
    back = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.isfinite(p).all() for p in back.parameters())
