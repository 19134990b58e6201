"""Atomic writes, hashing, canonical JSON and transparent zstd: the I/O every output goes through."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import zstandard

from pipeline.errors import VocagnoError

_CHUNK = 1 << 20
_ZSTD_READ = 1 << 16
# mkstemp creates files 0600; outputs should get the mode any other new file would (0666 - umask).
_UMASK = os.umask(0)
os.umask(_UMASK)
TEMPORARY_GLOB = ".*.tmp"  # the temporaries of atomic writes, hidden beside their destinations


def temporary_affixes(name: str) -> tuple[str, str]:
    """The prefix and suffix of a temporary for `name`; TEMPORARY_GLOB matches any between."""
    return f".{name}.", ".tmp"


def canonical_json(obj: Any) -> str:
    """One spelling per value, so that hashes of configs and tokenizers are stable."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def fingerprint(obj: Any) -> str:
    """Short, stable id of a JSON-able value (configs, settings, tokenizer JSON)."""
    return sha256_text(canonical_json(obj))[:16]


def fsync_file(path: str | os.PathLike) -> None:
    """Flush a file's bytes to the disk; on a shared filesystem only the writer's node can."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename durable: the directory entry must reach the disk too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `dest`; on success fsync it and rename it into place.

    On any error the temporary file is removed, so readers only ever see complete files.
    """
    dest = Path(dest)
    if dest.is_dir():  # named here: the rename below would name its temporary instead
        raise IsADirectoryError(errno.EISDIR, "is a folder where a file is to be written", str(dest))
    dest.parent.mkdir(parents=True, exist_ok=True)
    prefix, suffix = temporary_affixes(dest.name)
    fd, tmp_name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    os.chmod(tmp, 0o666 & ~_UMASK)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def fsync_tree(folder: str | os.PathLike) -> None:
    """Flush every file and folder below `folder`, so a rename cannot publish truncated files."""
    for root, _, files in os.walk(folder):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)


def publish_folder(staging: Path, dest: Path, *, flush_files: bool = True) -> None:
    """Rename a finished `staging` folder to `dest` (replacing an older one) and make it durable.

    Readers see no `dest` or a complete one, never a mix. `flush_files=False` is only for folders
    whose files were each flushed by the process that wrote them (ranks on other nodes).
    """
    if flush_files:
        fsync_tree(staging)
    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)
    fsync_dir(dest.parent)


@contextlib.contextmanager
def staged_folder(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty folder beside `dest` to write into; on success publish it as `dest`."""
    dest = Path(dest)
    staging = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier write
    staging.mkdir(parents=True)
    try:
        yield staging
        publish_folder(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def atomic_write_bytes(dest: str | os.PathLike, data: bytes) -> None:
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(dest: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(dest, text.encode("utf-8"))


def json_text(obj: Any) -> str:
    """How every JSON output is spelled: indented, keys sorted, one final newline."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def atomic_write_json(dest: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(dest, json_text(obj))


ZSTD_SUFFIXES = (".zst", ".zstd")


def is_zstd(path: str | os.PathLike) -> bool:
    return str(path).endswith(ZSTD_SUFFIXES)


def read_bytes(path: str | os.PathLike) -> bytes:
    """Whole-file read that undoes zstd compression when the name says so (small files only)."""
    with open_binary_stream(path) as stream:
        return stream.read()


class TruncatedError(VocagnoError):
    """A compressed file ends inside a frame: cut short by an interrupted copy or download."""


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a stream of zstd frames. zstandard's own stream reader ends
    quietly where a file ends inside a frame, and the cut would pass for the end of the data
    (the last line cut in two); here it is a TruncatedError naming the file and the byte."""

    def __init__(self, raw: IO[bytes], name: str):
        self._raw = raw
        self._name = name
        self._frame = None  # the decompressor of the frame being read
        self._consumed = 0  # compressed bytes read
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self._out:
            # Small reads bound the memory one read can decompress to.
            chunk = self._raw.read(_ZSTD_READ)
            if not chunk:
                if self._frame is not None and not self._frame.eof:
                    raise TruncatedError(
                        f"{self._name}: truncated at byte {self._consumed}: the file ends inside "
                        "a zstd frame (an interrupted copy or download?)"
                    )
                return 0
            self._consumed += len(chunk)
            self._out = memoryview(self._decompress(chunk))
        size = min(len(buffer), len(self._out))
        buffer[:size] = self._out[:size]
        self._out = self._out[size:]
        return size

    def _decompress(self, data: bytes) -> bytes:
        parts = []
        while data:
            if self._frame is None or self._frame.eof:  # the next frame starts here
                self._frame = zstandard.ZstdDecompressor().decompressobj()
            parts.append(self._frame.decompress(data))
            data = self._frame.unused_data if self._frame.eof else b""
        return b"".join(parts)


@contextlib.contextmanager
def open_counted_stream(
    path: str | os.PathLike, open_raw=None
) -> Iterator[tuple[IO[bytes], IO[bytes]]]:
    """(raw file, decoded stream), decompressing zstd on the fly without loading the file whole;
    the raw file's position measures progress through it. `open_raw(path)` opens files that are
    not local (pipeline.storage.open_input)."""
    with open_raw(path) if open_raw else open(path, "rb") as raw:
        if is_zstd(path):
            yield raw, io.BufferedReader(_ZstdFrames(raw, str(path)), buffer_size=_CHUNK)
        else:
            yield raw, raw


@contextlib.contextmanager
def open_binary_stream(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """A file's bytes, decompressed if the name says zstd, streamed."""
    with open_counted_stream(path) as (_, stream):
        yield stream


LOW_SPACE = 64 << 20  # bytes free below which a failed write is taken for a full disk


def _out_of_space(exc: BaseException) -> bool:
    """Whether `exc` or what caused it is a write refused for want of space."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(path: Path) -> int:
    """Free space on the file system of `path` (or of its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


@contextlib.contextmanager
def space_checked(folder: Path, what: str, kept: str, needed: int | None = None) -> Iterator[None]:
    """A write into `folder` that fails for want of space becomes one line: where, how much was
    free (and `needed`, where known), and what is `kept`. Libraries say it badly or not at all
    (torch's zip writer: `unexpected pos 704 vs 598`). Other failures pass through."""
    try:
        yield
    except (VocagnoError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # torch.distributed.checkpoint's errors are BaseExceptions
        free = free_bytes(Path(folder))
        if not (_out_of_space(exc) or free < LOW_SPACE):
            raise
        need = f", about {needed / 2**20:,.0f} MiB needed" if needed else ""
        raise VocagnoError(
            f"no space left on the file system of {folder} while writing {what} "
            f"({free / 2**20:,.0f} MiB free{need}); {kept}: free space and run the same command"
        ) from None
