"""Reading a checkpoint's `state/` (torch.distributed.checkpoint) without running its code.

DCP's own reader unpickles `state/.metadata` with plain `pickle.load`, and each stored non-tensor
value (the optimizer's `lr`, `betas`, ...) with `torch.load(weights_only=False)`: a checkpoint
folder someone hands you could run any code on `--resume` or export, and the digests in its
COMPLETE marker do not stop that (a digest is no signature: whoever crafts the file records its
digest too). Here the metadata goes through an unpickler that builds only the classes DCP writes
there, and each stored value through `torch.load(weights_only=True)`, as the tensors already are.
Anything else is refused by file name, before any of it is used.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from pipeline.errors import CacheError

METADATA = ".metadata"
# Every global DCP's metadata pickle names (torch 2.13; single-process, DDP and FSDP saves), and
# besides these the dtypes (`torch.float32`, ...).
METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # a layout from its name
    ("torch", "Size"),
    ("pathlib", "PosixPath"),  # the folder it was saved to, as a path
}
CODE = "objects other than the ones a checkpoint holds, which could run code when loaded"


class _NotAllowed(pickle.UnpicklingError):
    """A global the metadata may not name."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = (module, name) in METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise _NotAllowed(f"{module}.{name}")
        return super().find_class(module, name)


def read_state_metadata(state: Path) -> Metadata:
    """`state/.metadata`, built only from DCP's own classes; CacheError naming the file for
    anything else (code, damage), or for a data file outside `state/`."""
    path = Path(state) / METADATA
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except _NotAllowed as exc:
        raise CacheError(f"{path} holds {CODE} ({exc}): refusing it unloaded") from None
    except OSError:
        raise
    except Exception as exc:  # a damaged pickle raises whatever its bytes lead to
        raise CacheError(f"{path} is not a checkpoint's metadata ({exc})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CacheError(f"{path} is not a checkpoint's metadata (a {type(metadata).__name__})")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CacheError(f"{path} names a data file outside its folder ({name!r})")
    return metadata


class _Reader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_state_metadata(Path(self.path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _Planner(DefaultLoadPlanner):
    """DefaultLoadPlanner, but a stored value is read as tensors and plain data only."""

    def __init__(self, state: Path):
        super().__init__()
        self.folder = Path(state)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            stored = self.metadata.storage_data[read_item.storage_index].relative_path
            raise CacheError(
                f"{self.folder / stored} holds {CODE} (at {read_item.dest_index.fqn}): "
                "refusing it unloaded"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_state(state_dict: dict, state: Path, *, no_dist: bool) -> None:
    """dcp.load of `state_dict` from the folder `state`, running no code stored there. Every rank
    reads the metadata first, so a refusal is one line on each rather than DCP's traceback."""
    import torch.distributed.checkpoint as dcp

    read_state_metadata(state)
    try:
        dcp.load(
            state_dict, storage_reader=_Reader(state), planner=_Planner(state), no_dist=no_dist
        )
    except CheckpointException as exc:  # a BaseException carrying each rank's error
        ours = [error for error, _ in exc.failures.values() if isinstance(error, CacheError)]
        if ours:
            raise ours[0] from None
        first = next(iter(exc.failures.values()))[0]
        raise CacheError(f"{state} cannot be loaded: {first}") from None

