"""From a corpus spec (a file, a folder, a glob, a saved dataset, `hf:NAME`) to its sources."""

from __future__ import annotations

import fnmatch
import glob
from pathlib import Path

from pipeline.corpus.sources import (
    HubDatasetSource,
    JsonLinesSource,
    ParquetSource,
    SavedDatasetSource,
    Source,
    TextFileSource,
)
from pipeline.errors import CorpusError
from pipeline.io import ZSTD_SUFFIXES

HUB_PREFIX = "hf:"
JSON_LINES = ("*.jsonl", "*.ndjson", "*.json")
PARQUET = ("*.parquet",)
PLAIN_TEXT = ("*.txt", "*.md")


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    base = (
        name[: -len(s)] if (s := next((c for c in ZSTD_SUFFIXES if name.endswith(c)), "")) else name
    )
    return any(fnmatch.fnmatch(base, p) for p in patterns)


def _is_supported(path: Path) -> bool:
    return _matches(path.name, JSON_LINES + PARQUET + PLAIN_TEXT)


def _is_saved_dataset(path: Path) -> bool:
    if (path / "dataset_dict.json").exists():
        return True
    return (path / "state.json").exists() and (path / "dataset_info.json").exists()


def _file_source(path: Path, name: str) -> Source:
    size = path.stat().st_size
    if _matches(path.name, JSON_LINES):
        return JsonLinesSource(name, path, size)
    if _matches(path.name, PARQUET):
        return ParquetSource(name, path, size)
    if _matches(path.name, PLAIN_TEXT):
        return TextFileSource(name, path, size)
    raise CorpusError(
        f"{path}: unsupported file type; expected JSON lines ({', '.join(JSON_LINES)}), "
        f"Parquet ({', '.join(PARQUET)}) or text ({', '.join(PLAIN_TEXT)}), optionally .zst"
    )


def _folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def resolve_sources(spec: str, split: str = "train") -> tuple[str, list[Source]]:
    """(format, sources) for a corpus spec; raises CorpusError if there is nothing to read."""
    if spec.startswith(HUB_PREFIX):
        return "hub", [HubDatasetSource(spec[len(HUB_PREFIX) :], split)]
    path = Path(spec).expanduser()
    if any(ch in spec for ch in "*?["):
        root = _glob_root(spec)
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise CorpusError(f"corpus pattern {spec!r} matches no files")
        return "files", [_file_source(f, f.relative_to(root).as_posix()) for f in files]
    if not path.exists():
        raise CorpusError(
            f"corpus path {spec!r} does not exist (for a hub dataset, write {HUB_PREFIX}NAME)"
        )
    if path.is_dir() and _is_saved_dataset(path):
        name = path.name if (path / "state.json").exists() else f"{path.name}/{split}"
        return "datasets", [SavedDatasetSource(name, path, _folder_size(path))]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and _is_supported(p))
        if not files:
            raise CorpusError(f"corpus folder {path} holds no supported files")
        return "files", [_file_source(f, f.relative_to(path).as_posix()) for f in files]
    return "files", [_file_source(path, path.name)]


def _glob_root(spec: str) -> Path:
    """The folder part of a pattern before its first wildcard: names are relative to it."""
    parts = Path(spec).expanduser().parts
    fixed = []
    for part in parts:
        if any(ch in part for ch in "*?["):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")
