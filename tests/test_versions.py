"""The software record every output carries (pipeline/versions.py)."""

from __future__ import annotations

import importlib

import pipeline
from pipeline import versions
from pipeline.versions import software_versions


def test_the_software_record_holds_the_installed_versions_that_decide_the_numbers(monkeypatch):
    """A published number names what made it: our version and the installed versions of the
    packages whose arithmetic it went through, Triton's among them (a GPU run's kernels), each as
    the package itself reports it; a package not installed is left out, not guessed."""
    record = software_versions()
    assert record["vocagno"] == pipeline.__version__
    for module in ("torch", "triton", "transformers", "tokenizers", "pyarrow", "numpy"):
        assert record[module] == importlib.import_module(module).__version__, module
    monkeypatch.setattr(versions, "RECORDED_MODULES", ("torch", "no_such_package_here"))
    assert set(software_versions()) == {"vocagno", "python", "torch"}
