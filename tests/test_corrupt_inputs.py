"""Every reader of a user's file, fed systematically corrupted inputs through the real command line:
one ``error:`` line, a non-zero exit, no traceback, and the output folder left as it was (absent).

Readers × corruptions (truncated, wrong dtype, wrong shape, out of range, huge sizes, not the format
at all): the safetensors weights of an LM folder, a vision checkpoint (``.ckpt``), stereotype pair
files (CrowS-Pairs CSV, StereoSet JSON), prompt files (a HolisticBias-format CSV, a HolisticBias
release folder) and face label files (FairFace CSV, CelebA attribute list, UTKFace file names).

The commands run in one child process (``prune.py`` / ``train.py``'s ``main``, one after the other,
each with its own output folder), so the file takes seconds per reader rather than a Python start-up
per case; each case is then checked on its own.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from layouts import write_celeba, write_fairface, write_utkface
from processes import clean_env
from tiny_models import tiny_gpt2_folder

ROOT = Path(__file__).resolve().parents[1]
LM_FAST = ["--nsamples", "2", "--seqlen", "32", "--device", "cpu", "--quiet", "--dense_cache", "false",
           "--eval_tokens", "256", "--threads", "1"]

# Runs each case's command in this one process, its output captured, and writes what happened.
DRIVER = r"""
import contextlib, io, json, sys, traceback
from fairprune.cli.prune import main as prune_main
from fairprune.cli.train import main as train_main
cases, results = json.loads(open(sys.argv[1]).read()), {}
for case in cases:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            status = (prune_main if case["script"] == "prune" else train_main)(case["argv"])
        except BaseException:  # noqa: BLE001 - what escaped the command line is recorded as its traceback
            traceback.print_exc()
            status = 1
    results[case["id"]] = {"status": status, "stderr": err.getvalue()}
open(sys.argv[2], "w").write(json.dumps(results))
"""


# -- corruptions --------------------------------------------------------------------------------
def _safetensors_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def _write_safetensors(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def st_truncated(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def st_header_huge(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])


def st_wrong_dtype(path: Path) -> None:
    header, data = _safetensors_header(path)
    header[_first_tensor(header)]["dtype"] = "F64"
    _write_safetensors(path, header, data)


def st_wrong_shape(path: Path) -> None:
    header, data = _safetensors_header(path)
    entry = header[_first_tensor(header)]
    entry["shape"] = [entry["shape"][0] * 2, *entry["shape"][1:]]
    _write_safetensors(path, header, data)


def st_out_of_range(path: Path) -> None:
    header, data = _safetensors_header(path)
    entry = header[_first_tensor(header)]
    entry["data_offsets"] = [entry["data_offsets"][0], entry["data_offsets"][1] + (1 << 30)]
    _write_safetensors(path, header, data)


def st_not_json(path: Path) -> None:
    header, data = _safetensors_header(path)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + b"\xff" * len(text) + data)


def _edit_ckpt(path: Path, edit: Callable[[dict], Any]) -> None:
    state = torch.load(path, map_location="cpu", weights_only=True)
    edit(state)
    torch.save(state, path)


def _first_weight(state: dict) -> str:
    return next(k for k, v in state["state_dict"].items() if k.endswith(".weight") and v.dim() == 4)


def ckpt_truncated(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 3])


def ckpt_not_a_checkpoint(path: Path) -> None:
    path.write_text("model: resnet\n")


def ckpt_wrong_dtype(path: Path) -> None:
    _edit_ckpt(path, lambda s: s["state_dict"].__setitem__(_first_weight(s), s["state_dict"][_first_weight(s)].long()))


def ckpt_wrong_shape(path: Path) -> None:
    _edit_ckpt(path, lambda s: s["state_dict"].__setitem__(_first_weight(s), torch.zeros(3, 3, 3, 3)))


def ckpt_not_tensor(path: Path) -> None:
    _edit_ckpt(path, lambda s: s["state_dict"].__setitem__(_first_weight(s), "weights"))


def ckpt_settings_not_a_mapping(path: Path) -> None:
    _edit_ckpt(path, lambda s: s.__setitem__("hyper_parameters", ["resnet"]))


def ckpt_huge_image(path: Path) -> None:
    _edit_ckpt(path, lambda s: s["datamodule_hyper_parameters"].__setitem__("image_size", 10**6))


def ckpt_negative_image(path: Path) -> None:
    _edit_ckpt(path, lambda s: s["datamodule_hyper_parameters"].__setitem__("image_size", -32))


def text_truncated(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2 - 3])


def not_text(path: Path) -> None:
    path.write_bytes(bytes(range(256)) * 64)


def empty(path: Path) -> None:
    path.write_bytes(b"")


def csv_wrong_columns(path: Path) -> None:
    lines = path.read_text().splitlines()
    path.write_text("\n".join(["a,b,c"] + lines[1:]) + "\n")


def csv_huge_field(path: Path) -> None:
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2] + ['"' + "x" * (1 << 21) + '",' + lines[1].split(",", 1)[1]] + lines[2:]) + "\n")


def pairs_out_of_range(path: Path) -> None:
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + [line.rsplit(",", 1)[0] + ",sideways" for line in lines[1:]]) + "\n")


def json_wrong_shape(path: Path) -> None:
    path.write_text(json.dumps([1, 2, 3]))


def fairface_out_of_range(root: Path) -> None:
    for split in ("train", "val"):
        path = root / f"fairface_label_{split}.csv"
        lines = path.read_text().splitlines()
        path.write_text("\n".join(lines[:1] + [line.replace(",Male,", ",Martian,").replace(",Female,", ",Martian,")
                                               for line in lines[1:]]) + "\n")


def fairface_truncated(root: Path) -> None:
    text_truncated(root / "fairface_label_train.csv")


def fairface_wrong_columns(root: Path) -> None:
    csv_wrong_columns(root / "fairface_label_train.csv")


def fairface_not_text(root: Path) -> None:
    not_text(root / "fairface_label_train.csv")


def celeba_truncated(root: Path) -> None:
    text_truncated(root / "list_attr_celeba.txt")


def celeba_out_of_range(root: Path) -> None:
    path = root / "list_attr_celeba.txt"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2] + [line.replace(" 1", " 7") for line in lines[2:]]) + "\n")


def celeba_huge_count(root: Path) -> None:
    path = root / "list_attr_celeba.txt"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([str(10**12)] + lines[1:]) + "\n")


def celeba_wrong_shape(root: Path) -> None:
    path = root / "list_attr_celeba.txt"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:2] + [" ".join(line.split()[:5]) for line in lines[2:]]) + "\n")


def utkface_out_of_range(root: Path) -> None:
    for image in root.iterdir():
        age, gender, _, rest = image.name.split("_", 3)
        image.rename(root / f"{age}_{gender}_9_{rest}")


def utkface_huge_age(root: Path) -> None:
    for image in root.iterdir():
        _, rest = image.name.split("_", 1)
        image.rename(root / f"{10**30}_{rest}")


# reader -> (corruptions, what the corruption applies to)
READERS: dict[str, list[Callable]] = {
    "safetensors": [st_truncated, st_header_huge, st_wrong_dtype, st_wrong_shape, st_out_of_range, st_not_json],
    "ckpt": [ckpt_truncated, ckpt_not_a_checkpoint, ckpt_wrong_dtype, ckpt_wrong_shape, ckpt_not_tensor,
             ckpt_settings_not_a_mapping, ckpt_huge_image, ckpt_negative_image],
    "crows_pairs": [text_truncated, not_text, empty, csv_wrong_columns, csv_huge_field, pairs_out_of_range],
    "stereoset": [text_truncated, not_text, empty, json_wrong_shape],
    "prompts": [text_truncated, not_text, empty, csv_wrong_columns],
    "holistic_bias": [text_truncated, not_text, json_wrong_shape],
    "fairface": [fairface_truncated, fairface_wrong_columns, fairface_not_text, fairface_out_of_range],
    "celeba": [celeba_truncated, celeba_out_of_range, celeba_huge_count, celeba_wrong_shape],
    "utkface": [utkface_out_of_range, utkface_huge_age],
}
CASES = [(reader, corruption.__name__) for reader, corruptions in READERS.items() for corruption in corruptions]


def pristine(path: Path) -> None:
    """No corruption: the good input each reader's cases start from, which must run."""


#: Readers whose good input is also run (cheap ones), so each corruption is what the line is about.
BASELINES = ["ckpt", "crows_pairs", "stereoset", "fairface", "celeba", "utkface"]


def _pairs_csv(path: Path) -> Path:
    from fairprune.data.text import stereo_pairs

    rows = ["sent_more,sent_less,stereo_antistereo"] + [f'"{a}","{b}",stereo' for a, b in stereo_pairs()[:12]]
    path.write_text("\n".join(rows) + "\n")
    return path


def _stereoset(path: Path) -> Path:
    from fairprune.data.text import stereo_pairs

    items = [{"id": str(i), "target": "x", "bias_type": "gender", "context": "BLANK",
              "sentences": [{"sentence": a, "gold_label": "stereotype"}, {"sentence": b, "gold_label": "anti-stereotype"},
                            {"sentence": "unrelated", "gold_label": "unrelated"}]}
             for i, (a, b) in enumerate(stereo_pairs()[:12])]
    path.write_text(json.dumps({"version": "1.0", "data": {"intrasentence": items, "intersentence": []}}))
    return path


def _prompts_csv(path: Path) -> Path:
    from fairprune.data.prompts import holistic_prompts

    holistic_prompts().head(40).to_csv(path, index=False)
    return path


def _holistic_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "descriptors.json").write_text(json.dumps({"gender_and_sex": {"binary": ["female", "male"]},
                                                         "religion": {"all": ["Christian", "Muslim"]}}))
    (folder / "nouns.json").write_text(json.dumps({"female": [["woman", "women"]], "male": [["man", "men"]],
                                                   "neutral": [["person", "people"]]}))
    (folder / "sentence_templates.json").write_text(json.dumps({"I am {noun_phrase}.": {}, "Hi, I'm {noun_phrase}.": {}}))
    return folder


@pytest.fixture(scope="module")
def results(tmp_path_factory, dense_ckpt) -> dict[str, dict]:
    """Every case built from a good input, corrupted, and run; what each command did."""
    base = tmp_path_factory.mktemp("corrupt")
    tiny_gpt2_folder(base)
    lm, eval_text = base / "dense", base / "eval.txt"
    cases = []
    for reader, name in CASES + [(reader, "pristine") for reader in BASELINES]:
        corrupt = pristine if name == "pristine" else next(c for c in READERS[reader] if c.__name__ == name)
        case = base / f"{reader}-{name}"
        out = case / "out"
        case.mkdir()
        if reader == "safetensors":
            import shutil

            model = shutil.copytree(lm, case / "lm")
            corrupt(model / "model.safetensors")
            argv = ["magnitude", "--model", str(model), "--sparsity", "0.5", "--eval_text", str(eval_text), "--output",
                    str(out), *LM_FAST]
        elif reader == "ckpt":
            ckpt = case / "last.ckpt"
            ckpt.write_bytes(dense_ckpt.read_bytes())
            corrupt(ckpt)
            argv = ["export", "--ckpt", str(ckpt), "--output", str(out / "model.onnx")]
        elif reader in ("crows_pairs", "stereoset"):
            pairs = _pairs_csv(case / "pairs.csv") if reader == "crows_pairs" else _stereoset(case / "stereoset.json")
            corrupt(pairs)
            argv = ["evaluate", "--model", str(lm), "--eval_text", str(eval_text), "--pairs", str(pairs), "--output",
                    str(out), *LM_FAST]
        elif reader in ("prompts", "holistic_bias"):
            if reader == "prompts":
                prompts = target = _prompts_csv(case / "prompts.csv")
            else:
                prompts = _holistic_folder(case / "hb")
                target = prompts / "descriptors.json"
            corrupt(target)
            argv = ["fasp", "--model", str(lm), "--eval_text", str(eval_text), "--prompts", str(prompts), "--output",
                    str(out), *LM_FAST]
        else:
            root = {"fairface": write_fairface, "celeba": write_celeba, "utkface": write_utkface}[reader](case / "data")
            corrupt(root)
            argv = ["fit", "--config", str(ROOT / "configs" / "vision" / "demo.yaml"), "--data.dataset", reader,
                    "--data.root", str(root), "--data.image_size", "32", "--data.batch_size", "4",
                    "--trainer.fast_dev_run", "1", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar",
                    "false", "--trainer.default_root_dir", str(out), "--trainer.logger.init_args.save_dir", str(out)]
            if reader == "celeba":
                argv += ["--data.target", "Smiling", "--data.sensitive", "Male"]
        cases.append({"id": f"{reader}-{name}", "script": "train" if reader in ("fairface", "celeba", "utkface") else "prune",
                      "argv": argv, "out": str(out)})
    (base / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, "-c", DRIVER, str(base / "cases.json"), str(base / "results.json")],
                          cwd=base, env=clean_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads((base / "results.json").read_text())
    return {c["id"]: {**found[c["id"]], "out": Path(c["out"])} for c in cases}


@pytest.mark.parametrize("reader, corruption", CASES)
def test_a_corrupt_input_is_one_line_and_nothing_is_written(reader, corruption, results):
    case = results[f"{reader}-{corruption}"]
    stderr = case["stderr"]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert case["status"] not in (0, None), stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and stderr.strip().splitlines()[-1] == errors[0], stderr[-3000:]
    out = case["out"]
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()], sorted(out.rglob("*"))


@pytest.mark.parametrize("reader", BASELINES)
def test_the_good_input_each_corruption_starts_from_runs(reader, results):
    case = results[f"{reader}-pristine"]
    assert case["status"] == 0, case["stderr"][-3000:]
