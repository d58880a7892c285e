"""Read a DCP checkpoint without running code from it: DCP's own ``FileSystemReader`` unpickles ``.metadata`` with
plain ``pickle`` and its ``DefaultLoadPlanner`` loads every non-tensor entry (the optimizer's ``param_groups``) with
``torch.load(weights_only=False)``, so a run directory copied from someone else, with a ``COMPLETE`` marker whose
sha256s match the planted files, ran their code on ``dsedge train`` resume.

``CheckedReader`` unpickles ``.metadata`` with an unpickler that resolves only the classes DCP's metadata holds
(its dataclasses, ``torch.Size``, dtypes, the strided layout, paths; see ``_METADATA_GLOBALS``) and checks that every
shard it names is a file of the checkpoint folder itself; ``CheckedPlanner`` loads the non-tensor entries with
``torch.load(weights_only=True)``. Anything else raises ``UnsafeCheckpoint`` (a BaseException: DCP's reader catches
``Exception`` and then retries with per-rank metadata, logging a traceback), which DCP wraps in its
CheckpointException; ``unsafe_reason`` finds it there.
"""
from __future__ import annotations

import io
import pickle
import re
from pathlib import PurePath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# (module, name) a .metadata written by DCP's FileSystemWriter refers to (torch 2.4 - 2.13); constructing any of them
# runs no code of the file's choosing
_METADATA_GLOBALS = {
    *((_DCP_METADATA, n) for n in ("Metadata", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                                   "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex",
                                   "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"),
    *((m, n) for m in ("pathlib", "pathlib._local") for n in ("PosixPath", "WindowsPath", "PurePosixPath",
                                                              "PureWindowsPath")),
}
_WEIGHTS_ONLY_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")


class UnsafeCheckpoint(BaseException):
    """A checkpoint file that would run code (or read files outside the checkpoint) when loaded; ``str`` says why."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f".metadata references {module}.{name}, not allowed")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(".metadata holds a persistent id, not allowed")


def read_metadata(f: io.BufferedIOBase) -> Metadata:
    """DCP ``Metadata`` from an open ``.metadata`` file, resolving only ``_METADATA_GLOBALS``.

    Raises:
        UnsafeCheckpoint: another global; not a Metadata; a shard outside the folder or with storage transforms.
        pickle.UnpicklingError, EOFError, ...: a damaged file (the caller skips the checkpoint).
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md = _MetadataUnpickler(f).load()
    if not isinstance(md, Metadata):
        raise UnsafeCheckpoint(f".metadata holds a {type(md).__name__}, not DCP Metadata")
    storage = md.storage_data
    if not isinstance(storage, dict) or not all(isinstance(v, _StorageInfo) for v in storage.values()):
        raise UnsafeCheckpoint(".metadata's storage_data is not DCP's file table, not allowed")
    for info in storage.values():
        name = info.relative_path
        if not isinstance(name, str) or name in ("", ".", "..") or PurePath(name).name != name or "\\" in name:
            raise UnsafeCheckpoint(f".metadata names shard file {name!r} outside the checkpoint, not allowed")
        if info.transform_descriptors:  # dsedge writes none; they pick torch's stream extensions by name
            raise UnsafeCheckpoint(f".metadata asks for storage transforms {list(info.transform_descriptors)!r}, "
                                   "which dsedge never writes, not allowed")
    return md


class CheckedReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through ``read_metadata``; no per-rank metadata (dsedge writes
    one ``.metadata``). Otherwise as torch 2.13's: the ``storage_meta.load_id`` of this load is set."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("dsedge checkpoints hold one global .metadata, no per-rank metadata")
        with open(PurePath(self.path) / ".metadata", "rb") as f:
            md = read_metadata(f)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class CheckedPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor entries with ``torch.load(weights_only=True)``: plain Python
    values (numbers, strings, tuples, lists, dicts) and tensors, nothing that runs code."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            what = _WEIGHTS_ONLY_GLOBAL.search(str(e))
            raise UnsafeCheckpoint(f"the shard entry {fqn} references {what.group(1) if what else 'code'}, "
                                   "not allowed") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def unsafe_reason(err: BaseException) -> str | None:
    """Why ``err`` (an UnsafeCheckpoint, or DCP's CheckpointException holding one on some rank) refused a file."""
    if isinstance(err, UnsafeCheckpoint):
        return str(err)
    for exc, _trace in (getattr(err, "failures", None) or {}).values():
        if isinstance(exc, UnsafeCheckpoint):
            return str(exc)
    return None
