# Two commands a new machine needs: `make demo` and `make test`. Both build .venv themselves.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint bench clean-venv

# torch==2.13.0 first: it is the CPU build; letting pip resolve a bare torch pulls a CUDA build.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,eval]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest

test-all: $(STAMP)
	$(PY) -m pytest -m ''

lint: $(STAMP)
	$(PY) -m ruff check .

clean-venv:
	rm -rf $(VENV)
