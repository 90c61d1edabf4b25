"""The demo's command line: seeds, threads, folders and its one-line errors (the demo itself runs in
`make demo`, its workflow at full size in tests/test_slow_demo.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fairprune.cli import demo


def test_seed_zero_is_the_configs_own_run():
    train, compare = demo.commands()
    assert demo.folder(0) == "runs/demo"
    assert "--seed_everything" not in train and "--ckpt" not in compare
    assert train[train.index("--threads") + 1] == "2" and compare[compare.index("--threads") + 1] == "2"


def test_another_seed_moves_every_source_of_randomness_and_its_folder():
    train, compare = demo.commands(seed=3, threads=1)
    assert demo.folder(3) == "runs/demo_seed3"
    assert train[train.index("--seed_everything") + 1] == "3" and train[train.index("--data.seed") + 1] == "3"
    assert train[train.index("--trainer.logger.init_args.name") + 1] == "demo_seed3"
    assert compare[compare.index("--ckpt") + 1] == "runs/demo_seed3/dense/checkpoints/last.ckpt"
    assert compare[compare.index("--seeds") + 1] == "[3]"
    assert compare[compare.index("--output") + 1] == "runs/demo_seed3/compare"
    assert train[train.index("--threads") + 1] == "1"


def test_kernel_caps_are_set_unless_the_user_set_them():
    assert all(os.environ.get(name) for name in demo.KERNELS)
    code = "import os; import fairprune.cli.demo; print(os.environ['MKL_CBWR'], os.environ['ATEN_CPU_CAPABILITY'])"
    env = {**os.environ, "MKL_CBWR": "COMPATIBLE"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["COMPATIBLE", "avx2"]


@pytest.mark.parametrize("args, message", [(["--seed", "-1"], "--seed must be 0 or more"),
                                           (["--threads", "0"], "--threads must be 1 or more"),
                                           (["--seed", "x"], "invalid int value")])
def test_bad_options_are_one_line(args, message):
    run = subprocess.run([sys.executable, "-m", "fairprune.cli.demo", *args], capture_output=True, text=True)
    assert run.returncode == 2 and message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "Traceback" not in run.stderr


def test_demo_lm_names_the_folder_the_compare_wrote():
    """``demo_lm``'s last line names the table where the compare wrote it: ``--output`` given to
    the demo (the last one, either spelling) moves it."""
    from fairprune.cli.demo_lm import OUTPUT, _output

    assert _output([]) == OUTPUT and _output(["--dtype", "bfloat16"]) == OUTPUT
    assert _output(["--dtype", "bfloat16", "--output", "runs/bf16"]) == "runs/bf16"
    assert _output(["--output=runs/a", "--output", "runs/b"]) == "runs/b"
    assert _output(["--output", "runs/a", "--output=runs/c"]) == "runs/c"
