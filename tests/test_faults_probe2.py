"""Faults of issue #32 (second probe): each bad input is one line before any work.

- Damaged safetensors (a truncated shard, a header whose shape disagrees with its data_offsets, a
  header length of 2^40, an index naming the wrong shard, a shape the config does not imply) are
  refused by the one shard check (:func:`fairprune.hub.shards.check_weights`) wherever a local
  folder is opened: the streamed model, the in-memory loader and the command line (nothing written).
- A compressed LM folder is refused loudly by plain ``from_pretrained`` and read bit for bit by
  fairprune's loader.
- float16 overflow names ``--dtype``; a negative ``max_epochs``; non-float prunable weights; a
  plugin that fails to import; a plugin method whose name clashes with a subcommand or a built-in.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from cli_output import last_error
from fairprune.causal.blocks import Resident
from fairprune.causal.streamed import StreamedModel
from fairprune.cli.prune import main as prune_main
from fairprune.errors import UserError
from fairprune.hub import load_model, shards
from fairprune.hub.shards import INDEX, SINGLE, ShardReader
from tiny_models import BUILDERS, tiny_gpt2_folder

FAST = ["--nsamples", "2", "--seqlen", "32", "--device", "cpu", "--quiet", "--dense_cache", "false",
        "--eval_tokens", "256", "--threads", "1"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory, one_thread) -> dict[str, Path]:
    """A tiny Llama in several shards with an index, a tiny GPT-2 in one file, and a tiny GPT-2 with
    its tokenizer and evaluation text (for the command line)."""
    root = tmp_path_factory.mktemp("faults")
    torch.manual_seed(0)
    BUILDERS["llama"]().save_pretrained(root / "llama", max_shard_size="100KB")
    torch.manual_seed(0)
    BUILDERS["gpt2"]().save_pretrained(root / "gpt2")
    tiny_gpt2_folder(root)
    assert (root / "llama" / INDEX).is_file()
    return {"llama": root / "llama", "gpt2": root / "gpt2", "lm": root / "dense", "eval": root / "eval.txt"}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return length, json.loads(raw[8:8 + length])


def _rewrite_header(path: Path, header: dict) -> None:
    """``path`` with a new header of the same length (padded with spaces), the data as it was."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= length
    path.write_bytes(raw[:8] + new + b" " * (length - len(new)) + raw[8 + length:])


def _truncate(folder: Path) -> str:
    shard = sorted(folder.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    return "lies at bytes"


def _lying_shape(folder: Path) -> str:
    shard = sorted(folder.glob("*.safetensors"))[0]
    _, header = _header(shard)
    name = next(k for k, v in header.items() if k != "__metadata__" and len(v["shape"]) == 2)
    header[name]["shape"] = [header[name]["shape"][0], header[name]["shape"][1] - 1]
    _rewrite_header(shard, header)
    return "data_offsets span"


def _huge_header(folder: Path) -> str:
    shard = sorted(folder.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", 2**40) + raw[8:])
    return "header claims"


def _wrong_shard(folder: Path) -> str:
    index = json.loads((folder / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(k for k, v in index["weight_map"].items() if v == files[0])
    index["weight_map"][name] = files[1]
    (folder / INDEX).write_text(json.dumps(index))
    return "does not hold it"


def _missing_shard(folder: Path) -> str:
    sorted(folder.glob("model-*.safetensors"))[-1].unlink()
    return "does not hold it"


DAMAGE = {"truncated": _truncate, "lying-shape": _lying_shape, "huge-header": _huge_header,
          "wrong-shard": _wrong_shard, "missing-shard": _missing_shard}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_shards_are_one_line_for_every_reader(damage, folders, tmp_path):
    folder = _copy(folders["llama"], tmp_path / "llama")
    needle = DAMAGE[damage](folder)
    for read in (getattr(shards, "check_weights", ShardReader), ShardReader, StreamedModel, load_model):
        with pytest.raises(UserError, match=needle) as err:
            read(folder if read is not load_model else str(folder))
        assert "\n" not in str(err.value)


def test_a_damaged_single_file_is_refused(folders, tmp_path):
    folder = _copy(folders["gpt2"], tmp_path / "gpt2")
    _huge_header(folder)
    with pytest.raises(UserError, match="header claims 1099511627776 bytes"):
        load_model(str(folder))
    small = folder / SINGLE
    small.write_bytes(b"\x01\x02")
    with pytest.raises(UserError, match="fewer than the 8"):
        ShardReader(folder)


def test_a_shape_the_config_does_not_imply_is_refused_when_streaming_starts(folders, tmp_path):
    folder = _copy(folders["gpt2"], tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    config["n_inner"] = 4 * config["n_embd"] + 8  # the stored MLP weights are narrower
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="its config.json says"):
        StreamedModel(folder)


@pytest.mark.parametrize("stream", ["false", "true"])
def test_cli_refuses_a_truncated_shard_before_any_work(stream, folders, tmp_path, capsys):
    folder = _copy(folders["lm"], tmp_path / "lm")
    _truncate(folder)
    out = tmp_path / "out"
    code = prune_main(["magnitude", "--model", str(folder), "--sparsity", "0.5", "--stream", stream,
                       "--eval_text", str(folders["eval"]), "--output", str(out), *FAST])
    assert code == 2
    assert "lies at bytes" in last_error(capsys)
    assert not out.exists()


def test_plain_transformers_refuses_a_compressed_folder_fairprune_reads_it_bit_for_bit(tmp_path):
    import transformers as tf

    from fairprune.hub.compressed import save_weights
    from fairprune.pruning.llm import prune_causal_lm
    from fairprune.pruning.sparsity import Sparsity

    torch.manual_seed(0)
    model = BUILDERS["llama"]().eval()
    prune_causal_lm(model, "magnitude", Sparsity.parse("0.5"), progress=False)
    save_weights(model, tmp_path / "c", "compressed", None, Resident(model).layers())
    with pytest.raises(ValueError, match=r"fairprune\.hub\.load_model.*--save_format dense"):
        tf.AutoModelForCausalLM.from_pretrained(tmp_path / "c")
    loaded = load_model(str(tmp_path / "c"))
    assert not hasattr(loaded.config, "transformers_weights")
    want = model.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in loaded.state_dict().items()) and loaded.state_dict().keys() == want.keys()
    loaded.save_pretrained(tmp_path / "again")  # fairprune's model saves as a plain folder transformers loads
    assert torch.equal(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "again").lm_head.weight, model.lm_head.weight)


def _with_big_weight(src: Path, dst: Path) -> Path:
    """``src`` (a float32 GPT-2 folder) with one MLP weight beyond float16's range."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight[0, 0] = 1e6
    model.save_pretrained(dst)
    for file in src.iterdir():
        if not (dst / file.name).exists():
            shutil.copy(file, dst / file.name)
    return dst


def test_float16_overflow_names_the_dtype_not_the_model(folders, tmp_path, capsys):
    from fairprune.hub.checks import check_input_model

    folder = _with_big_weight(folders["lm"], tmp_path / "big")
    with pytest.raises(UserError, match=r"exceed float16's range.*--dtype bfloat16"):
        check_input_model(load_model(str(folder), dtype="float16"), str(folder))
    check_input_model(load_model(str(folder), dtype="bfloat16"), str(folder))  # bfloat16 holds it
    sm = StreamedModel(folder, torch.float16)
    with pytest.raises(UserError, match=r"exceed float16's range.*--dtype bfloat16"):
        with sm.loaded(sm.blocks[1]):
            pass
    out = tmp_path / "out"
    for stream in ("false", "true"):
        code = prune_main(["magnitude", "--model", str(folder), "--sparsity", "0.5", "--dtype", "float16",
                           "--stream", stream, "--eval_text", str(folders["eval"]), "--output", str(out), *FAST])
        assert code == 2 and "--dtype bfloat16" in last_error(capsys) and not out.exists()


@pytest.mark.parametrize("epochs", ["-5", "-2"])
def test_negative_max_epochs_is_one_line(epochs, repo_root, tmp_path, capsys):
    from fairprune.cli.train import main as train_main

    code = train_main(["fit", "--config", str(repo_root / "configs/vision/demo.yaml"), "--trainer.max_epochs", epochs,
                       "--trainer.default_root_dir", str(tmp_path / "runs")])
    assert code == 2 and f"--trainer.max_epochs {epochs}" in last_error(capsys)
    assert not (tmp_path / "runs").exists()


def _with_int8_weight(src: Path, dst: Path, name: str = "transformer.h.0.mlp.c_fc.weight") -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(dst / SINGLE)
    state[name] = state[name].clamp(-1, 1).mul(100).to(torch.int8)
    save_file(state, dst / SINGLE, metadata={"format": "pt"})
    return dst


def test_non_float_prunable_weights_are_refused_naming_the_tensor(folders, tmp_path, capsys):
    from fairprune.pruning.llm import prune_causal_lm
    from fairprune.pruning.sparsity import Sparsity

    folder = _with_int8_weight(folders["lm"], tmp_path / "int8")
    needle = r"transformer\.h\.0\.mlp\.c_fc\.weight .*I8, not floating point"
    with pytest.raises(UserError, match=needle):
        load_model(str(folder))
    with pytest.raises(UserError, match=needle):
        StreamedModel(folder)
    out = tmp_path / "out"
    for stream in ("false", "true"):
        code = prune_main(["magnitude", "--model", str(folder), "--sparsity", "0.5", "--stream", stream,
                           "--eval_text", str(folders["eval"]), "--output", str(out), *FAST])
        assert code == 2 and "c_fc.weight" in last_error(capsys) and not out.exists()
    model = BUILDERS["gpt2"]()  # an integer weight in memory
    layer = model.transformer.h[1].attn.c_proj
    layer.weight = torch.nn.Parameter(torch.zeros(layer.weight.shape, dtype=torch.int8), requires_grad=False)
    with pytest.raises(UserError, match=r"transformer\.h\.1\.attn\.c_proj\.weight is torch\.int8"):
        prune_causal_lm(model, "magnitude", Sparsity.parse("0.5"), progress=False)


def test_non_float_tensors_outside_the_prunable_layers_are_left_alone(folders, tmp_path):
    folder = _with_int8_weight(folders["lm"], tmp_path / "int8", "transformer.wpe.weight")
    load_model(str(folder))
    StreamedModel(folder)


def _plugin(tmp_path, monkeypatch, name: str, body: str) -> None:
    from fairprune.pruning import registry

    (tmp_path / "plugins").mkdir(exist_ok=True)
    (tmp_path / "plugins" / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
    monkeypatch.setenv("FAIRPRUNE_PLUGINS", name)
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))  # what the plugin registers goes with the test


@pytest.mark.parametrize("body, needle", [
    ("raise RuntimeError('the plugin is broken')\n", "failed to import: RuntimeError: the plugin is broken"),
    ("import no_such_dependency_xyz\n", "failed to import: ModuleNotFoundError: No module named 'no_such_dependency_xyz'"),
    ("1 +\n", "failed to import: SyntaxError"),
])
def test_a_plugin_that_fails_to_import_is_one_line_naming_it(body, needle, tmp_path, monkeypatch, capsys):
    _plugin(tmp_path, monkeypatch, "broken_plugin_xyz", body)
    assert prune_main(["magnitude", "--help"]) == 2
    line = last_error(capsys)
    assert "plugin module 'broken_plugin_xyz'" in line and needle in line


LM_PLUGIN = '''
from fairprune.pruning import registry
from fairprune.pruning.registry import Method

registry.register(Method({name!r}, {kind!r}, "a toy", selection="fairprune.pruning.llm:magnitude_solve",
                         importance="fairprune.pruning.steps:magnitude", uses_data=False))
'''


@pytest.mark.parametrize("name, kind, needle", [
    ("vision", "lm", "lm method 'vision' clashes with the prune.py subcommand 'vision'"),
    ("compare", "lm", "lm method 'compare' clashes with the prune.py subcommand 'compare'"),
    ("fairgrape", "lm", "lm method 'fairgrape' clashes with the built-in vision method 'fairgrape'"),
    ("wanda", "vision", "vision method 'wanda' clashes with the built-in lm method 'wanda'"),
])
def test_a_plugin_method_may_not_take_a_subcommand_or_another_kinds_builtin_name(name, kind, needle, tmp_path,
                                                                                 monkeypatch, capsys):
    from fairprune.pruning import registry
    from fairprune.pruning.registry import Method

    with pytest.raises(UserError, match=needle):
        registry.register(Method(name, kind, "a toy", selection="fairprune.pruning.llm:magnitude_solve",
                                 importance="fairprune.pruning.steps:magnitude", uses_data=False))
    assert registry.REGISTRY.get((kind, name)) is None or (kind, name) in {m.key for m in registry._BUILTIN}
    _plugin(tmp_path, monkeypatch, "clashing_plugin_xyz", LM_PLUGIN.format(name=name, kind=kind))
    assert prune_main([name if kind == "lm" else "vision", "--help"]) == 2
    line = last_error(capsys)
    assert "plugin module 'clashing_plugin_xyz'" in line and needle in line


def test_builtin_methods_may_still_be_redefined_and_new_names_registered(monkeypatch):
    from fairprune.pruning import registry

    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    builtin = registry.get("magnitude", "lm")
    registry.register(builtin, replace=True)  # magnitude exists in other kinds too: a redefinition is no clash
    registry.register(registry.Method("toy-new", "lm", "a toy", selection="fairprune.pruning.llm:magnitude_solve",
                                      uses_data=False))
    assert "toy-new" in registry.names("lm")
