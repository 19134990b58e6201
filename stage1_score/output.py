"""The output folder of a stage-1 run: a lock, the run's identity, per-unit sidecars, resuming.

Layout of a cache folder:
  .stage1.lock                 held (flock) by the one run writing here; released when it exits,
                               even when killed, so a crash never leaves a stale lock
  producer.json                identity of the run (teacher, tokenizer, settings, corpus files)
  shard-000007.parquet         unit 7's documents, written atomically
  shard-000007.json            its sidecar, written after the shard: the unit is finished (and
                               the software that scored it)
  stage1-run.json              options and workers of the last run that scored units (how, not
                               what: not identity); a rerun with nothing to do leaves it as it is
  profile-unit-000002.json     with --profile-unit 2: a trace of unit 2's scoring (not the cache's
                               contents; the manifest does not list it)
  manifest.json                written last, once every unit is finished

A unit counts as finished only if its sidecar names this run's identity and the unit's content
hash, and its shard has the recorded size and sha256; anything less is scored again.

In object storage (`--out s3://…`, pipeline.storage) the layout is the same; each file is one
complete upload instead of a rename, and the lock is a lease (pipeline.storage.lease): a killed
run's lock lapses after `--lock-lease` seconds rather than at once.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from pipeline.cache.manifest import (
    CACHE_FILE_GLOBS,
    LOCK_NAME,
    MANIFEST_NAME,
    PRODUCER_NAME,
    TEMPORARY_GLOB,
    UNIT_FILES_GLOB,
    ShardRecord,
    cache_software,
    load_manifest,
)
from pipeline.cache.schema import shard_name
from pipeline.cache.settings import CacheSettings
from pipeline.cache.verify import verify_shard
from pipeline.differences import setting_differences
from pipeline.errors import CacheError
from pipeline.io import fingerprint, temporary_affixes
from pipeline.log import counted
from pipeline.storage import Store
from pipeline.storage.lease import LeaseLock
from pipeline.storage.lock import FolderLock


def sidecar_name(index: int) -> str:
    return shard_name(index).removesuffix(".parquet") + ".json"


class OutputLock(FolderLock):
    """Exclusive lock on a cache folder for the life of one run."""

    def __init__(self, folder: Path):
        super().__init__(folder, LOCK_NAME, "stage-1 run")


@dataclass(frozen=True)
class Sidecar:
    """Written after a unit's shard: proof that the unit is finished, and from what."""

    shard: ShardRecord
    run_fingerprint: str
    content_sha256: str
    # the scoring worker's software (pipeline.versions): not in the run's identity, as a rerun
    # under another torch or Triton resumes the cache (the backend's version is in it)
    software: dict[str, str]
    # the scorer's switches as resolved on its worker (pipeline.scoring.switches; {}: vLLM's)
    switches: dict[str, str | None] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Sidecar:
        return cls(
            ShardRecord(**data["shard"]),
            data["run_fingerprint"],
            data["content_sha256"],
            data.get("software", {}),  # {} from a sidecar written before it was recorded
            data.get("switches", {}),
        )


def output_lock(folder: str | Path, lease: float, log=print) -> OutputLock | LeaseLock:
    """The lock for a local folder (flock) or a prefix in object storage (a lease)."""
    store = Store(folder)
    if store.remote:
        return LeaseLock(store, LOCK_NAME, lease, log=log)
    return OutputLock(store.local)


@contextlib.contextmanager
def output_held(folder: str | Path, lease: float, log=print) -> Iterator[OutputLock | LeaseLock]:
    """output_lock(folder) for the life of a run; a run that fails before it finishes a unit
    (a bad record, a worker that cannot start) or is stopped (Ctrl-C, SIGTERM) leaves nothing
    behind: the files it created are deleted while the lock is held, then the folders it
    created, if empty. What was there before stays, and a failure or stop after a finished
    unit keeps everything for the rerun."""
    store = Store(folder)
    before = set(store.names())
    made: list[Path] = []  # the folders the lock will create, deepest first
    if store.local is not None:
        missing = store.local.absolute()
        while not missing.exists():
            made.append(missing)
            missing = missing.parent
    try:
        with output_lock(folder, lease, log) as lock:
            try:
                yield lock
            except BaseException:  # KeyboardInterrupt: a stop signal (pipeline.errors)
                created = set(store.names()) - before
                if not any(fnmatch.fnmatch(name, UNIT_FILES_GLOB) for name in created):
                    for name in sorted(created):
                        store.delete(name)
                raise
    except BaseException:
        for path in made:  # those a failed mkdir did not reach are skipped
            if path.is_dir():
                if any(path.iterdir()):  # a finished unit, or someone else's file
                    break
                path.rmdir()
        raise


def write_sidecar(folder: str | Path, sidecar: Sidecar) -> None:
    Store(folder).write_json(sidecar_name(sidecar.shard.index), sidecar.to_json())


def read_sidecar(folder: str | Path, index: int) -> Sidecar | None:
    """The unit's sidecar, or None if there is none or it is unreadable (the unit is redone)."""
    try:
        return Sidecar.from_json(Store(folder).read_json(sidecar_name(index)))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def _our_files(store: Store) -> list[str]:
    patterns = [pattern for pattern in CACHE_FILE_GLOBS if pattern != LOCK_NAME]
    return sorted({name for pattern in patterns for name in store.names(pattern)})


def _existing_identity(store: Store, overwrite: bool) -> dict | None:
    if store.size(PRODUCER_NAME) is not None:
        try:
            return store.read_json(PRODUCER_NAME)
        except ValueError as exc:
            raise CacheError(
                f"{store.display(PRODUCER_NAME)} is not valid JSON ({exc}); "
                "pass --overwrite to start over"
            ) from exc
    if store.size(MANIFEST_NAME) is not None:
        try:
            return load_manifest(store.location).producer
        except CacheError as exc:
            if _cache_manifest_like(store):  # a damaged cache: --overwrite replaces it
                if overwrite:
                    return {"damaged manifest": str(exc)}
                raise CacheError(f"{exc}; pass --overwrite to replace the cache") from None
            raise CacheError(
                f"--out {store.location} holds a {MANIFEST_NAME} that is no stage-1 cache's ({exc}); "
                "stage 1 writes its own there and never replaces a file it did not write, "
                "--overwrite included: choose another --out"
            ) from None
    return None


def _cache_manifest_like(store: Store) -> bool:
    """Whether the folder's manifest reads as a cache's, damaged or from another version: a JSON
    object with the cache's schema_version and producer fingerprint."""
    try:
        data = json.loads(store.read_bytes(MANIFEST_NAME).decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and {"schema_version", "producer_fingerprint"} <= data.keys()


def _encoding_resuming(existing: dict, identity: dict) -> str | None:
    """The --topk-encoding that would resume the `existing` cache where nothing else differs
    from this run's `identity`."""
    try:
        theirs = CacheSettings.from_json(existing.get("settings"))
    except CacheError:  # no settings this vocagno writes: no encoding resumes them
        return None
    ours = replace(CacheSettings.from_json(identity["settings"]), topk_encoding=theirs.topk_encoding)
    if theirs.topk_probs and existing == identity | {"settings": ours.to_json()}:
        return theirs.topk_encoding
    return None


def prepare_output(folder: str | Path, identity: dict, overwrite: bool, log=print) -> str:
    """Make `folder` ready for a run with `identity` (the lock must be held); returns its fingerprint.

    A folder from another identity is refused unless `overwrite`, which deletes the cache's files
    (and nothing else). Temporary files of an interrupted write are removed.
    """
    store = Store(folder)
    existing = _existing_identity(store, overwrite)
    leftovers = store.names("shard-*")
    has_manifest = store.size(MANIFEST_NAME) is not None
    if existing not in (None, identity) and not leftovers and not has_manifest:
        # A run that stopped before its first shard (a bad record, a wrong option) left only its
        # settings: nothing can mix, so the rerun its error message suggests may go ahead.
        log(f"{folder} holds no finished shard: the earlier run's settings give way to this one's")
    elif (existing is not None and existing != identity) or (existing is None and leftovers):
        if not overwrite:
            detail = (
                "; ".join(setting_differences(existing, identity))
                if existing is not None
                else f"{len(leftovers)} shard file(s) of unknown origin"
            )
            encoding = _encoding_resuming(existing, identity) if existing is not None else None
            hint = f" (--topk-encoding {encoding} resumes it)" if encoding else ""
            raise CacheError(
                f"{folder} holds a cache made differently ({detail}); it would mix with this run. "
                f"Pass --overwrite to replace it, or choose another --out{hint}"
            )
        for name in _our_files(store):
            store.delete(name)
        log(f"--overwrite: removed the previous cache in {folder}")
    remove_temporaries(store)
    store.write_json(PRODUCER_NAME, identity)
    return fingerprint(identity)


def remove_temporaries(store: Store) -> None:
    """Delete the temporary files of interrupted writes (the lock must be held), except the lock's
    own: in object storage those are the live lease's renewals in flight, and LeaseLock removes a
    killed holder's when it lets go."""
    lock_temporaries = "*".join(temporary_affixes(LOCK_NAME))
    for name in store.names(TEMPORARY_GLOB):
        if not fnmatch.fnmatch(name, lock_temporaries):
            store.delete(name)


def finished_shard(
    folder: str | Path, index: int, content_sha256: str, run_fingerprint: str, log=print
):
    """The unit's sidecar if the unit is finished (see the module docstring), else None."""
    sidecar = read_sidecar(folder, index)
    if sidecar is None:
        return None
    if sidecar.run_fingerprint != run_fingerprint:
        return None
    if sidecar.content_sha256 != content_sha256:
        raise CacheError(
            f"unit {index} in {folder} was scored from other documents than the corpus now holds "
            f"at that position: the corpus changed. Pass --overwrite to rebuild the cache"
        )
    try:
        verify_shard(folder, sidecar.shard)
    except CacheError as exc:
        log(f"unit {index}: {exc}; scoring it again")
        return None
    return sidecar


def scored_by(sidecars: dict[int, Sidecar], what: str, log=print) -> dict:
    """The manifest's `what` record ("software" or "switches") from the units' sidecars
    (pipeline.cache.manifest: cache_software), said in one line where the shards' differ."""
    record = cache_software({index: getattr(sidecar, what) for index, sidecar in sidecars.items()})
    mixed = [
        f"{name} " + ", ".join(f"{v} ({counted(len(s), 'shard')})" for v, s in values.items())
        for name, values in record.items()
        if isinstance(values, dict)
    ]
    if mixed:
        log(
            f"the cache's shards were scored with different {what}: {'; '.join(mixed)}; "
            f"{MANIFEST_NAME} names each value's shards ({what})"
        )
    return record
