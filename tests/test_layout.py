"""The folder map of docs/layout.md, enforced: who may import whom, and the entry points that must
run from a source tree without `pip install`."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (
    "pipeline", "apps", "stage1_score", "stage2_train", "scripts", "benchmarks", "experiments",
    "tests",
)  # fmt: skip
# What each folder must never import (a prefix matches the module and everything below it).
FORBIDDEN = {
    "pipeline": ("stage1_score", "stage2_train", "apps", "scripts", "benchmarks", "tests", "vllm"),
    # Applications start the stages as processes (Ray job, torchrun); of a stage they may read
    # only its option declarations (ALLOWED), to check a manifest before starting anything.
    "apps": ("stage1_score", "stage2_train", "scripts", "benchmarks", "tests", "vllm"),
    "stage1_score": ("stage2_train", "apps", "scripts", "benchmarks", "tests"),
    # Stage 2 never holds a teacher: its losses come from the cache.
    "stage2_train": (
        "stage1_score",
        "apps",
        "scripts",
        "benchmarks",
        "tests",
        "vllm",
        "pipeline.scoring.teacher",
        "pipeline.scoring.hf",
        "pipeline.models.teacher_assets",
    ),
}
# A stage's public interface besides its entry point: the typed options it accepts.
# `vocagno analyze selection` measures what stage 2 would select, so it reads stage 2's own data
# path and forward (apps/analysis/selection.py), not a copy of them.
ALLOWED = {
    "apps": (
        "stage1_score.config", "stage2_train.config", "stage2_train.data",
        "stage2_train.attention",
    )
}  # fmt: skip
LINE_LIMIT = 350


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = REPO) -> set[str]:
    """Every module a file imports, at the top or inside a function, relative imports resolved."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _sources(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_follow_the_folder_map(folder):
    violations = [
        f"{path.relative_to(REPO)} imports {module}"
        for path in _sources(folder)
        for module in sorted(imported_modules(path))
        for prefix in FORBIDDEN[folder]
        if _matches(module, prefix)
        and not any(_matches(module, allowed) for allowed in ALLOWED.get(folder, ()))
    ]
    assert not violations, "\n".join(violations)


def test_the_walk_sees_lazy_and_relative_imports(tmp_path):
    # The check above is only as good as this walk: a lazy import inside a function and a
    # relative import must both be seen, or a stage could slip into the library unnoticed.
    (tmp_path / "pipeline" / "cache").mkdir(parents=True)
    probe = tmp_path / "pipeline" / "cache" / "probe.py"
    probe.write_text("def f():\n    import stage2_train.trainer\nfrom ..io import fingerprint\n")
    assert {"stage2_train.trainer", "pipeline.io"} <= imported_modules(probe, root=tmp_path)


def import_graph(folder: Path, root: Path = REPO) -> dict[str, set[str]]:
    """Module -> the modules of `folder`'s package it imports, at any depth (inside a function
    too), each `from a.b import c` counted as the module it names (c, or else a.b). A package's
    __init__ that gathers its submodules is no circle with them, so the import of a parent
    package that Python runs first is left out, as cycle checkers (pylint's) do."""
    modules = {_module_name(path, root): path for path in sorted(folder.rglob("*.py"))}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        found = {known(module) for module in imported_modules(path, root)}
        graph[name] = {module for module in found if module and module != name} & set(modules)
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports in `graph` (its modules in order), or None."""
    import graphlib

    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return error.args[1]
    return None


def test_the_library_has_no_import_circle():
    """A circle makes what a module may import depend on who imported it first, and keeps a
    newcomer from reading the library bottom up. One of 10 files went through guidance_modes."""
    cycle = import_cycle(import_graph(REPO / "pipeline"))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_circle_check_sees_a_circle_through_a_lazy_import(tmp_path):
    package = tmp_path / "pipeline"
    (package / "distillation").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "distillation" / "__init__.py").write_text("")
    (package / "modes.py").write_text("def f():\n    from pipeline.distillation import uld\n")
    (package / "distillation" / "uld.py").write_text("from pipeline.schema import X\n")
    (package / "schema.py").write_text("from pipeline import modes\n")
    cycle = import_cycle(import_graph(package, root=tmp_path))
    assert cycle is not None and "pipeline.modes" in cycle and "pipeline.distillation.uld" in cycle
    (package / "schema.py").write_text("X = 1\n")
    assert import_cycle(import_graph(package, root=tmp_path)) is None


@pytest.mark.parametrize("folder", ["pipeline", "apps", "stage1_score", "stage2_train"])
def test_each_file_keeps_to_one_responsibility_in_size(folder):
    long = [
        f"{path.relative_to(REPO)}: {n} lines"
        for path in _sources(folder)
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > LINE_LIMIT
    ]
    assert not long, f"over {LINE_LIMIT} lines, split by responsibility:\n" + "\n".join(long)


# Stage 2's loop reads top to bottom (issue 79): the loop a page, every function one screen.
FUNCTION_LINE_LIMIT = {"stage2_train": 60}
LOOP_LINE_LIMIT = 80  # stage2_train/trainer.py's _train
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def function_lengths(path: Path) -> dict[str, int]:
    """Lines of every function and method in a file (decorators and docstrings included), by
    qualified name."""
    lengths = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, DEFINITIONS):
                visit(child, prefix)
                continue
            name = prefix + child.name
            if not isinstance(child, ast.ClassDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                lengths[name] = child.end_lineno - first + 1
            visit(child, f"{name}.")

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return lengths


@pytest.mark.parametrize("folder", sorted(FUNCTION_LINE_LIMIT))
def test_each_function_fits_a_screen(folder):
    limit = FUNCTION_LINE_LIMIT[folder]
    long = [
        f"{path.relative_to(REPO)}: {name}, {n} lines"
        for path in _sources(folder)
        for name, n in function_lengths(path).items()
        if n > limit
    ]
    assert not long, f"over {limit} lines, split by responsibility:\n" + "\n".join(long)
    loop = function_lengths(REPO / "stage2_train" / "trainer.py")["_train"]
    assert loop <= LOOP_LINE_LIMIT, f"stage2_train/trainer.py: _train is {loop} lines"


def test_function_lengths_count_methods_and_nested_functions(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "class A:\n    @staticmethod\n    def f():\n        def g():\n            pass\n"
    )
    assert function_lengths(probe) == {"A.f": 4, "A.f.g": 2}


def _without_install(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run Python as on a fresh clone: no `site`, so no editable install of this project; the
    environment's third-party packages stay importable through PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"])
    return subprocess.run(
        [sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


ENTRY_POINTS = [
    ("stage1_score/run.py", "stage1_score.run"),
    ("stage2_train/train.py", "stage2_train.train"),
    ("stage2_train/export.py", "stage2_train.export"),
    ("experiments/guidance_curve.py", "experiments.guidance_curve"),
    ("scripts/demo.py", "scripts.demo"),
    ("scripts/prepare_teacher.py", "scripts.prepare_teacher"),
    (None, "apps.cli"),
]


@pytest.mark.parametrize(("path", "module"), ENTRY_POINTS)
def test_entry_points_run_from_a_source_tree(path, module, tmp_path):
    runs = [_without_install(["-m", module, "--help"], cwd=REPO)]
    if path is not None:  # as `ray job submit` and torchrun start them: a path, from anywhere
        runs.append(_without_install([str(REPO / path), "--help"], cwd=tmp_path))
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
        assert "usage:" in run.stdout
