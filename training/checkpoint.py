"""Distributed checkpoints: atomic save, checksums, one writer per folder, discovery,
validation and resharding load.

A checkpoint is a folder `<checkpoint.dir>/step_<8 digits>/` holding DCP files (one per
rank plus `.metadata`, written by `torch.distributed.checkpoint`) and `meshtron.json`, the
manifest (format, step, data position, counters, the model config and the layout it was
saved under, and every file's size and CRC32). Every tensor is stored under its global,
layout-free shape (see `training.sharded_state`), so a checkpoint loads under any
tp/pp/ep/etp/dp/zero.

What is saved: model parameters and persistent buffers (e.g. the MoE routers' expert bias),
AdamW moments per parameter and the step count, the per-rank RNG states (restored only under
the same world size and layout; others reseed), and the loop counters in `TrainState`. The
learning rate is a pure function of the step and the config. ZeRO-1/2 (and offloaded)
moments are saved without gathering: each rank writes its shard of every bucket as the boxes
of the global moment tensors it covers (`training.sharded_state.flat_range_pieces`), under the same
names and global shapes as unsharded moments, so the optimizer layout does not matter either:
a load reads each rank's local moments from whichever boxes overlap them.

Asynchronous saves (`checkpoint.async=true`, `AsyncCheckpointer`): the state is copied to host
memory on the training thread, then written by a background thread with the very same code
(`_write_checkpoint`), so atomicity, checksums, the manifest and `keep` are unchanged; one
save in flight, the next save (and the end of the run, SIGTERM, an error) waits for it.
Decision: our own thread rather than DCP's `async_save`. `async_save` (torch 2.13) also runs
`dcp.save` in a thread over a given process group, but its stager copies plain state dicts
(not our `ShardPiece`s) and it stops at the DCP files, while a meshtron checkpoint is only
complete after the checksum gather, rank 0's manifest, the rename and `keep`: those need
collectives too, in the same thread, after the write. That thread talks only over a gloo
group of all ranks created at startup for checkpoint coordination (`new_checkpoint_group`),
never over the groups training uses concurrently. A background failure is kept and raised
by the next `wait` (the next save or the end of the run) as the same CheckpointError on every
rank. A process killed mid-write leaves only `.tmp-step_N/`, which is never valid.

Atomicity: ranks write into `.tmp-step_N/`; rank 0 writes `meshtron.json` last and then
renames the folder to `step_N`. A folder is a valid checkpoint only if its name is
`step_N`, it holds `meshtron.json` and every file has the size recorded there, so a crash
mid-save (or a truncated file) never looks valid. After a new checkpoint is complete, the
ones older than it beyond `checkpoint.keep` are removed (`meshtron.json` first, so a
half-deleted folder is invalid too); later steps (left by an earlier run, perhaps corrupt)
are kept until this run saves the same step over them.

Checksums: zlib's CRC32 of every file, computed while DCP writes it: the writer's file
streams hash each buffer on its way to the file (`_ChecksummingFileSystem`), so no byte is
read back. CRC32 is the fastest whole-buffer check in the standard library (about 3 GB/s
on one core, over 2x blake2b) and catches all accidental damage (overwritten blocks,
truncation, another run's file of the same size) but is no defence against deliberate
tampering. Ranks send their files' sums to rank 0, which records them in `meshtron.json`,
written last and published by the rename with the folder. Verification on load is in
training/checkpoint_files.py: before any process group every rank checks only the sizes and the
DCP metadata; each rank then verifies the CRC32 of exactly the files its own load plan reads
(`VerifyingReader`, inside `dcp.load`), DCP gathers a failure to every rank, and all raise the
same CheckpointError, so `resume=auto` falls back to the previous checkpoint in lockstep
(`load_newest_intact`). Checkpoints of format version 1 (sizes only) still load, with the size
check alone.

Same model: the manifest records the model config it was saved for. `check_compatible`
compares it with the run's before any process group: first every tensor's name and global
shape, then the fields themselves, since same shapes do not make the same model (hidden 64
splits into 4 or 8 heads with every weight the same shape). A resume may change only
`RESUME_MAY_CHANGE` (dropout, init_std, the MoE and MTP loss weights); `checkpoint.init_from` (weights
only, for fine-tuning) only needs `WEIGHT_READING_FIELDS` (heads, norm, activation,
positions) to match. A mismatch is one line naming the fields, saved and configured.

One writer per folder: `hold_checkpoint_dir` takes `<checkpoint.dir>/.meshtron.lock`,
created with O_EXCL and holding pid, host, the process's kernel start time and the wall
time. It is taken by global rank 0 only, before any training step, and its outcome is
broadcast so every rank stops with the same CheckpointError instead of hanging in a later
collective. Creating the lock is also the writability probe (checkpoint.dir created if
needed, a file written and fsynced there) that rank 0 makes for all ranks (checkpoints need
a filesystem shared by all ranks). A lock whose pid is dead on this host (or alive but with
another start time: a reused pid) is stale and taken over with a warning; a pid `kill(pid, 0)`
may not signal (PermissionError: another user's process) is alive; a lock held on
another host cannot be checked from here and is refused with the command that removes it.

Failures: OSError during a save or load (disk full, file-size limit, permissions) and
torch's `CheckpointException` (a BaseException) carrying one become `CheckpointError`
naming the file and the cause (the entry prints one line and exits 2); other failures
inside DCP are programming errors and keep their traceback. A failed save leaves the
previous checkpoints as they were and removes its partial `.tmp-step_N/`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import json
import os
import shutil
import socket
import sys
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from meshtron.dp import zero3
from meshtron.dp.adamw import TrainingOptimizer
from meshtron.dp.param_gather import finish_param_gather
from meshtron.mpu.mappings import broadcast_object, gather_object, world_group
from meshtron.mpu.mesh import group_rank, single_process_mesh
from meshtron.mpu.random import get_rng_tracker
from meshtron.training.checkpoint_files import (
    FORMAT,
    META_FILE,
    STEP_DIR,
    CheckpointError,
    VerifyingReader,
    checkpoint_error_in,
    describe_os_error,
    list_checkpoints,
    read_meta,
    step_folders,
)
from meshtron.training.sharded_state import (
    ShardLoadPlanner,
    ShardPiece,
    ShardSavePlanner,
    flat_range_pieces,
    global_shape,
    shard_piece,
)

VERSION = 2  # 2: files carry {"bytes", "crc32"}; 1: sizes only (still read)
LOCK_FILE = ".meshtron.lock"
WRITE_DELAY_ENV = "MESHTRON_TEST_CHECKPOINT_WRITE_DELAY_S"  # test hook: seconds before each file's first write
_SINGLE_PROCESS_WARNING = ".*assuming the intent is to .* in a single process.*"
# DCP warns that it assumes a single process when no group is initialised: intended here. A
# background save cannot use `warnings.catch_warnings` (not thread-safe), hence a filter for
# that one message, process-wide.
warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)


@dataclass
class TrainState:
    """Loop counters restored on resume (the data position is `consumed_samples`)."""

    step: int = 0
    consumed_samples: int = 0
    skipped_total: int = 0
    skipped_in_a_row: int = 0
    loss_scale: float | None = None  # fp16's dynamic loss scale and its clean-step count
    loss_scale_good_steps: int = 0


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def _is_main() -> bool:
    return group_rank(world_group()) == 0


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- what goes into a checkpoint


def _own_parameters(chunks: list[nn.Module]):
    """(name, param) of this rank's chunks; tied-embedding copies are not saved (the first
    stage's embedding is) but are loaded from the same key."""
    for chunk in chunks:
        yield from chunk.named_parameters()


def _persistent_buffers(chunks: list[nn.Module]):
    for chunk in chunks:
        persistent = set(chunk.state_dict().keys())
        for name, buf in chunk.named_buffers():
            if name in persistent:
                yield name, buf


def model_state(chunks: list[nn.Module], mesh, *, for_load: bool = False) -> dict:
    """`model/<name>` -> ShardPiece (parameters) or tensor (replicated buffers)."""
    state = {}
    for name, param in _own_parameters(chunks):
        if getattr(param, "tied_embedding_copy", False) and not for_load:
            continue
        piece = shard_piece(param, param.data, mesh)
        if piece is not None:
            state[f"model/{name}"] = piece
    for name, buf in _persistent_buffers(chunks):
        state[f"model/{name}"] = buf
    return state


def optimizer_state(
    chunks: list[nn.Module], optimizer: TrainingOptimizer, mesh, *, for_load: bool = False
) -> tuple[dict, dict]:
    """`optim/<name>/exp_avg|exp_avg_sq` -> ShardPiece (or a list of pieces) and `optim/step`.

    Saving: an optimizer with `moment_shards` (ZeRO-1/2, offload) gives this rank's slice of
    every parameter's moments, saved as the boxes of the global tensor it covers
    (`training.sharded_state.flat_range_pieces`): nothing is gathered, each rank writes its shards.
    Others (replicated AdamW) give full per-parameter moments (`param_moments`). For loading,
    fresh zero tensors shaped like the local parameters are returned (filled by DCP from
    whichever boxes were saved, then installed with `load_param_moments`). Also returns the
    {param: (exp_avg, exp_avg_sq)} the pieces view (empty when saving shards)."""
    keys = ("exp_avg", "exp_avg_sq")
    if for_load:  # an offloaded optimizer keeps its moments on the host: read them there
        device = "cpu" if optimizer.offloaded else None
        # fp32 even for bf16 resident parameters (dp/resident.py): moments are fp32 state
        moments = {
            p: (
                torch.zeros_like(p, device=device, dtype=torch.float32),
                torch.zeros_like(p, device=device, dtype=torch.float32),
            )
            for _, p in _own_parameters(chunks)
        }
        step = 0.0
    elif hasattr(optimizer, "moment_shards"):
        names = {p: name for name, p in _own_parameters(chunks) if not getattr(p, "tied_embedding_copy", False)}
        shards, step = optimizer.moment_shards()
        state = {"optim/step": torch.tensor(step, dtype=torch.float64)}
        for param, first, tensors in shards:
            if param not in names:
                continue
            for key, tensor in zip(keys, tensors):
                pieces = flat_range_pieces(param, first, tensor, mesh)
                if pieces:
                    state.setdefault(f"optim/{names[param]}/{key}", []).extend(pieces)
        return state, {}
    else:
        moments, step = optimizer.param_moments()
    state = {"optim/step": torch.tensor(step, dtype=torch.float64)}
    for name, param in _own_parameters(chunks):
        if getattr(param, "tied_embedding_copy", False) and not for_load:
            continue
        for key, tensor in zip(keys, moments[param]):
            piece = shard_piece(param, tensor, mesh)
            if piece is not None:
                state[f"optim/{name}/{key}"] = piece
    return state, moments


def _rng_bytes() -> bytes:
    state = {
        "cpu": torch.get_rng_state(),
        "tracker": get_rng_tracker().get_states(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _restore_rng(blob: bytes) -> None:
    state = torch.load(io.BytesIO(blob), weights_only=False)
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_rng_tracker().set_states(state["tracker"])


# ---------------------------------------------------------------------------------- save


class _ChecksummedFile:
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


class _ChecksummingFileSystem(FileSystem):
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
        stream = _ChecksummedFile(file, path, self._record_error)
        try:
            yield stream
        finally:
            stream.close()
        self.sums[path.name] = (stream.crc, stream.size)

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        self.sums[Path(new_path).name] = self.sums.pop(Path(path).name)


class _ChecksummingWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter through a `_ChecksummingFileSystem` (`fs.sums`: this rank's file
    checksums). torch.save hides a failed write behind its own RuntimeError ('unexpected pos'
    from closing the zip container): the write's OSError, naming the file, is raised instead."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.fs = _ChecksummingFileSystem()

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except RuntimeError:
            if self.fs.write_error is None:
                raise
            raise self.fs.write_error from None


def _os_error_in(err: CheckpointException) -> str | None:
    """'rank R: <file>: <cause>' of the first rank whose DCP step failed with an OSError, or None
    when the failures are not I/O errors (programming errors: they keep their traceback)."""
    for rank, (failure, _) in sorted(err.failures.items()):
        if isinstance(failure, OSError):
            return f"rank {rank}: {describe_os_error(failure)}"
    return None


def _on_main_agreed(action, what: str, group="world") -> None:
    """Run `action` on global rank 0 and broadcast its outcome over `group` (the world group by
    default); an OSError or CheckpointError there becomes the same CheckpointError ('<what>:
    <file>: <cause>') on every rank."""
    group = world_group() if group == "world" else group
    error = None
    if _is_main():
        try:
            action()
        except OSError as err:
            error = f"{what}: {describe_os_error(err)}"
        except CheckpointError as err:
            error = f"{what}: {err}"
    error = broadcast_object(error, group)
    if error is not None:
        raise CheckpointError(error)


def main_weight_state(chunks: list[nn.Module], optimizer: TrainingOptimizer, mesh) -> dict:
    """16-bit resident weights (dp/resident.py): `model/<name>` -> this rank's pieces of the fp32
    main weights, replacing the bf16 parameters, so the checkpoint holds what an fp32 run
    saves. Empty for other optimizers. No communication."""
    if not hasattr(optimizer, "main_weight_shards"):
        return {}
    names = {p: name for name, p in _own_parameters(chunks) if not getattr(p, "tied_embedding_copy", False)}
    state = {f"model/{name}": [] for name in names.values()}
    for param, first, values in optimizer.main_weight_shards():
        if param in names:
            state[f"model/{names[param]}"] += flat_range_pieces(param, first, values, mesh)
    return state


def checkpoint_state(chunks: list[nn.Module], optimizer: TrainingOptimizer | None, mesh) -> dict:
    """What a checkpoint of this rank holds: `model/...` and `optim/...` pieces viewing the live
    tensors (no copies), `optim/step` and this rank's RNG states as bytes. With ZeRO the
    moments are this rank's shards (no communication)."""
    state = model_state(chunks, mesh)
    if optimizer is not None:
        for key, pieces in main_weight_state(chunks, optimizer, mesh).items():
            if pieces:
                state[key] = pieces
            else:  # this rank holds none of the parameter's main weights
                state.pop(key, None)
        state.update(optimizer_state(chunks, optimizer, mesh)[0])
        state[f"rng/rank{mesh.rank}"] = _rng_bytes()
    return state


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)
    return out.copy_(tensor.detach(), non_blocking=tensor.is_cuda)


def stage_to_host(state: dict) -> dict:
    """A copy of `state` in host memory that later training steps do not change: every tensor
    (piece) copied to the CPU (pinned, from CUDA, then synchronised); bytes as they are."""

    def copy(value):
        if isinstance(value, ShardPiece):
            return dataclasses.replace(value, local=_host_copy(value.local))
        if isinstance(value, list):
            return [copy(v) for v in value]
        if torch.is_tensor(value):
            return _host_copy(value)
        return value

    staged = {key: copy(value) for key, value in state.items()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the non-blocking copies have landed before anyone reads them
    return staged


def save_checkpoint(
    root: str | Path,
    train_state: TrainState,
    chunks: list[nn.Module],
    optimizer: TrainingOptimizer | None,
    mesh,
    *,
    model_config: dict,
    keep: int | None = None,
) -> Path:
    """Save everything needed to resume at `train_state.step` into `root/step_N`, atomically,
    with every file's CRC32 in its manifest; then remove checkpoints older than it beyond the
    newest `keep`. `optimizer=None` saves weights only (usable with `checkpoint.init_from`, not
    for resuming). Collective over the default group. An I/O failure raises CheckpointError on
    every rank naming the file and the cause; earlier checkpoints are untouched."""
    finish_param_gather(chunks)  # ZeRO-1/2 overlapped gathers of the last update: done before reading
    with zero3.gathered(chunks):  # ZeRO-3: the full local parameters while they are written
        state = checkpoint_state(chunks, optimizer, mesh)
        return _write_checkpoint(
            Path(root),
            state,
            train_state,
            mesh,
            weights_only=optimizer is None,
            model_config=model_config,
            keep=keep,
            group="world",
        )


def _manifest(sums: dict, train_state: TrainState, mesh, *, weights_only: bool, model_config: dict) -> dict:
    """The checkpoint's meta.json: format, train state, layout, model config and every file's
    size and CRC32 (`sums`: file -> (crc, size), from every rank)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "train_state": dataclasses.asdict(train_state),
        "weights_only": weights_only,
        "world_size": mesh.world_size,
        "layout": dataclasses.asdict(mesh.par),
        "model": model_config,
        "files": {file: {"bytes": size, "crc32": f"{crc:08x}"} for file, (crc, size) in sorted(sums.items())},
    }


def _publish(root: Path, tmp: Path, final: Path, meta: dict) -> None:
    """Rank 0: check `tmp` holds exactly this save's files, write the manifest last, then
    rename `tmp` to `final` (replacing a checkpoint of the same step). No communication."""
    on_disk = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
    if on_disk != {file: entry["bytes"] for file, entry in meta["files"].items()}:
        raise CheckpointError(
            f"{tmp} holds files {sorted(on_disk)} but this save wrote {sorted(meta['files'])} "
            f"(another run writing into {root}?)"
        )
    _write_json_durably(tmp / META_FILE, meta)
    if final.exists():  # the same step saved again (e.g. after a resume): replace it
        stale = root / f".stale-{final.name}"
        shutil.rmtree(stale, ignore_errors=True)
        (final / META_FILE).unlink(missing_ok=True)
        final.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp.rename(final)
    _fsync_dir(root)


def _remove_older(root: Path, step: int, keep: int) -> None:
    """Rank 0: remove the checkpoints older than `step` beyond the newest `keep` (counting it),
    and every incomplete `step_N` folder older than `step` (a file missing or truncated, no
    manifest: never loadable, and `resume=auto` would warn about it on every start)."""
    complete = [p for p in list_checkpoints(root) if _step_of(p) < step]
    incomplete = [p for p in step_folders(root) if _step_of(p) < step and p not in complete]
    for old in complete[: max(0, len(complete) - (keep - 1))] + incomplete:
        (old / META_FILE).unlink(missing_ok=True)
        shutil.rmtree(old, ignore_errors=True)


def _write_checkpoint(
    root: Path,
    state: dict,
    train_state: TrainState,
    mesh,
    *,
    weights_only: bool,
    model_config: dict,
    keep: int | None,
    group,
) -> Path:
    """Write `state` into `root/.tmp-step_N/` with DCP, publish it as `root/step_N` (rank 0:
    manifest last, then the rename) and apply `keep`. Collective over `group` ("world": the
    default group, as a synchronous save; else the checkpoint group of `AsyncCheckpointer`,
    None in a single process)."""
    name = step_dir_name(train_state.step)
    final, tmp = root / name, root / f".tmp-{name}"
    failed = f"could not save the checkpoint of step {train_state.step} (earlier checkpoints are intact)"
    coordination = world_group() if group == "world" else group

    def prepare() -> None:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)

    _on_main_agreed(prepare, failed, coordination)
    writer = _ChecksummingWriter(tmp)
    try:
        if group == "world":
            with _single_process_quiet():
                dcp.save(state, storage_writer=writer, planner=ShardSavePlanner(flatten_state_dict=False))
        else:  # a background thread: an explicit group; DCP's single-process warning is filtered for good below
            dcp.save(
                state,
                storage_writer=writer,
                planner=ShardSavePlanner(flatten_state_dict=False),
                process_group=group,
                no_dist=group is None,
            )
    except CheckpointException as err:
        cause = _os_error_in(err)
        if cause is None:
            raise
        if _is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{failed}: {cause}") from None
    sums_per_rank = gather_object(writer.fs.sums, coordination)

    def publish() -> None:
        sums = {file: entry for rank_sums in sums_per_rank for file, entry in rank_sums.items()}
        meta = _manifest(sums, train_state, mesh, weights_only=weights_only, model_config=model_config)
        _publish(root, tmp, final, meta)

    try:
        _on_main_agreed(publish, failed, coordination)
    except CheckpointError:
        if _is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        _on_main_agreed(
            lambda: _remove_older(root, train_state.step, keep),
            f"the checkpoint of step {train_state.step} is saved in {final}, but "
            f"removing the ones beyond checkpoint.keep={keep} failed",
            coordination,
        )
    return final


# ------------------------------------------------------------------------ asynchronous save


def new_checkpoint_group(timeout_s: float):
    """A gloo process group over the whole world for `AsyncCheckpointer` (None in a single
    process). Collective: every rank calls it at the same point, at startup."""
    if world_group() is None:
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


class AsyncCheckpointer:
    """Checkpoints written in a background thread while training goes on (checkpoint.async).

    `save` waits for the previous save (raising its error), copies this rank's state to host
    memory (`stage_to_host`, on the calling thread: later steps change the weights, not the
    copy), then writes and publishes it in a thread exactly as `save_checkpoint` does
    (`.tmp-step_N/`, checksums, rank 0's manifest last, the rename, then `keep`). At most one
    save is in flight. `wait` blocks until it is done and raises its failure as the
    CheckpointError a synchronous save would have raised; every rank raises the same one,
    since the ranks' threads agree on the outcome among themselves. Call `wait` (or `close`)
    before the process groups go.

    The thread communicates only over `group`, a gloo group of all ranks created at startup
    for checkpoint coordination (`new_checkpoint_group`): collectives of two threads on one
    process group could interleave, while separate groups have their own connections. It
    carries DCP's planning, the checksum gather and rank 0's outcome broadcasts."""

    def __init__(self, group) -> None:
        self.group = group
        self._thread: threading.Thread | None = None
        self._result: Path | BaseException | None = None

    def save(
        self,
        root: str | Path,
        train_state: TrainState,
        chunks: list[nn.Module],
        optimizer: TrainingOptimizer | None,
        mesh,
        *,
        model_config: dict,
        keep: int | None = None,
        on_done=None,
    ) -> None:
        """Wait for the previous save, stage this one to host memory and start writing it;
        `on_done(path)` runs in the writer thread once it is published."""
        self.wait()
        finish_param_gather(chunks)  # ZeRO-1/2 overlapped gathers of the last update: done before reading
        with zero3.gathered(chunks):  # ZeRO-3: the full local parameters while they are staged
            staged = stage_to_host(checkpoint_state(chunks, optimizer, mesh))
        train_state = dataclasses.replace(train_state)  # the loop goes on changing its own
        args = (Path(root), staged, train_state, mesh)
        kwargs = dict(weights_only=optimizer is None, model_config=model_config, keep=keep, group=self.group)

        def write() -> None:
            try:
                path = _write_checkpoint(*args, **kwargs)
                if on_done is not None:
                    on_done(path)
                self._result = path
            except BaseException as err:  # noqa: BLE001 (handed to the caller by wait)
                self._result = err

        self._result = None
        self._thread = threading.Thread(target=write, name=f"meshtron-checkpoint-{train_state.step}", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is written; its path, or None when there was
        none. Its failure is raised here (CheckpointError for I/O errors)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread, result = None, self._result
        self._result = None
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        """`wait`, reporting a failure on stderr instead of raising it (for cleanup paths where
        another error is already on its way)."""
        try:
            self.wait()
        except Exception as err:  # noqa: BLE001
            print(f"meshtron: checkpoint error: {err}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes a single process when no group is initialised: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process.*")
        yield


def _write_json_durably(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------- the model a checkpoint holds


def expected_model_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """`model/<name>` -> global shape for a model config (built on the meta device, no groups)."""
    from meshtron.models.gpt import GPT

    mesh = single_process_mesh()
    model = GPT(model_cfg, mesh, device="meta")
    shapes = {f"model/{n}": global_shape(p, mesh) for n, p in model.named_parameters()}
    shapes.update({f"model/{n}": tuple(b.shape) for n, b in _persistent_buffers([model])})
    return shapes


def read_full_tensors(path: str | Path, names: tuple[str, ...], shapes: dict) -> list[torch.Tensor]:
    """The full (unsharded, vocabulary unpadded) fp32 values of model parameters `names` saved
    in the checkpoint at `path`, whatever layout saved them (`shapes`: `expected_model_shapes`
    of its model): only those tensors are read. One process, no group (export reads a model one
    conversion unit at a time)."""
    state = {f"model/{n}": torch.empty(shapes[f"model/{n}"]) for n in names}
    with _single_process_quiet():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=ShardLoadPlanner(flatten_state_dict=False))
    return [state[f"model/{n}"] for n in names]


# Model fields a resumed run may set differently from its checkpoint: regularisation and the
# initialisation (which a resume never runs). Every other model field must match, shapes or
# not: the same tensors under another model.num_heads, num_kv_heads or kv_channels split into
# other heads; norm, activation, position, rope_theta, rope_scaling, norm_eps, qk_norm,
# sliding_window or the MoE routing fields compute another function of the same weights; the
# loss weights (aux_loss_coef, z_loss_coef, mtp_loss_weight) are another objective than the one
# the optimizer state was built on; and seq_len moves the data position (`consumed_samples`
# counts windows of seq_len + 1 tokens). To start a changed model from a checkpoint's weights,
# use checkpoint.init_from (no optimizer state, no data position).
# What a resume may change: regularization and the objective's weights, which change neither
# the function the weights compute nor the data position.
RESUME_MAY_CHANGE = frozenset(
    {
        "dropout",
        "attention_dropout",
        "init_std",
        "aux_loss_coef",
        "z_loss_coef",
        "router_bias_update_rate",
        "mtp_loss_weight",
    }
)
# What checkpoint.init_from (weights only, for fine-tuning: seq_len, RoPE scaling or the MoE
# loss weights may change) still needs to match: how the weights are read. The same shapes under
# another head split, norm, activation or position scheme are silently another model.
WEIGHT_READING_FIELDS = ("num_heads", "num_kv_heads", "kv_channels", "attention", "norm", "activation", "position")


def check_compatible(path: str | Path, model_cfg, *, resume: bool = True) -> dict:
    """Check that the checkpoint at `path` holds exactly the tensors (names and global shapes)
    the model needs and was saved for the same model (`resume`: every model field but
    RESUME_MAY_CHANGE; else, for checkpoint.init_from, the WEIGHT_READING_FIELDS), comparing
    the model config recorded in its manifest; returns its meta. Rank-independent: run it
    before any process group. A shape mismatch names the tensor (and the config fields that
    differ); same shapes under a different model name the fields, saved and configured."""
    path = Path(path)
    meta = read_meta(path)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 (any read error means the same thing here)
        raise CheckpointError(
            f"checkpoint {path}: cannot read the DCP metadata ({err}); the checkpoint is corrupt"
        ) from err
    saved = {
        k: tuple(v.size)
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model/") and hasattr(v, "size")
    }
    expected = expected_model_shapes(model_cfg)
    saved_model, current = meta.get("model", {}), dataclasses.asdict(model_cfg)
    differs = config_diff(saved_model, current)
    hint = f" (model config differs from the checkpoint's: {differs})" if differs else ""
    for key, shape in expected.items():
        if key not in saved:
            raise CheckpointError(f"checkpoint {path} has no tensor {key[6:]} that the model needs{hint}")
        if saved[key] != shape:
            raise CheckpointError(
                f"checkpoint {path}: tensor {key[6:]} has shape {list(saved[key])} but the model "
                f"needs {list(shape)}{hint}"
            )
    extra = sorted(set(saved) - set(expected))
    if extra:
        raise CheckpointError(f"checkpoint {path} holds tensor {extra[0][6:]} that the model does not have{hint}")
    fixed = [k for k in differing_model_fields(saved_model, current) if k not in RESUME_MAY_CHANGE]
    if not resume:
        fixed = [k for k in fixed if k in WEIGHT_READING_FIELDS]
    if fixed:
        raise CheckpointError(_another_model(path, fixed, saved_model, current, resume=resume))
    return meta


def _another_model(path: Path, fields: list[str], saved: dict, current: dict, *, resume: bool) -> str:
    """The one line refusing a checkpoint saved for another model with the same tensor shapes."""

    def settings(values: dict) -> str:
        return " ".join(f"model.{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in values.items())

    was, now = settings({k: saved[k] for k in fields}), settings({k: current[k] for k in fields})
    head = f"checkpoint {path} was saved with {was} but this run configures {now}: same tensor shapes, another model"
    if not resume:
        return f"{head}; set {was} (checkpoint.init_from needs {', '.join(WEIGHT_READING_FIELDS)} to match)"
    tail = f"; resume with {was} (a resume may change only model.{', model.'.join(sorted(RESUME_MAY_CHANGE))})"
    if not set(fields) & set(WEIGHT_READING_FIELDS):
        tail += f", or start a new run from its weights with checkpoint.init_from={path}"
    return head + tail


def differing_model_fields(saved: dict, current: dict) -> list[str]:
    """The model fields, sorted, whose values differ between a checkpoint's recorded model
    config `saved` and `current` (both `dataclasses.asdict` of a GPTConfig; compared as JSON,
    the manifest's form: a tuple equals its list). Keys only one side has (fields added later,
    or run settings older checkpoints saved with the model: recompute, kernel_backend) are
    never a difference."""
    as_saved = json.loads(json.dumps(current, default=str))
    return [k for k in sorted(current) if k in saved and saved[k] != as_saved[k]]


def config_diff(saved: dict, current: dict) -> str:
    """'field saved -> current, ...' of `differing_model_fields`; '' when none differ."""
    return ", ".join(f"{k} {saved[k]!r} -> {current[k]!r}" for k in differing_model_fields(saved, current))


# ---------------------------------------------------------------- one writer per checkpoint.dir


@contextlib.contextmanager
def hold_checkpoint_dir(root: str | Path | None):
    """Hold `root/.meshtron.lock` while the block runs (nothing when `root` is None). Collective
    over the world group: global rank 0 creates `root`, takes the lock (proving `root`
    writable) and broadcasts the outcome, so every rank raises the same CheckpointError when
    another run holds it or the folder cannot be written. A stale lock is taken over with a
    warning. Rank 0 removes the lock when the block ends, if it is still its own."""
    if root is None:
        yield
        return
    lock = Path(root) / LOCK_FILE
    record, error = None, None
    if _is_main():
        try:
            record = _take_lock(lock)
        except CheckpointError as err:
            error = str(err)
    error = broadcast_object(error, world_group())
    if error is not None:
        raise CheckpointError(error)
    try:
        yield
    finally:
        if record is not None and _read_lock(lock) == record:
            lock.unlink(missing_ok=True)


def _process_start(pid: int) -> str | None:
    """Start time of process `pid` in clock ticks since boot (/proc/<pid>/stat field 22), None
    where there is no /proc or no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _read_lock(lock: Path) -> dict | None:
    """The lock record at `lock`; None when there is no file; {} when it is unreadable."""
    try:
        record = json.loads(lock.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _holder_alive(holder: dict) -> bool:
    """Whether the lock's pid (on this host) is still the process that took it."""
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    start = _process_start(holder["pid"])
    return start is None or holder.get("pid_start") in (None, start)


def _take_lock(lock: Path) -> dict:
    """Create `lock` for this process (O_EXCL), taking over a stale one; returns the record
    written. Raises CheckpointError when the folder cannot be written or a live run holds it."""
    root = lock.parent
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint.dir {root} is a file, not a directory; choose another checkpoint.dir")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"checkpoint.dir {root} cannot be created: {describe_os_error(err)}") from None
    record = {
        "pid": os.getpid(),
        "pid_start": _process_start(os.getpid()),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    for _ in range(3):  # a lock can vanish or change under us while another run takes over
        if _create_lock(lock, record):
            return record
        holder = _read_lock(lock)
        if holder is None:
            continue
        remove = f"if no run uses {root}, remove the lock: rm {lock}"
        if not {"pid", "host", "started"} <= holder.keys():
            raise CheckpointError(f"checkpoint.dir {root} is locked by an unreadable lock file; {remove}")
        held_by = f"pid {holder['pid']} on host {holder['host']} since {holder['started']}"
        if holder["host"] != record["host"]:
            raise CheckpointError(
                f"checkpoint.dir {root} is in use by {held_by} (another host: its pid cannot be "
                f"checked from here); {remove}"
            )
        if _holder_alive(holder):
            raise CheckpointError(
                f"checkpoint.dir {root} is in use by another run ({held_by}); give this run "
                f"another checkpoint.dir or stop that one"
            )
        if _retire_stale_lock(lock, holder):
            print(
                f"meshtron: warning: taking over the stale lock {lock} of {held_by} (that process is gone)",
                file=sys.stderr,
                flush=True,
            )
    raise CheckpointError(f"could not take the lock {lock}: other runs are taking it at the same time")


def _create_lock(lock: Path, record: dict) -> bool:
    """Atomically create `lock` holding `record`; False when it exists already."""
    try:
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    except OSError as err:
        raise CheckpointError(f"checkpoint.dir {lock.parent} is not writable: {describe_os_error(err)}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        lock.unlink(missing_ok=True)
        raise CheckpointError(f"checkpoint.dir {lock.parent} is not writable: {lock}: {err.strerror}") from None
    return True


def _retire_stale_lock(lock: Path, holder: dict) -> bool:
    """Move the stale lock `holder` out of the way (an atomic rename, so of two runs taking it
    over only one succeeds); True when this run removed it. If the file renamed turns out to
    be another run's fresh lock, it is put back."""
    moved = lock.with_name(f"{lock.name}.stale-{os.getpid()}")
    try:
        os.rename(lock, moved)
    except FileNotFoundError:
        return False
    ours = _read_lock(moved) == holder
    if not ours:
        with contextlib.suppress(FileExistsError):
            os.link(moved, lock)
    moved.unlink(missing_ok=True)
    return ours


# ---------------------------------------------------------------------------------- load


@contextlib.contextmanager
def writable_weights(chunks: list[nn.Module], optimizer: TrainingOptimizer | None):
    """Yields {parameter: the tensor its loaded local value goes into}: the parameter itself,
    or for 16-bit resident weights (dp/resident.py) an fp32 tensor (read fp32 values, not
    bf16). On a clean exit the optimizer takes what was written: an offloaded one re-reads its
    main weights, a resident one installs the fp32 values and their bf16 rounding."""
    mains = None
    if hasattr(optimizer, "load_main_weights"):
        mains = {p: torch.zeros_like(p, dtype=torch.float32) for _, p in _own_parameters(chunks)}
    yield {p: p if mains is None else mains[p] for _, p in _own_parameters(chunks)}
    if optimizer is not None:
        optimizer.mark_weights_changed()
    if mains is not None:
        optimizer.load_main_weights(mains)


def load_checkpoint(
    path: str | Path, chunks: list[nn.Module], optimizer: TrainingOptimizer | None, mesh, *, weights_only: bool = False
) -> TrainState:
    """Load `path` into this rank's chunks (and optimizer), resharding from whatever layout it
    was saved under. Returns the saved TrainState (a fresh one with `weights_only`). RNG states
    are restored only under the saved world size and layout. Collective over the default group."""
    finish_param_gather(chunks)  # a gather still in flight would overwrite the loaded weights
    with zero3.gathered(chunks):  # ZeRO-3: loaded into the gathered parameters, re-sharded on exit
        return _load_checkpoint(path, chunks, optimizer, mesh, weights_only=weights_only)


def _load_checkpoint(
    path: str | Path, chunks: list[nn.Module], optimizer: TrainingOptimizer | None, mesh, *, weights_only: bool
) -> TrainState:
    path = Path(path)
    meta = read_meta(path)
    if meta.get("weights_only") and not weights_only:
        raise CheckpointError(
            f"checkpoint {path} holds weights only (no optimizer state or step): start from it "
            f"with checkpoint.init_from instead of checkpoint.resume"
        )
    same_layout = meta["world_size"] == mesh.world_size and meta["layout"] == dataclasses.asdict(mesh.par)
    rng_key = f"rng/rank{mesh.rank}"
    with writable_weights(chunks, optimizer) as targets:
        state = model_state(chunks, mesh, for_load=True)
        for name, param in _own_parameters(chunks):
            if targets[param] is not param:
                piece = shard_piece(param, targets[param], mesh)
                if piece is not None:
                    state[f"model/{name}"] = piece
        moments = None
        if not weights_only:
            opt, moments = optimizer_state(chunks, optimizer, mesh, for_load=True)
            state.update(opt)
        if same_layout and not weights_only:
            state[rng_key] = b""
        _read_verified(state, path, meta)
        for name, buf in _persistent_buffers(chunks):  # DCP may hand back new tensors for plain values
            loaded = state[f"model/{name}"]
            if loaded is not buf:
                buf.copy_(loaded)
    if weights_only:
        return TrainState()
    optimizer.load_param_moments(moments, float(state["optim/step"]))
    if same_layout:
        _restore_rng(state[rng_key])
    return TrainState(**meta["train_state"])


def _read_verified(state: dict, path: Path, meta: dict) -> None:
    """`dcp.load` of `state` from `path`, each rank first checking the CRC32 of exactly the
    files its plan reads (`VerifyingReader`); a corrupt file or an I/O error on any rank is the
    same CheckpointError on every rank (DCP gathers the failures over the default group)."""
    reader = VerifyingReader(path, meta.get("files", {}))
    try:
        with torch.no_grad(), _single_process_quiet():
            dcp.load(state, storage_reader=reader, planner=ShardLoadPlanner(flatten_state_dict=False))
    except CheckpointException as err:
        corrupt = checkpoint_error_in(err)
        if corrupt is not None:
            raise corrupt from None
        cause = _os_error_in(err)
        if cause is None:
            raise
        raise CheckpointError(f"checkpoint {path} could not be loaded: {cause}") from None
