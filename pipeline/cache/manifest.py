"""`manifest.json`: what produced a cache, and every shard's size and checksum. Written last."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.cache.schema import SCHEMA_VERSION, shard_name
from pipeline.cache.settings import CacheSettings
from pipeline.errors import CacheError
from pipeline.io import TEMPORARY_GLOB, fingerprint
from pipeline.storage import Store

MANIFEST_NAME = "manifest.json"
# What stage 1 writes beside the manifest (stage1_score/output.py describes each file).
LOCK_NAME = ".stage1.lock"
PRODUCER_NAME = "producer.json"
RUN_RECORD_NAME = "stage1-run.json"
UNIT_FILES_GLOB = "shard-*"  # the shards and their sidecars
PROFILE_GLOB = "profile-unit-*.json"  # --profile-unit's trace
CACHE_FILE_GLOBS = (
    UNIT_FILES_GLOB,
    TEMPORARY_GLOB,
    PROFILE_GLOB,
    MANIFEST_NAME,
    PRODUCER_NAME,
    RUN_RECORD_NAME,
    LOCK_NAME,
)


def profile_name(index: int) -> str:
    """The trace of unit `index`'s scoring (`--profile-unit`), beside its shard."""
    return f"profile-unit-{index:06d}.json"


def cache_files(folder: Path) -> list[Path]:
    """The files of a stage-1 cache in `folder`, sorted; none where `folder` is no cache (no
    producer record or lock, which stage 1 writes first, and no manifest beside shards)."""
    if not (folder / PRODUCER_NAME).is_file() and not (folder / LOCK_NAME).is_file():
        if not (folder / MANIFEST_NAME).is_file() or not any(folder.glob(UNIT_FILES_GLOB)):
            return []
    return sorted({p for glob in CACHE_FILE_GLOBS for p in folder.glob(glob) if p.is_file()})


@dataclass(frozen=True)
class ShardRecord:
    index: int
    file: str
    rows: int
    teacher_tokens: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class SkippedDocument:
    """A corpus record that is in no shard, and why: nothing is dropped silently."""

    source: str
    record: int
    doc_id: str | None
    reason: str


@dataclass
class CacheManifest:
    """Producer identity (teacher, tokenizer, settings, corpus) plus the shard table.

    `producer_fingerprint` is the hash of the producer fields: two caches with the same value were
    made by the same teacher, tokenizer, settings and corpus, and may be mixed; others may not.
    """

    teacher: dict
    tokenizer: dict
    settings: CacheSettings
    corpus: dict
    shards: list[ShardRecord] = field(default_factory=list)
    skipped: list[SkippedDocument] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION
    software: dict = field(default_factory=dict)
    # the hf backend's switches as the workers resolved them (pipeline.scoring.switches), in the
    # software's shape: not in the identity either, as each switch gives the same columns up to
    # rounding (docs/stage1-gpu-path.md)
    switches: dict = field(default_factory=dict)

    @property
    def producer(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "teacher": self.teacher,
            "tokenizer": self.tokenizer,
            "settings": self.settings.to_json(),
            "corpus": self.corpus,
        }

    @property
    def producer_fingerprint(self) -> str:
        return fingerprint(self.producer)

    @property
    def total_rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def total_teacher_tokens(self) -> int:
        return sum(s.teacher_tokens for s in self.shards)

    def to_json(self) -> dict:
        data = asdict(self) | {"settings": self.settings.to_json()}
        data["producer_fingerprint"] = self.producer_fingerprint
        data["totals"] = {
            "shards": len(self.shards),
            "rows": self.total_rows,
            "teacher_tokens": self.total_teacher_tokens,
            "skipped": len(self.skipped),
        }
        return data

    @classmethod
    def from_json(cls, data: dict, where: str = "manifest") -> CacheManifest:
        try:
            version = data["schema_version"]
            if version != SCHEMA_VERSION:
                raise CacheError(
                    f"{where}: cache schema version {version}, this vocagno reads {SCHEMA_VERSION}"
                )
            manifest = cls(
                teacher=data["teacher"],
                tokenizer=data["tokenizer"],
                settings=CacheSettings.from_json(data["settings"], f"{where}: settings"),
                corpus=data["corpus"],
                shards=[ShardRecord(**s) for s in data["shards"]],
                skipped=[SkippedDocument(**s) for s in data["skipped"]],
                schema_version=version,
                software=data.get("software", {}),
                switches=data.get("switches", {}),
            )
            for shard in manifest.shards:
                _check_shard_record(shard)
            if len({shard.index for shard in manifest.shards}) != len(manifest.shards):
                raise ValueError("a shard index is listed twice")
        except CacheError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise CacheError(f"{where}: malformed manifest ({exc})") from exc
        recorded = data.get("producer_fingerprint")
        if recorded != manifest.producer_fingerprint:
            raise CacheError(
                f"{where}: producer fingerprint {recorded} does not match its contents "
                f"({manifest.producer_fingerprint}); the manifest was edited or corrupted"
            )
        return manifest


def _check_shard_record(shard: ShardRecord) -> None:
    """A record's values before any is used as a path or a count: the file name is the one unit
    `index` always gets, so no manifest can point a reader outside its cache folder."""
    if not isinstance(shard.index, int) or isinstance(shard.index, bool) or shard.index < 0:
        raise ValueError(f"shard index {shard.index!r} is not a non-negative integer")
    if shard.file != shard_name(shard.index):
        raise ValueError(
            f"shard {shard.index} is named {shard.file!r}, not {shard_name(shard.index)!r}"
        )
    for name in ("rows", "teacher_tokens", "bytes"):
        value = getattr(shard, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
            raise ValueError(f"shard {shard.index}: {name} {value!r} is not a count")
    if not (isinstance(shard.sha256, str) and re.fullmatch(r"[0-9a-f]{64}", shard.sha256)):
        raise ValueError(f"shard {shard.index}: sha256 {shard.sha256!r} is not a SHA-256 digest")


UNRECORDED = "unrecorded"  # a shard whose sidecar predates the software record


def cache_software(by_shard: Mapping[int, Mapping[str, str]]) -> dict:
    """The manifest's `software`: the versions of the workers that scored the shards (never the
    driver's, which computes nothing stored); its `switches` take the same shape. Where the
    shards' records differ (a run resumed under another torch or Triton: the run's identity names
    only the backend's version), each package that differs maps its versions to the shards they
    scored, "not installed" and UNRECORDED among them."""
    indices = sorted(by_shard)
    packages = dict.fromkeys(package for index in indices for package in by_shard[index])
    software: dict = {}
    for package in packages:
        shards: dict[str, list[int]] = {}
        for index in indices:
            record = by_shard[index]
            version = record.get(package, "not installed" if record else UNRECORDED)
            shards.setdefault(version, []).append(index)
        software[package] = next(iter(shards)) if len(shards) == 1 else shards
    return software


def write_manifest(cache_dir: str | Path, manifest: CacheManifest) -> None:
    Store(cache_dir).write_json(MANIFEST_NAME, manifest.to_json())


def load_manifest(cache_dir: str | Path) -> CacheManifest:
    """The cache's manifest; `cache_dir` is a local folder or a URI (pipeline.storage)."""
    store = Store(cache_dir)
    path = store.display(MANIFEST_NAME)
    if store.local is not None and store.local.exists() and not store.local.is_dir():
        raise CacheError(
            f"cache {cache_dir} is a file; give the cache folder (with {MANIFEST_NAME})"
        )
    if not store.is_folder():
        raise CacheError(f"cache folder {cache_dir} does not exist")
    if store.size(MANIFEST_NAME) is None:
        if not store.names(UNIT_FILES_GLOB) and store.size(PRODUCER_NAME) is None:
            raise CacheError(f"{cache_dir} is not a cache: no {MANIFEST_NAME} and no shards")
        raise CacheError(f"{path} does not exist: stage 1 has not finished writing this cache")
    try:
        data = json.loads(store.read_bytes(MANIFEST_NAME).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CacheError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CacheError(f"{path} is not a JSON object")
    return CacheManifest.from_json(data, where=str(path))
