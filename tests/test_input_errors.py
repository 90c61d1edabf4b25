"""Mistakes in what the user passes are one line, ``error: ...``, exit status 2, and are found
before any work: bad label files, wrong checkpoints, output folders that cannot be written, sparsity
values that cannot mean what was meant."""

from __future__ import annotations

from pathlib import Path

import pytest

from fairprune.cli.prune import main as prune_main
from fairprune.cli.train import main as train_main
from fairprune.errors import UserError
from fairprune.storage.atomic import check_writable
from layouts import write_fairface
from tiny_models import BUILDERS

ROOT = Path(__file__).resolve().parents[1]


def one_line_error(capsys, status: int) -> str:
    """The command's last stderr line, checked to be the one-line form of a user error."""
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    last = err.splitlines()[-1]  # warnings from libraries may come before it
    assert last.startswith("error: ")
    return last


def explode(what: str):
    """A stand-in for a step that must not be reached: it fails the test with a traceback."""
    def run(*args, **kwargs):
        raise AssertionError(f"{what} ran before the bad input was reported")
    return run


# --------------------------------------------------------------------------------------------
# Label files


def test_fairface_csv_that_is_not_utf8_is_one_line(tmp_path, capsys):
    root = write_fairface(tmp_path / "ff", per_cell=1)
    csv = root / "fairface_label_train.csv"
    csv.write_bytes(csv.read_bytes().replace(b"Indian", b"Indi\xe1n", 1))  # Latin-1, as a spreadsheet might save it
    err = one_line_error(capsys, train_main([
        "fit", "--config", str(ROOT / "configs/vision/fairface_resnet34.yaml"), "--data.root", str(root),
        "--trainer.fast_dev_run", "1", "--trainer.default_root_dir", str(tmp_path), "--data.image_size", "32"]))
    assert "fairface_label_train.csv" in err and "UTF-8" in err and "0xe1" in err


def test_celeba_attribute_file_that_is_not_utf8_is_a_user_error(tmp_path):
    from fairprune.data.faces import read_celeba
    from layouts import write_celeba

    root = write_celeba(tmp_path / "celeba", n=6)
    attrs = root / "list_attr_celeba.txt"
    attrs.write_bytes(attrs.read_bytes().replace(b"Smiling", b"Sm\xefling"))
    with pytest.raises(UserError, match="list_attr_celeba.txt.*UTF-8"):
        read_celeba(root)


# --------------------------------------------------------------------------------------------
# --ckpt of prune.py vision / compare


def test_text_file_as_ckpt_is_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    err = one_line_error(capsys, prune_main(["vision", "--ckpt", str(tmp_path / "notes.txt"), "--output", str(tmp_path)]))
    assert "notes.txt" in err and "not a torch checkpoint" in err and "train.py fit" in err


def test_directory_as_ckpt_says_so_and_names_the_file_inside(tmp_path, capsys):
    run = tmp_path / "demo" / "dense"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    err = one_line_error(capsys, prune_main(["vision", "--ckpt", str(tmp_path), "--output", str(tmp_path / "o")]))
    assert "is a directory" in err and "does not exist" not in err
    assert str(run / "checkpoints" / "last.ckpt") in err


@pytest.fixture(scope="module")
def lm_ckpt(tmp_path_factory) -> Path:
    """A causal LM's Lightning checkpoint, written by train.py (one step of the tiniest GPT-2)."""
    out = tmp_path_factory.mktemp("lm_ckpt")
    status = train_main(["fit", "--config", str(ROOT / "configs/lm/tiny_gpt2.yaml"), "--data.corpus_docs", "40",
                         "--data.seqlen", "16", "--data.batch_size", "4", "--data.bpe_vocab_size", "300",
                         "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "1",
                         "--trainer.limit_val_batches", "1", "--trainer.accelerator", "cpu",
                         "--trainer.logger.init_args.save_dir", str(out), "--model.init_args.config",
                         '{"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 16, "n_positions": 32}'])
    assert status == 0
    return next((out / "lm" / "tiny_gpt2" / "checkpoints").glob("*.ckpt"))


def test_lm_checkpoint_given_to_vision_names_the_kind_before_the_trainer(lm_ckpt, tmp_path, capsys, monkeypatch):
    import fairprune.workflows.vision as vision

    monkeypatch.setattr(vision.L, "Trainer", explode("the Trainer"))
    for command in (["vision", "--ckpt", str(lm_ckpt)],
                    ["compare", "--ckpt", str(lm_ckpt), "--methods", "[magnitude]", "--sparsities", "[0.5]"]):
        err = one_line_error(capsys, prune_main([*command, "--output", str(tmp_path / "o")]))
        assert "CausalLM" in err and "class and group names" in err
        assert str(lm_ckpt.parent.parent / "model") in err  # where the LM commands find this model


# --------------------------------------------------------------------------------------------
# --output that cannot be written


@pytest.fixture
def no_work(monkeypatch):
    """Loading a model or a checkpoint fails the test: the output check must come first."""
    import fairprune.workflows.heads as heads
    import fairprune.workflows.lm as lm
    import fairprune.workflows.opened as opened
    import fairprune.workflows.vision as vision

    monkeypatch.setattr(opened, "load_model", explode("loading the model"))  # every LM command opens its model there
    for module in (lm, heads):
        monkeypatch.setattr(module, "load_tokenizer", explode("loading the tokenizer"))
    monkeypatch.setattr(vision, "open_trained", explode("loading the checkpoint"))


COMMANDS_THAT_WRITE = {
    "vision": ["vision", "--ckpt", "dense.ckpt"],
    "compare-vision": ["compare", "--ckpt", "dense.ckpt", "--methods", "[magnitude]"],
    "magnitude": ["magnitude", "--model", "gpt2"],
    "sparsegpt": ["sparsegpt", "--model", "gpt2", "--sparsity", "2:4"],
    "compare-lm": ["compare", "--model", "gpt2", "--methods", "[magnitude]", "--sparsities", "[0.5]"],
    "evaluate": ["evaluate", "--model", "gpt2"],
    "fasp": ["fasp", "--model", "gpt2"],
    "compare-heads": ["compare", "--model", "gpt2", "--methods", "[fasp]", "--alphas", "[0.1]"],
    "diff-compare": ["diff-compare", "--train_config", str(ROOT / "configs/text/diffprune_bios_tiny.yaml")],
}


@pytest.mark.parametrize("command", sorted(COMMANDS_THAT_WRITE))
def test_unwritable_output_fails_before_any_work(command, locked, no_work, capsys):
    err = one_line_error(capsys, prune_main([*COMMANDS_THAT_WRITE[command], "--output", str(locked / "run")]))
    assert "cannot write to" in err and "Permission denied" in err and str(locked / "run") in err


def test_output_below_a_file_fails_before_any_work(tmp_path, no_work, capsys):
    (tmp_path / "results").write_text("a file where a folder was meant\n")
    err = one_line_error(capsys, prune_main(["magnitude", "--model", "gpt2", "--output", str(tmp_path / "results" / "run")]))
    assert str(tmp_path / "results") in err and ("is a file" in err or "Not a directory" in err)


def test_check_writable_creates_nothing(tmp_path, locked):
    assert check_writable(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert not (tmp_path / "a").exists() and list(tmp_path.iterdir()) == [locked]
    check_writable(tmp_path)  # an existing folder is fine too
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="--output '.*f' is a file, not a folder"):
        check_writable(tmp_path / "f")
    with pytest.raises(UserError, match="cannot be created: '.*f' is a file"):
        check_writable(tmp_path / "f" / "run")
    with pytest.raises(UserError, match="cannot write to --output '.*locked' \\(Permission denied"):
        check_writable(locked)
    with pytest.raises(UserError, match="cannot write to --output '.*locked/a/b' \\(Permission denied"):
        check_writable(locked / "a" / "b")


# --------------------------------------------------------------------------------------------
# Sparsity values


@pytest.mark.parametrize("how", ["command line", "config file"])
def test_nm_pattern_as_vision_target_sparsity_explains_the_yaml_reading(how, tmp_path, capsys):
    if how == "config file":
        (tmp_path / "prune.yaml").write_text("pruning:\n  method: magnitude\n  target_sparsity: 3:2\n")
        args = ["--config", str(tmp_path / "prune.yaml")]
    else:
        args = ["--pruning.target_sparsity", "3:2"]
    err = one_line_error(capsys, prune_main(["vision", "--ckpt", "dense.ckpt", *args, "--output", str(tmp_path)]))
    assert "[0, 1)" in err and "182" in err and "3:2" in err and "sexagesimal" in err


def test_target_sparsity_that_is_not_a_number_is_a_user_error():
    from fairprune.callbacks.pruning import IterativePruning

    with pytest.raises(UserError, match="fraction in \\[0, 1\\).*not an N:M pattern"):
        IterativePruning(target_sparsity="2:4")
    with pytest.raises(UserError, match="fraction in \\[0, 1\\)"):
        IterativePruning(target_sparsity=1.0)


@pytest.fixture
def tiny_lm(monkeypatch):
    """prune.py's LM commands get a tiny GPT-2 (input widths 64 and 256) without reading any
    folder; measuring it fails the test (a bad request must be refused before)."""
    import torch

    import fairprune.metrics.language as language
    import fairprune.workflows.lm as lm
    import fairprune.workflows.opened as opened

    def model(*args, **kwargs):
        torch.manual_seed(0)
        return BUILDERS["gpt2"]()

    monkeypatch.setattr(opened, "load_model", model)
    monkeypatch.setattr(lm, "load_tokenizer", lambda *a, **k: object())
    monkeypatch.setattr(language, "measure_lm_items", explode("measuring the dense model"))


@pytest.mark.parametrize("command", [
    ["wanda", "--sparsity", "2:3"],
    ["magnitude", "--nm", "1:3"],
    ["compare", "--methods", "[magnitude]", "--sparsities", '["0.5", "2:3"]'],
])
def test_nm_pattern_that_does_not_divide_the_widths_fails_before_measuring(command, tiny_lm, tmp_path, capsys):
    err = one_line_error(capsys, prune_main([*command, "--model", "tiny", "--output", str(tmp_path / "o"),
                                             "--device", "cpu"]))
    assert "M=3 does not divide the input width 64" in err and "64, 256" in err and "2:4" in err


def test_check_pattern_fits_names_the_layer():
    from fairprune.pruning.llm import check_pattern_fits, prune_causal_lm
    from fairprune.pruning.sparsity import Sparsity

    model = BUILDERS["gpt2"]()
    check_pattern_fits(model, Sparsity.parse("2:4"))
    check_pattern_fits(model, Sparsity.parse("0.5"))
    with pytest.raises(UserError, match=r"M=3 does not divide the input width 64 of layer 0\.attn\.c_attn"):
        check_pattern_fits(model, Sparsity.parse("2:3"))
    with pytest.raises(UserError, match="M=6 does not divide"):  # the library entry point checks the same way
        prune_causal_lm(model, "magnitude", Sparsity.parse("3:6"), progress=False)


# --------------------------------------------------------------------------------------------
# Devices


def test_resolve_device_refuses_a_gpu_that_is_not_there(monkeypatch):
    import torch

    from fairprune.hub import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(UserError, match=r"--device cuda: torch sees no GPU here .*use --device cpu or auto"):
        resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(UserError, match=r"--device cuda:2: this machine has 2 GPU\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("command", [["fasp", "--scorer", "lexicon"], ["wanda", "--sparsity", "0.5"]])
def test_cuda_without_a_gpu_is_one_line(command, tmp_path, capsys, monkeypatch):
    import torch

    import fairprune.workflows.opened as opened

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    folder = tmp_path / "model"
    BUILDERS["gpt2"]().save_pretrained(folder)
    monkeypatch.setattr(opened, "load_model", explode("loading the model"))  # refused before the model is read
    err = one_line_error(capsys, prune_main([*command, "--model", str(folder), "--output", str(tmp_path / "o"),
                                             "--device", "cuda"]))
    assert "torch sees no GPU" in err and "--device cpu" in err


def test_gpu_accelerator_without_a_gpu_is_one_line(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    err = one_line_error(capsys, train_main([
        "fit", "--config", str(ROOT / "configs/vision/demo.yaml"), "--trainer.accelerator", "gpu",
        "--trainer.fast_dev_run", "1", "--trainer.default_root_dir", str(tmp_path)]))
    assert "trainer settings:" in err and "--trainer.accelerator cpu or auto" in err


def test_other_lightning_misconfigurations_keep_their_traceback():
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from fairprune.cli.guard import user_error_in

    try:
        raise MisconfigurationException("`training_step` must be implemented")
    except MisconfigurationException as err:
        assert user_error_in(err) is None
