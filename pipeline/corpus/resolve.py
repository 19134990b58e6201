"""From a corpus spec (a file, a folder, a glob, a saved dataset, `hf:NAME`) to its sources."""

from __future__ import annotations

import fnmatch
import glob
from pathlib import Path

from pipeline.cache.manifest import cache_files
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
from pipeline.log import counted, get_logger
from pipeline.storage.store import is_uri, resolve_uri

HUB_PREFIX = "hf:"
JSON_LINES = ("*.jsonl", "*.ndjson", "*.json")
PARQUET = ("*.parquet",)
PLAIN_TEXT = ("*.txt", "*.md")
NAMED = 3  # ignored files a log line names before "..."
WILDCARDS = "*?["

log = get_logger("corpus")


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    base = (
        name[: -len(s)] if (s := next((c for c in ZSTD_SUFFIXES if name.endswith(c)), "")) else name
    )
    return any(fnmatch.fnmatch(base, p) for p in patterns)


SUPPORTED = JSON_LINES + PARQUET + PLAIN_TEXT


def _is_supported(path: Path) -> bool:
    return _matches(path.name, SUPPORTED)


def _is_saved_dataset(path: Path) -> bool:
    if (path / "dataset_dict.json").exists():
        return True
    return (path / "state.json").exists() and (path / "dataset_info.json").exists()


def _file_source(path: Path | str, name: str, size: int | None = None) -> Source:
    """The reader for one file; `path` is a local path, or a URI with its `size` listed."""
    size = Path(path).stat().st_size if size is None else size
    base = str(path).rsplit("/", 1)[-1]
    if _matches(base, JSON_LINES):
        return JsonLinesSource(name, path, size)
    if _matches(base, PARQUET):
        return ParquetSource(name, path, size)
    if _matches(base, PLAIN_TEXT):
        return TextFileSource(name, path, size)
    raise CorpusError(
        f"{path}: unsupported file type; expected JSON lines ({', '.join(JSON_LINES)}), "
        f"Parquet ({', '.join(PARQUET)}) or text ({', '.join(PLAIN_TEXT)}), optionally .zst"
    )


def _folder_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def resolve_sources(spec: str, split: str = "train") -> tuple[str, list[Source]]:
    """(format, sources) for a corpus spec; raises CorpusError if there is nothing to read."""
    if is_uri(spec):
        return "files", _remote_sources(spec)
    if spec.startswith(HUB_PREFIX):
        return "hub", [HubDatasetSource(spec[len(HUB_PREFIX) :], split)]
    path = Path(spec).expanduser()
    if any(ch in spec for ch in WILDCARDS):
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
        files = _folder_files(path)
        if not files:
            raise CorpusError(f"corpus folder {path} holds no supported files")
        return "files", [_file_source(f, f.relative_to(path).as_posix()) for f in files]
    return "files", [_file_source(path, path.name)]


def _folder_files(folder: Path) -> list[Path]:
    """The supported files below `folder`, sorted; a line says which others it ignores and why.

    A stage-1 cache inside the folder is never read as documents: its shards and sidecars would
    pass for Parquet and JSON lines, and each rerun would find a larger corpus."""
    every = sorted(p for p in folder.rglob("*") if p.is_file())
    of_caches = {f for d in {p.parent for p in every} for f in cache_files(d)}
    unsupported = [p for p in every if p not in of_caches and not _is_supported(p)]
    ignored = []
    if of_caches:
        caches = sorted({_shown(folder, p.parent) + "/" for p in of_caches})
        ignored.append(f"{counted(len(of_caches), 'file')} of a stage-1 cache in {_listed(caches)}")
    if unsupported:
        kinds = ", ".join(p.strip("*") for p in SUPPORTED)
        names = _listed([_shown(folder, p) for p in unsupported])
        ignored.append(
            f"{counted(len(unsupported), 'file')} not of a corpus type ({kinds}, "
            f"optionally .zst): {names}"
        )
    if ignored:
        log.warning(f"corpus folder {folder}: ignoring {'; and '.join(ignored)}")
    return [p for p in every if p not in of_caches and _is_supported(p)]


def _shown(folder: Path, path: Path) -> str:
    return path.relative_to(folder).as_posix()


def _listed(names: list[str]) -> str:
    return ", ".join(names[:NAMED]) + (", ..." if len(names) > NAMED else "")


def corpus_root(spec: str) -> Path | str | None:
    """What a corpus spec reads, at or below: its file or folder (a pattern's folder before the
    first wildcard), its URI prefix in object storage; None for a hub dataset."""
    if spec.startswith(HUB_PREFIX):
        return None
    wildcard = any(ch in spec for ch in WILDCARDS)
    if is_uri(spec):
        if not wildcard:
            return spec
        return spec[: min(spec.index(ch) for ch in WILDCARDS if ch in spec)].rsplit("/", 1)[0]
    return _glob_root(spec) if wildcard else Path(spec).expanduser()


def _glob_root(spec: str) -> Path:
    """The folder part of a pattern before its first wildcard: names are relative to it."""
    parts = Path(spec).expanduser().parts
    fixed = []
    for part in parts:
        if any(ch in part for ch in "*?["):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def _remote_sources(spec: str) -> list[Source]:
    """A file, a prefix (every supported file below it) or a glob pattern in object storage;
    names are relative to the prefix, as they are to a local folder, so a corpus copied to a
    bucket keeps its identity."""
    import pyarrow.fs as pafs

    scheme = spec.split("://", 1)[0]
    wildcard = any(ch in spec for ch in WILDCARDS)
    filesystem, base = resolve_uri(corpus_root(spec))
    info = filesystem.get_file_info(base)
    if info.type == pafs.FileType.File and not wildcard:
        return [_file_source(spec, base.rsplit("/", 1)[-1], info.size)]
    listing = filesystem.get_file_info(
        pafs.FileSelector(base, recursive=True, allow_not_found=True)
    )
    files = sorted((i for i in listing if i.type == pafs.FileType.File), key=lambda i: i.path)
    if any(i.base_name in ("dataset_dict.json", "state.json") for i in files):
        raise CorpusError(f"{spec} is a saved dataset: read it from a local folder")
    pattern = resolve_uri(spec)[1] if wildcard else None
    chosen = [
        i
        for i in files
        if (fnmatch.fnmatchcase(i.path, pattern) if pattern else _matches(i.base_name, SUPPORTED))
    ]
    if not chosen:
        what = "pattern" if wildcard else "location"
        raise CorpusError(f"corpus {what} {spec!r} matches no supported files")
    return [
        _file_source(f"{scheme}://{i.path}", i.path[len(base) :].lstrip("/"), i.size)
        for i in chosen
    ]
