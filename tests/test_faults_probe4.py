"""Faults found by probing quantization, GGUF, task files and compares (4): each test fails on
the code before its fix."""

from __future__ import annotations

import math
import os
import stat

import pytest

from fairprune.cli.prune import main as prune_main
from tiny_models import tiny_gpt2_folder

FAST = ["--nsamples", "2", "--seqlen", "32", "--eval_tokens", "256", "--device", "cpu", "--quiet", "true"]


@pytest.fixture
def gpt2(tmp_path):
    tiny_gpt2_folder(tmp_path)
    return tmp_path


def _modes(folder) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")}


def test_file_modes_do_not_depend_on_the_stream_mode(gpt2):
    texts = ["--eval_text", str(gpt2 / "eval.txt"), "--calib_text", str(gpt2 / "eval.txt")]
    old = os.umask(0o022)
    try:
        for stream in ("false", "true"):
            assert prune_main(["sparsegpt", "--model", str(gpt2 / "dense"), "--sparsity", "0.5", "--stream", stream,
                               "--output", str(gpt2 / stream), *FAST, *texts]) == 0
    finally:
        os.umask(old)
    memory, streamed = _modes(gpt2 / "false"), _modes(gpt2 / "true")
    assert memory["model.safetensors"] == streamed["model.safetensors"] == 0o644
    assert set(memory.values()) == {0o644} and set(streamed.values()) == {0o644}


# --- GGUF files that lie in their header ---------------------------------------------------------

def _tiny_gguf(tmp_path):
    from test_faults_probe3 import _gguf

    return _gguf(tmp_path)


@pytest.mark.parametrize("count", [2**40, 2**62])
def test_a_gguf_array_claiming_more_entries_than_the_file_holds_is_one_line(tmp_path, capsys, count, monkeypatch):
    import struct

    from cli_output import last_error

    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    path = _tiny_gguf(tmp_path)
    data = bytearray(path.read_bytes())
    at = data.index(b"tokenizer.ggml.tokens" + struct.pack("<II", 9, 8)) + len("tokenizer.ggml.tokens") + 8
    data[at:at + 8] = struct.pack("<Q", count)
    path.write_bytes(bytes(data))
    assert prune_main(["evaluate", "--model", str(path), *FAST]) != 0
    line = last_error(capsys)
    assert "is not a valid GGUF file" in line and "tokenizer.ggml.tokens" in line and "more than the file" in line
    assert "Traceback" not in capsys.readouterr().err


def test_a_gguf_whose_tensors_overlap_is_refused(tmp_path, capsys, monkeypatch):
    import struct

    import gguf

    from cli_output import last_error

    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    path = _tiny_gguf(tmp_path)
    reader = gguf.GGUFReader(path)
    first, second = reader.tensors[0], reader.tensors[1]
    data = bytearray(path.read_bytes())
    name = second.name.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    dims = struct.unpack_from("<I", data, at)[0]
    offset_at = at + 4 + 8 * dims + 4
    start = reader.data_offset
    assert struct.unpack_from("<Q", data, offset_at)[0] == second.data_offset - start
    data[offset_at:offset_at + 8] = struct.pack("<Q", first.data_offset - start)  # second reads the first's bytes
    path.write_bytes(bytes(data))
    assert prune_main(["evaluate", "--model", str(path), *FAST]) != 0
    line = last_error(capsys)
    assert "overlap" in line and first.name in line and second.name in line
    assert not any((tmp_path / "cache").rglob("model.safetensors"))  # nothing converted, nothing measured


# --- BBQ files that would pass the up-front check and fail after the model was measured --------

def _bbq_file(tmp_path, rows, name="bbq.jsonl"):
    import json

    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("change, expected", [
    (lambda row: row.update(ans1=""), "line 3 has an empty ans1"),
    (lambda row: row.update(ans1=row["ans0"]), "line 3 has ans0 equal to ans1"),
])
def test_a_bbq_row_lm_eval_cannot_score_is_refused_before_work(gpt2, capsys, change, expected):
    from cli_output import last_error
    from test_harness import _bbq_rows

    rows = _bbq_rows()
    change(rows[2])
    path = _bbq_file(gpt2, rows)
    code = prune_main(["evaluate", "--model", str(gpt2 / "dense"), "--tasks", "[bbq_ambig_cloze3]", "--task_data",
                       f"bbq={path}", *FAST])
    line = last_error(capsys)
    assert code != 0 and expected in line and str(path) in line and "IndexError" not in line


@pytest.mark.parametrize("task, kept", [("bbq_ambig_cloze3", "disambig"), ("bbq_disambig_cloze3", "ambig"),
                                        ("bbq_ambig_letter_balanced", "disambig")])
def test_a_bbq_file_without_the_tasks_context_condition_is_refused_before_work(gpt2, capsys, task, kept):
    from test_harness import _bbq_rows

    path = _bbq_file(gpt2, [r for r in _bbq_rows() if r["context_condition"] == kept])
    code = prune_main(["evaluate", "--model", str(gpt2 / "dense"), "--tasks", f"[{task}]", "--task_data",
                       f"bbq={path}", "--quiet", "false", *FAST[:-2]])
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err
    line = printed.err.strip().splitlines()[-1]
    wanted = "disambig" if "disambig" in task else "ambig"
    assert code != 0 and f"context_condition is '{wanted}'" in line and task in line and str(path) in line
    assert "measuring" not in printed.out + printed.err  # refused before the model was measured


# --- An interrupted LM compare reuses its finished cells -------------------------------------------

def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("stream", ["false", pytest.param("true", marks=pytest.mark.slow)])  # streamed: make test-slow
def test_an_interrupted_lm_compare_reuses_its_finished_cells(gpt2, stream):
    from test_signals import Command, _last_stderr_line

    out = gpt2 / "grid"
    args = ["compare", "--model", str(gpt2 / "dense"), "--output", str(out), "--methods", "[magnitude, sparsegpt]",
            "--sparsities", "[0.5]", "--eval_text", str(gpt2 / "eval.txt"), "--calib_text", str(gpt2 / "eval.txt"),
            "--nsamples", "32", "--seqlen", "64", "--eval_tokens", "256", "--device", "cpu", "--stream", stream,
            "--dense_cache", "false"]
    run = Command("prune.py", args, gpt2)
    try:
        run.wait_for(lambda: any("[compare] sparsegpt_0.5 (2/2)" in line for line in run.out))
        status = run.terminate()
    finally:
        run.kill()
    assert status == 143
    assert "in cell sparsegpt_0.5" in _last_stderr_line(run.err) and "finished cells are reused" in _last_stderr_line(run.err)
    first = _files(out / "magnitude_0.5")
    assert "report.json" in first and not (out / "sparsegpt_0.5" / "report.json").exists()
    again = Command("prune.py", [*args, "--quiet", "true"], gpt2)  # --quiet changes no figure: still reused
    assert again.proc.wait(timeout=300) == 0
    again.terminate(timeout=10)
    printed = "".join(again.out)
    assert "[compare] magnitude_0.5 (1/2): finished earlier with the same settings, reusing" in printed
    assert _files(out / "magnitude_0.5") == first  # byte for byte: not run again
    assert (out / "sparsegpt_0.5" / "report.json").is_file() and (out / "comparison.csv").is_file()
    if stream == "true":
        return
    third = Command("prune.py", [*args, "--quiet", "true"], gpt2)
    assert third.proc.wait(timeout=300) == 0
    third.terminate(timeout=10)
    assert "".join(third.out).count("finished earlier with the same settings") == 2
    changed = Command("prune.py", [*args, "--nsamples", "8"], gpt2)  # other settings: run again
    assert changed.proc.wait(timeout=300) == 0
    changed.terminate(timeout=10)
    assert "reusing" not in "".join(changed.out).replace("magnitude_0.5 (1/2): finished", "")


# --- A tokenizer that asks for BOS gets it at the head of every window ------------------------------

def _bos_tokenizer(root):
    from tokenizers import processors

    from fairprune.data.text import lm_corpus, train_bpe_tokenizer

    corpus = lm_corpus(train_docs=30, validation_docs=4, seed=3)
    tokenizer = train_bpe_tokenizer(corpus.train, 300)
    bos = tokenizer.bos_token  # the document separator, as GPT-2-style vocabularies have it
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)])
    (root / "eval.txt").write_text(corpus.validation)
    return tokenizer


def test_gemma_reads_its_bos_at_the_head_of_every_window(tmp_path):
    import json

    import torch

    from fairprune.data.text import bos_of, calibration_ids
    from tiny_models import builder

    tokenizer = _bos_tokenizer(tmp_path)
    bos = tokenizer.bos_token_id
    assert bos_of(tokenizer) == bos
    torch.manual_seed(0)
    model = builder("gemma3_text", vocab_size=len(tokenizer), bos_token_id=bos, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.eos_token_id)().eval()
    model.save_pretrained(tmp_path / "gemma")
    tokenizer.save_pretrained(tmp_path / "gemma")
    out = tmp_path / "ev"
    assert prune_main(["evaluate", "--model", str(tmp_path / "gemma"), "--eval_text", str(tmp_path / "eval.txt"),
                       "--eval_seqlen", "32", "--eval_tokens", "310", "--output", str(out), "--dense_cache", "false",
                       "--device", "cpu", "--quiet", "true"]) == 0
    report = json.loads((out / "report.json").read_text())
    # plain transformers on the same windows: the BOS, then the next 31 tokens of the text
    text = tokenizer((tmp_path / "eval.txt").read_text(), add_special_tokens=False).input_ids[:310]
    windows = [[bos, *text[i:i + 31]] for i in range(0, len(text) // 31 * 31, 31)]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(windows)).logits
    ids = torch.tensor(windows)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).double(), ids[:, 1:].flatten(), reduction="sum")
    assert report["metrics"]["perplexity"] == pytest.approx(math.exp(float(nll) / ids[:, 1:].numel()), rel=1e-5)
    assert report["evaluation"]["bos"] == tokenizer.bos_token and report["evaluation"]["tokens"] == len(windows) * 31
    calib = calibration_ids(tokenizer, (tmp_path / "eval.txt").read_text(), 4, 16)
    assert (calib[:, 0] == bos).all()


def test_a_converted_gguf_keeps_its_bos_flag(tmp_path, monkeypatch):
    import json

    import torch

    from fairprune.data.text import bos_of
    from tiny_models import builder, write_gguf

    monkeypatch.setenv("FAIRPRUNE_CACHE", str(tmp_path / "cache"))
    tokenizer = _bos_tokenizer(tmp_path)
    torch.manual_seed(0)
    model = builder("qwen2", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)()
    write_gguf(model, tokenizer, tmp_path / "m.gguf", add_bos=True)  # as Gemma 3's GGUF says
    out = tmp_path / "ev"
    assert prune_main(["evaluate", "--model", str(tmp_path / "m.gguf"), "--eval_text", str(tmp_path / "eval.txt"),
                       "--eval_seqlen", "32", "--eval_tokens", "256", "--output", str(out), "--device", "cpu",
                       "--quiet", "true"]) == 0
    assert json.loads((out / "report.json").read_text())["evaluation"]["bos"] == tokenizer.bos_token
    from transformers import AutoTokenizer

    converted = next((tmp_path / "cache").rglob("tokenizer.json")).parent
    assert bos_of(AutoTokenizer.from_pretrained(converted)) == tokenizer.bos_token_id


# --- Threads that fit a shared machine ------------------------------------------------------------

def _chosen(env: dict[str, str]) -> list[str]:
    import subprocess
    import sys

    code = ("import os, fairprune.cli; print(os.environ.get('OMP_NUM_THREADS'), os.environ.get('OMP_WAIT_POLICY'), "
            "os.environ.get('FAIRPRUNE_THREADS_CHOSEN'))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split(" ", 2)


def test_a_busy_machine_gets_the_idle_cores_and_passive_waits():
    import subprocess
    import sys

    cores = len(os.sched_getaffinity(0))
    if not 2 <= cores <= 8:
        pytest.skip("keeps all but one of 2 to 8 cores busy")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")}
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores - 1)]
    try:
        import time

        time.sleep(0.5)
        threads, policy, why = _chosen(env)
        given = _chosen({**env, "OMP_NUM_THREADS": "2"})  # the user's own setting is kept
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    assert int(threads) <= 1 + cores // 4 and policy == "PASSIVE" and "cores busy with other processes" in why
    assert given[0] == "2" and given[1] == "None"
