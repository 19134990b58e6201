"""A folder that may be local or in object storage, and the few operations the cache needs on it.

A location is a local path or a URI (`s3://bucket/prefix`, `gs://…`, `hf://…`, anything
`pyarrow.fs.FileSystem.from_uri` or, failing that, fsspec resolves). Credentials and endpoints
come the standard way, from the environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`,
`AWS_PROFILE`, …) of the process that opens the location; a Store pickles as its location, so each
Ray actor or data-loader worker resolves its own.

Publishing is atomic on both kinds: a local file is written to a temporary name, flushed and
renamed (pipeline.io); an object is sent whole from memory to a temporary name and, once the
upload has completed, copied into place by the server (S3's CopyObject, which takes objects up to
5 GiB), so a reader never sees part of one, even where a write fails or is interrupted midway.
Local folders keep exactly the behaviour they always had.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import functools
import hashlib
import io
import json
import os
import re
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from pipeline.errors import ConfigError
from pipeline.io import (
    atomic_write_bytes,
    atomic_write_json,
    json_text,
    sha256_file,
    temporary_affixes,
)

_CHUNK = 1 << 20
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
# Environment variables that choose a store's endpoint and credentials.
_SETTINGS = ("AWS_", "GOOGLE_", "GCS_", "HF_", "AZURE_")


# `scheme://KEY:SECRET@host/...`: credentials written into a URI's authority
_CREDENTIALS = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@")


def masked(location: Any) -> str:
    """`location` as it may be shown: any credentials in a URI as `***`."""
    return _CREDENTIALS.sub(r"\1***@", str(location))


def credentials_in(location: Any) -> str | None:
    """Why `location` may not be used, where it is a URI that carries credentials: they would be
    printed, logged and saved wherever the location is (messages, manifests, run configs)."""
    if not isinstance(location, str | os.PathLike) or masked(location) == str(location):
        return None
    return (
        f"{masked(location)} carries credentials, which would be printed, logged and saved with "
        "it: give them by the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
        "AWS_PROFILE, or your store's own) instead"
    )


def is_uri(location: Any) -> bool:
    """True for `scheme://…` other than `file://`: a location served by a filesystem library."""
    text = str(location) if isinstance(location, str) else ""
    return bool(_URI.match(text)) and not text.startswith("file://")


def as_location(location: str | os.PathLike) -> str | Path:
    """A URI kept as given (a Path would fold its `//`), anything else as a Path."""
    if isinstance(location, Store):
        return location.location if location.remote else location.local
    refusal = credentials_in(location)
    if refusal:
        raise ConfigError(refusal)
    if is_uri(location):
        return str(location).rstrip("/")
    return Path(str(location).removeprefix("file://"))


def location_argument(text: str) -> str | Path:
    """`type=` of an argparse location: `as_location`, a refusal in argparse's own words (its
    exceptions would escape the parser)."""
    try:
        return as_location(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def child(location: str | os.PathLike, name: str) -> str | Path:
    """File `name` inside the folder or prefix `location`."""
    location = as_location(location)
    return f"{location}/{name}" if isinstance(location, str) else location / name


@functools.cache
def _filesystem(root: str, environment: tuple):
    """One filesystem per bucket (or host), process and `environment` (the settings it was opened
    with): opening one may cost a round trip (S3 looks up the bucket's region)."""
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(root)[0]
    except Exception as native:  # a scheme pyarrow has no filesystem for: ask fsspec
        try:
            import fsspec

            fs = fsspec.core.url_to_fs(root)[0]
        except Exception as exc:
            raise ConfigError(
                f"cannot open {root}: {' '.join(str(native).split())}; fsspec: {exc}"
            ) from None
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def resolve_uri(uri: str):
    """(pyarrow filesystem, path inside it) for a URI; ConfigError naming it if none can serve it.

    The path is the bucket (or host) and key, as pyarrow's and fsspec's object stores spell it."""
    refusal = credentials_in(uri)
    if refusal:
        raise ConfigError(refusal)
    parts = urllib.parse.urlsplit(uri)
    root = f"{parts.scheme}://{parts.netloc}" + (f"?{parts.query}" if parts.query else "")
    settings = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_SETTINGS)))
    return _filesystem(root, settings), f"{parts.netloc}{parts.path}".rstrip("/")


def open_parquet(location: str | os.PathLike):
    """pyarrow.parquet.ParquetFile of a local path or a URI (read by ranges, never whole)."""
    import pyarrow.parquet as pq

    if not is_uri(location):
        return pq.ParquetFile(location)
    filesystem, path = resolve_uri(str(location))
    return pq.ParquetFile(filesystem.open_input_file(path))


class _CountedStream(io.RawIOBase):
    """A pyarrow input stream as a Python raw stream that knows how far it has read."""

    def __init__(self, stream):
        self._stream = stream
        self._position = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._stream.read(len(buffer))
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)

    def tell(self) -> int:
        return self._position

    def close(self) -> None:
        self._stream.close()
        super().close()


def open_input(location: str | os.PathLike) -> IO[bytes]:
    """A file's bytes streamed from the start, local or remote; `tell()` is the bytes read."""
    if not is_uri(location):
        return open(as_location(location), "rb")
    filesystem, path = resolve_uri(str(location))
    return io.BufferedReader(_CountedStream(filesystem.open_input_stream(path)), _CHUNK)


class Store:
    """A folder (local) or prefix (object storage) holding flat files, addressed by name."""

    def __init__(self, location: str | os.PathLike | Store):
        location = as_location(location)
        self.remote = isinstance(location, str)
        self.location = location if self.remote else str(location)
        self.local: Path | None = None if self.remote else location
        if self.remote:
            self.fs, self.root = resolve_uri(location)

    def __reduce__(self):
        return Store, (self.location,)

    def __str__(self) -> str:
        return self.location

    def __repr__(self) -> str:
        return f"Store({self.location!r})"

    def path(self, name: str) -> str:
        """`name` inside the store, as its filesystem spells it."""
        return str(self.local / name) if self.local is not None else f"{self.root}/{name}"

    def display(self, name: str) -> str:
        """`name` as a user would write it: a local path, or the URI."""
        return self.path(name) if self.local is not None else f"{self.location}/{name}"

    def _info(self, name: str):
        return self.fs.get_file_info(self.path(name))

    def is_folder(self) -> bool:
        if self.local is not None:
            return self.local.is_dir()
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self.root).type == pafs.FileType.Directory

    def size(self, name: str) -> int | None:
        """Bytes of file `name`, or None if there is no such file."""
        if self.local is not None:
            path = self.local / name
            return path.stat().st_size if path.is_file() else None
        import pyarrow.fs as pafs

        info = self._info(name)
        return info.size if info.type == pafs.FileType.File else None

    def sizes(self, pattern: str = "*") -> dict[str, int]:
        """{name: bytes} of the files directly in the folder that match the glob `pattern`, sorted
        by name: one listing request in object storage."""
        if self.local is not None:
            found = (p for p in self.local.glob(pattern) if p.is_file())
            return {p.name: p.stat().st_size for p in sorted(found)}
        import pyarrow.fs as pafs

        listing = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        return {
            info.base_name: info.size
            for info in sorted(listing, key=lambda info: info.base_name)
            if info.type == pafs.FileType.File and fnmatch.fnmatchcase(info.base_name, pattern)
        }

    def names(self, pattern: str = "*") -> list[str]:
        """Names of the files directly in the folder that match the glob `pattern`, sorted."""
        return list(self.sizes(pattern))

    def read_bytes(self, name: str) -> bytes:
        if self.local is not None:
            return (self.local / name).read_bytes()
        with self.fs.open_input_stream(self.path(name)) as stream:
            return stream.read()

    def read_json(self, name: str) -> Any:
        return json.loads(self.read_bytes(name).decode("utf-8"))

    @contextlib.contextmanager
    def open_stream(self, name: str) -> Iterator[IO[bytes]]:
        """The file's bytes, streamed; FileNotFoundError if there is no such file."""
        if self.local is not None:
            with open(self.local / name, "rb") as handle:
                yield handle
            return
        if self.size(name) is None:
            raise FileNotFoundError(self.display(name))
        with self.fs.open_input_stream(self.path(name), buffer_size=_CHUNK) as stream:
            yield stream

    def sha256(self, name: str) -> str:
        if self.local is not None:
            return sha256_file(self.local / name)
        digest = hashlib.sha256()
        with self.open_stream(name) as stream:
            while chunk := stream.read(_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    def write_bytes(self, name: str, data: bytes) -> None:
        """Publish `data` as `name` atomically: readers see the old file, or all of the new one."""
        if self.local is not None:
            atomic_write_bytes(self.local / name, data)
            return
        # A stream publishes what it holds when it closes, and it closes even where the write
        # inside it failed or was interrupted (apache/arrow#40502): the bytes go to a temporary
        # object, and only a complete one is copied into place, by one request to the server. A
        # copy, not a move: S3's move is this copy and the delete below, and some of Arrow's
        # stores (Azure's, in some versions) copy but cannot move.
        prefix, suffix = temporary_affixes(name)
        temporary = self.path(f"{prefix}{uuid.uuid4().hex}{suffix}")
        try:
            with self.fs.open_output_stream(temporary) as stream:
                stream.write(data)
            self.fs.copy_file(temporary, self.path(name))
        finally:
            with contextlib.suppress(OSError):  # else the next run's remove_temporaries does
                self.fs.delete_file(temporary)

    def write_json(self, name: str, obj: Any) -> None:
        if self.local is not None:
            atomic_write_json(self.local / name, obj)
            return
        self.write_bytes(name, json_text(obj).encode("utf-8"))

    def delete(self, name: str) -> None:
        """Remove `name` if it is there; one already gone (by another hand) is not an error."""
        if self.local is not None:
            (self.local / name).unlink(missing_ok=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                self.fs.delete_file(self.path(name))
