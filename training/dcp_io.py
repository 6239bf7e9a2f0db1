"""The storage side of meshtron checkpoints inside `torch.distributed.checkpoint` (DCP): the
writer that checksums every file as it is written, the reader that verifies the files a rank's
load plan reads, and the planners that store `ShardPiece`s as chunks of their global tensors.

Imported only when a checkpoint is written or read (training/checkpoint.py imports it inside
those functions): importing DCP costs about 0.7 s per process (its DTensor operators), which a
run that never checkpoints, every rank of it, would otherwise pay at start. Decision: the
classes that subclass DCP's live here together, the layout logic of the pieces stays in
training/sharded_state.py and the folder logic in training/checkpoint_files.py, neither
importing DCP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from meshtron.training.checkpoint_files import check_file_crc
from meshtron.training.sharded_state import ShardPiece

# `dcp` and `CheckpointException` too: training/checkpoint.py reaches DCP only through this module.
__all__ = [
    "CheckpointException",
    "ChecksummedFile",
    "ChecksummingFileSystem",
    "ChecksummingWriter",
    "ShardLoadPlanner",
    "ShardSavePlanner",
    "VerifyingReader",
    "WRITE_DELAY_ENV",
    "chunk_of",
    "dcp",
]

WRITE_DELAY_ENV = "MESHTRON_TEST_CHECKPOINT_WRITE_DELAY_S"  # test hook: seconds before each file's first write

# ---------------------------------------------------------------------------- writing


class ChecksummedFile:
    """A binary file being written that keeps the CRC32 and byte count of what went into
    it; an OSError from the file is re-raised naming its path and reported to `on_error`."""

    def __init__(self, file, path: Path, on_error):
        self._file, self.path, self._on_error = file, path, on_error
        self.crc, self.size = 0, 0

    def write(self, data) -> int:
        if self.size == 0 and os.environ.get(WRITE_DELAY_ENV):  # tests: a writer slow enough to interrupt
            time.sleep(float(os.environ[WRITE_DELAY_ENV]))
        written = self._io(self._file.write, data)
        self.crc = zlib.crc32(memoryview(data).cast("B")[:written], self.crc)
        self.size += written
        return written

    def tell(self) -> int:
        return self._file.tell()

    def fileno(self) -> int:
        return self._file.fileno()

    def flush(self) -> None:
        self._io(self._file.flush)

    def close(self) -> None:
        self._io(self._file.close)

    def _io(self, call, *args):
        try:
            return call(*args)
        except OSError as err:
            named = OSError(err.errno, err.strerror, str(self.path))
            self._on_error(named)
            raise named from err


class ChecksummingFileSystem(FileSystem):
    """DCP's local filesystem, recording {file name: (crc32, bytes)} of every file written
    through it (`.metadata` under its final name after DCP's rename from `.metadata.tmp`) and
    the first OSError of a write."""

    def __init__(self):
        super().__init__()
        self.sums: dict[str, tuple[int, int]] = {}
        self.write_error: OSError | None = None

    def _record_error(self, err: OSError) -> None:
        self.write_error = self.write_error or err

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        try:
            file = path.open("wb")
        except OSError as err:
            raise OSError(err.errno, err.strerror, str(path)) from err
        stream = ChecksummedFile(file, path, self._record_error)
        try:
            yield stream
        finally:
            stream.close()
        self.sums[path.name] = (stream.crc, stream.size)

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        self.sums[Path(new_path).name] = self.sums.pop(Path(path).name)


class ChecksummingWriter(FileSystemWriter):
    """DCP's FileSystemWriter through a `ChecksummingFileSystem` (`fs.sums`: this rank's file
    checksums). torch.save hides a failed write behind its own RuntimeError ('unexpected pos'
    from closing the zip container): the write's OSError, naming the file, is raised instead."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.fs = ChecksummingFileSystem()

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except RuntimeError:
            if self.fs.write_error is None:
                raise
            raise self.fs.write_error from None


# ---------------------------------------------------------------------------- reading


class VerifyingReader(FileSystemReader):
    """DCP's file reader that first checks the CRC32 of every file this rank's load plan reads
    against `files` (the manifest's {name: {"bytes", "crc32"}}), raising CheckpointError naming
    the first corrupt one before reading any. `verified`: the names checked, in order."""

    def __init__(self, path: str | Path, files: dict):
        super().__init__(path)
        self.files = files
        self.verified: list[str] = []

    def read_data(self, plan, planner):
        names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        for name in names:
            if name in self.files:
                check_file_crc(Path(self.path), name, self.files[name])
                self.verified.append(name)
        return super().read_data(plan, planner)


# --------------------------------------------------------------------------- planners


def chunk_of(piece: ShardPiece) -> ChunkStorageMetadata:
    """DCP's description of `piece`: its offsets in the global tensor and its local shape."""
    return ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.local.shape)


def _as_pieces(value) -> list[ShardPiece] | None:
    if isinstance(value, ShardPiece):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, ShardPiece) for v in value):
        return value
    return None


class ShardSavePlanner(DefaultSavePlanner):
    """DCP save planner that writes `ShardPiece` values (or lists of pieces of one tensor) as
    chunks of their global tensor."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self._pieces = {k: p for k, v in state_dict.items() if (p := _as_pieces(v)) is not None}
        self._by_index = {MetadataIndex(k, torch.Size(p.offsets)): p for k, ps in self._pieces.items() for p in ps}
        plain = {
            k: (self._pieces[k][0].local if k in self._pieces else v)
            for k, v in state_dict.items()
            if k in self._pieces or not isinstance(v, list) or v
        }
        super().set_up_planner(plain, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            for piece in self._pieces.get(item.index.fqn, [None]):
                if piece is not None:
                    offsets = torch.Size(piece.offsets)
                    tensor_data = dataclasses.replace(
                        item.tensor_data, chunk=chunk_of(piece), size=torch.Size(piece.global_shape)
                    )
                    item = dataclasses.replace(
                        item,
                        index=MetadataIndex(item.index.fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=tensor_data,
                    )
                items.append(item)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        if index.fqn in self._pieces:
            return self._by_index[MetadataIndex(index.fqn, index.offset)].local
        return super().lookup_object(index)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DCP load planner that fills `ShardPiece` values with their block of the global tensor
    (reading it from however the checkpoint was split). Shapes are checked beforehand by the
    caller (a mismatch is reported by name there)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self._pieces = {k: v for k, v in state_dict.items() if isinstance(v, ShardPiece)}
        self._caller_state = state_dict
        plain = {k: v for k, v in state_dict.items() if not isinstance(v, ShardPiece)}
        super().set_up_planner(plain, metadata, is_coordinator)

    def load_bytes(self, read_item, value) -> None:
        """Non-tensor values are handed back in the caller's dict (not a private copy)."""
        super().load_bytes(read_item, value)
        fqn = read_item.dest_index.fqn
        self._caller_state[fqn] = self.state_dict[fqn]

    def create_local_plan(self) -> LoadPlan:
        plan = create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        items = list(plan.items)
        for fqn, piece in self._pieces.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise KeyError(f"tensor {fqn} is missing from the checkpoint")
            if tuple(md.size) != tuple(piece.global_shape):
                raise ValueError(f"tensor {fqn}: checkpoint shape {tuple(md.size)} != expected {piece.global_shape}")
            items += create_read_items_for_chunk_list(fqn, md, [chunk_of(piece)])
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self._pieces:
            return self._pieces[index.fqn].local
        return super().lookup_tensor(index)
