"""A real S3-compatible server for the object-storage tests and benchmark: moto's standalone
server (`moto[server]`) on a localhost port of its own, with the standard AWS environment variables
pointing this process, and every process it starts (Ray workers, stage 2), at it.

moto keeps its S3 state in one global per process, outliving a stopped server: each server gets a
bucket of its own, so what one test module left behind is never in the next one's bucket."""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from pipeline.storage import Store

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def moto_s3() -> Iterator[str]:
    """Start the server and create a new, empty bucket; yields `s3://bucket`. Set this up before
    Ray starts: Ray's workers take their environment from the process that started the cluster."""
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    bucket = f"vocagno-{uuid.uuid4().hex}"
    # Port 0: the server binds a port the system picks and keeps it (no probe-then-bind race).
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    endpoint = f"http://127.0.0.1:{port}"
    settings = CREDENTIALS | {"AWS_ENDPOINT_URL": endpoint}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        pafs.S3FileSystem(
            endpoint_override=endpoint, allow_bucket_creation=True, region="us-east-1"
        ).create_dir(bucket)
        yield f"s3://{bucket}"
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def objects_under(uri: str) -> list[str]:
    """Every object under the prefix `uri`, at any depth (a corpus is read that way)."""
    import pyarrow.fs as pafs

    store = Store(uri)
    listing = store.fs.get_file_info(
        pafs.FileSelector(store.root, recursive=True, allow_not_found=True)
    )
    return sorted(info.path for info in listing if info.type == pafs.FileType.File)


def upload_folder(folder: Path, uri: str) -> None:
    """Copy every file directly in `folder` to the prefix `uri`, which must hold nothing yet."""
    assert objects_under(uri) == [], f"{uri} is not empty"
    store = Store(uri)
    for path in sorted(Path(folder).iterdir()):
        if path.is_file():
            store.write_bytes(path.name, path.read_bytes())


def download_all(uri: str) -> dict[str, bytes]:
    """Every object directly under the prefix `uri`, by name."""
    store = Store(uri)
    return {name: store.read_bytes(name) for name in store.names()}
