"""`make demo`: the whole pipeline on the embedded default (manifests/demo.toml), on a CPU.

Starts a private local Ray cluster and submits stage 1 as a Ray job, trains each arm with
`torchrun --nproc-per-node 2`, evaluates teacher and students, and writes runs/demo/report.md.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apps.demo.config import SECTION, DemoConfig  # noqa: E402
from pipeline.config import parse_config  # noqa: E402
from pipeline.errors import exit_code  # noqa: E402
from pipeline.log import configure  # noqa: E402

DEFAULT_MANIFEST = Path(__file__).resolve().parents[1] / "manifests" / "demo.toml"


def manifest_argument(
    argv: list[str], default: Path = DEFAULT_MANIFEST
) -> tuple[list[str], Path]:
    """The manifest given as `--manifest X` or `--manifest=X` (`default` if neither),
    and argv with it in the `--manifest X` form."""
    for at, arg in enumerate(argv):
        if arg.startswith("--manifest="):
            path = arg.split("=", 1)[1]
            return [*argv[:at], "--manifest", path, *argv[at + 1 :]], Path(path)
        if arg == "--manifest" and at + 1 < len(argv):
            return argv, Path(argv[at + 1])
    if "--manifest" in argv:  # a trailing --manifest: let the parser say what is missing
        return argv, default
    return ["--manifest", str(default), *argv], default


def run_entry(
    name: str, config_type: type, section: str, doc: str, default: Path, runner: str,
    argv: list[str] | None,
) -> int:  # fmt: skip
    """An entry script's main (the demo's, each experiment's): the manifest in ARGV (`default`
    if none), the options of `config_type` from its [section] and the command line, then
    `runner` ('module:function', imported only then: --help and a bad option answer at once)
    with both. Bad input is one line and exit 2 (pipeline.errors.exit_code)."""
    argv = list(sys.argv[1:] if argv is None else argv)

    def run() -> None:
        args, manifest = manifest_argument(argv, default)
        config = parse_config(config_type, args, doc, section)
        configure(separated=True)  # Ray's and torchrun's output runs between the runner's lines
        module, function = runner.split(":")
        getattr(importlib.import_module(module), function)(config, manifest)

    return exit_code(name, run)


def main(argv: list[str] | None = None) -> int:
    return run_entry("demo", DemoConfig, SECTION, __doc__, DEFAULT_MANIFEST,
                     "apps.demo.run:run_demo", argv)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
