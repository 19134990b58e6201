"""Prove that a stage 2 process never imports a teacher backend nor opens a teacher's files.

`audited_env` puts a sitecustomize.py on PYTHONPATH, so every Python process started with that
environment (a torchrun launcher and its ranks too) records each file it opens (audit hook) and,
at exit, the modules it imported. `assert_no_teacher` checks those reports.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

# The teacher's scorers live in the library now (pipeline.scoring), so stage 1 being absent is not
# enough: neither of the modules that load a teacher may be imported either.
FORBIDDEN_MODULES = (
    "stage1_score",
    "vllm",
    "pipeline.models.teacher_assets",
    "pipeline.scoring.hf",
    "pipeline.scoring.teacher",
)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".distcp")
SITECUSTOMIZE = textwrap.dedent(
    """
    import atexit, json, os, sys

    _opened = set()

    def _hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            _opened.add(os.fsdecode(args[0]))

    def _dump():
        path = os.path.join(os.environ["VOCAGNO_AUDIT_DIR"], f"{os.getpid()}.json")
        with open(path, "w") as out:
            json.dump({"modules": sorted(sys.modules), "opened": sorted(_opened)}, out)

    sys.addaudithook(_hook)
    atexit.register(_dump)
    """
)


def fake_teacher(folder: Path) -> dict:
    """A folder that looks like a teacher model; returns the manifest's `teacher` record for it."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"not weights")
    return {"id": str(folder), "backend": "hf"}


def audited_env(root: Path) -> dict:
    """Environment additions that make every Python process report to root/audit."""
    (root / "site").mkdir(parents=True)
    (root / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (root / "audit").mkdir()
    return {
        "PYTHONPATH": os.pathsep.join([str(root / "site"), os.environ.get("PYTHONPATH", "")]),
        "VOCAGNO_AUDIT_DIR": str(root / "audit"),
    }


def assert_no_teacher(root: Path, teacher: Path, out: Path, ranks: int) -> None:
    reports = [json.loads(p.read_text()) for p in (root / "audit").glob("*.json")]
    trainers = [r for r in reports if "stage2_train.trainer" in r["modules"]]
    assert len(trainers) == ranks  # every rank reported
    for report in reports:
        assert not [m for m in report["modules"] if m.startswith(FORBIDDEN_MODULES)]
        assert not [p for p in report["opened"] if p.startswith(str(teacher))]
        weights = [p for p in report["opened"] if p.endswith(WEIGHT_SUFFIXES)]
        assert all(p.startswith(str(out)) for p in weights), weights  # only its own checkpoints
    # The hook does see model files: the run's own checkpoint was written and read back.
    assert any(p.endswith(".distcp") for r in trainers for p in r["opened"])
