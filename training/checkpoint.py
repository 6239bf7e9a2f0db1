"""Distributed checkpoints: atomic save, discovery, validation and resharding load.

A checkpoint is a folder `<checkpoint.dir>/step_<8 digits>/` holding DCP files (one per
rank plus `.metadata`, written by `torch.distributed.checkpoint`) and `meshtron.json`
(format, step, data position, counters, the model config and the layout it was saved
under, and the size of every file). Every tensor is stored under its global, layout-free
shape (see `mpu.sharded_state`), so a checkpoint loads under any tp/pp/ep/etp/dp/zero.

What is saved: model parameters and persistent buffers (e.g. the MoE routers' expert bias),
AdamW moments per parameter and the step count (ZeRO-1 shards are gathered into
per-parameter moments, so the optimizer layout does not matter either), the per-rank RNG
states (restored only under the same world size and layout; others reseed), and the loop
counters in `TrainState`. The learning rate is a pure function of the step and the config.

Atomicity: ranks write into `.tmp-step_N/`; rank 0 writes `meshtron.json` last and then
renames the folder to `step_N`. A folder is a valid checkpoint only if its name is
`step_N`, it holds `meshtron.json` and every file has the size recorded there, so a crash
mid-save (or a truncated file) never looks valid. Old checkpoints beyond `checkpoint.keep`
are removed after a new one is complete (`meshtron.json` first, so a half-deleted folder is
invalid too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from meshtron.mpu.adamw import TrainingOptimizer
from meshtron.mpu.mappings import barrier, world_group
from meshtron.mpu.mesh import group_rank, single_process_mesh
from meshtron.mpu.random import get_rng_tracker
from meshtron.mpu.sharded_state import ShardLoadPlanner, ShardSavePlanner, global_shape, shard_piece

FORMAT = "meshtron-checkpoint"
VERSION = 1
META_FILE = "meshtron.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the path/tensor and what to do."""


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
        for name, param in chunk.named_parameters():
            yield name, param


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


def optimizer_state(chunks: list[nn.Module], optimizer: TrainingOptimizer, mesh, *,
                    for_load: bool = False) -> tuple[dict, dict]:
    """`optim/<name>/exp_avg|exp_avg_sq` -> ShardPiece and `optim/step`, from the optimizer's
    `param_moments` (ZeRO shards all-gathered over their replica groups). For loading, fresh
    zero tensors are returned (filled by DCP, then installed with `load_param_moments`). Also
    returns the {param: (exp_avg, exp_avg_sq)} the pieces view."""
    if for_load:  # an offloaded optimizer keeps its moments on the host: read them there
        device = "cpu" if optimizer.offloaded else None
        moments = {p: (torch.zeros_like(p, device=device), torch.zeros_like(p, device=device))
                   for _, p in _own_parameters(chunks)}
        step = 0.0
    else:
        moments, step = optimizer.param_moments()
    state = {"optim/step": torch.tensor(step, dtype=torch.float64)}
    for name, param in _own_parameters(chunks):
        if getattr(param, "tied_embedding_copy", False) and not for_load:
            continue
        for key, tensor in zip(("exp_avg", "exp_avg_sq"), moments[param]):
            piece = shard_piece(param, tensor, mesh)
            if piece is not None:
                state[f"optim/{name}/{key}"] = piece
    return state, moments


def _rng_bytes() -> bytes:
    state = {"cpu": torch.get_rng_state(), "tracker": get_rng_tracker().get_states(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None}
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


def save_checkpoint(root: str | Path, train_state: TrainState, chunks: list[nn.Module],
                    optimizer: TrainingOptimizer | None, mesh, *,
                    model_config: dict, keep: int | None = None) -> Path:
    """Save everything needed to resume at `train_state.step` into `root/step_N`, atomically;
    then keep only the newest `keep` checkpoints. `optimizer=None` saves weights only (usable
    with `checkpoint.init_from`, not for resuming). Collective over the default group."""
    root = Path(root)
    name = step_dir_name(train_state.step)
    final, tmp = root / name, root / f".tmp-{name}"
    if _is_main():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    barrier(world_group())
    state = model_state(chunks, mesh)
    if optimizer is not None:
        state.update(optimizer_state(chunks, optimizer, mesh)[0])
        state[f"rng/rank{mesh.rank}"] = _rng_bytes()
    with _single_process_quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), planner=ShardSavePlanner(flatten_state_dict=False))
    barrier(world_group())
    if _is_main():
        meta = {"format": FORMAT, "version": VERSION, "train_state": dataclasses.asdict(train_state),
                "weights_only": optimizer is None,
                "world_size": mesh.world_size, "layout": dataclasses.asdict(mesh.par), "model": model_config,
                "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}}
        _write_json_durably(tmp / META_FILE, meta)
        if final.exists():  # the same step saved again (e.g. after a resume): replace it
            stale = root / f".stale-{name}"
            shutil.rmtree(stale, ignore_errors=True)
            (final / META_FILE).unlink(missing_ok=True)
            final.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(root)
        if keep is not None:
            for old in list_checkpoints(root)[:-keep]:
                (old / META_FILE).unlink(missing_ok=True)
                shutil.rmtree(old, ignore_errors=True)
    barrier(world_group())
    return final


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


# ------------------------------------------------------------------------ find / validate


def list_checkpoints(root: str | Path) -> list[Path]:
    """Valid checkpoints under `root`, oldest first (invalid or partial folders are left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            try:
                read_meta(path)
            except CheckpointError:
                continue
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def read_meta(path: str | Path) -> dict:
    """The checkpoint's `meshtron.json` after checking that every recorded file is complete.
    Raises CheckpointError naming the problem."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{path} is not a complete meshtron checkpoint (no {META_FILE}: the save did not "
                              f"finish); point checkpoint.resume at another step_N folder or delete it")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_path} is unreadable ({err}); the checkpoint is corrupt, use another") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path} is not a meshtron checkpoint description (format != {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {meta.get('version')} is not supported "
                              f"(this meshtron reads version {VERSION})")
    for name, size in meta.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is missing its file {name}; the checkpoint is corrupt, use another")
        if file.stat().st_size != size:
            raise CheckpointError(f"checkpoint file {file} has {file.stat().st_size} bytes, {size} were written "
                                  f"(truncated or modified); the checkpoint is corrupt, use another")
    return meta


def resolve_resume(root: str | None, resume: str | None) -> Path | None:
    """The checkpoint to resume from: `resume` = None (fresh run), "auto" (the newest valid one
    in `root`, or a fresh run when there is none) or a path (which must be valid)."""
    if resume is None:
        return None
    if resume == "auto":
        if root is None:
            raise CheckpointError("checkpoint.resume=auto needs checkpoint.dir (where to look for checkpoints)")
        found = list_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if _STEP_DIR.match(path.name) is None and path.is_dir():
        found = list_checkpoints(path)  # a checkpoint.dir given as resume: take its newest
        if found:
            return found[-1]
    read_meta(path)
    return path


def expected_model_shapes(model_cfg) -> dict[str, tuple[int, ...]]:
    """`model/<name>` -> global shape for a model config (built on the meta device, no groups)."""
    from meshtron.models.gpt import GPT

    mesh = single_process_mesh()
    model = GPT(model_cfg, mesh, device="meta")
    shapes = {f"model/{n}": global_shape(p, mesh) for n, p in model.named_parameters()}
    shapes.update({f"model/{n}": tuple(b.shape) for n, b in _persistent_buffers([model])})
    return shapes


def check_compatible(path: str | Path, model_cfg) -> dict:
    """Check that the checkpoint at `path` holds exactly the tensors (names and global shapes)
    the model needs; returns its meta. Rank-independent: run it before any process group."""
    path = Path(path)
    meta = read_meta(path)
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as err:  # noqa: BLE001 (any read error means the same thing here)
        raise CheckpointError(f"checkpoint {path}: cannot read the DCP metadata ({err}); the checkpoint is corrupt") from err
    saved = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
             if k.startswith("model/") and hasattr(v, "size")}
    expected = expected_model_shapes(model_cfg)
    config_diff = _config_diff(meta.get("model", {}), dataclasses.asdict(model_cfg))
    hint = f" (model config differs from the checkpoint's: {config_diff})" if config_diff else ""
    for key, shape in expected.items():
        if key not in saved:
            raise CheckpointError(f"checkpoint {path} has no tensor {key[6:]} that the model needs{hint}")
        if saved[key] != shape:
            raise CheckpointError(f"checkpoint {path}: tensor {key[6:]} has shape {list(saved[key])} but the model "
                                  f"needs {list(shape)}{hint}")
    extra = sorted(set(saved) - set(expected))
    if extra:
        raise CheckpointError(f"checkpoint {path} holds tensor {extra[0][6:]} that the model does not have{hint}")
    return meta


def _config_diff(saved: dict, current: dict) -> str:
    ignored = {"kernel_backend", "recompute", "recompute_layers"}
    diffs = [f"{k} {saved[k]!r} -> {current[k]!r}" for k in sorted(current)
             if k in saved and k not in ignored and saved[k] != current[k]]
    return ", ".join(diffs)


# ---------------------------------------------------------------------------------- load


def load_checkpoint(path: str | Path, chunks: list[nn.Module], optimizer: TrainingOptimizer | None, mesh, *,
                    weights_only: bool = False) -> TrainState:
    """Load `path` into this rank's chunks (and optimizer), resharding from whatever layout it
    was saved under. Returns the saved TrainState (a fresh one with `weights_only`). RNG states
    are restored only under the saved world size and layout. Collective over the default group."""
    path = Path(path)
    meta = read_meta(path)
    if meta.get("weights_only") and not weights_only:
        raise CheckpointError(f"checkpoint {path} holds weights only (no optimizer state or step): start from it "
                              f"with checkpoint.init_from instead of checkpoint.resume")
    state = model_state(chunks, mesh, for_load=True)
    moments = None
    if not weights_only:
        opt, moments = optimizer_state(chunks, optimizer, mesh, for_load=True)
        state.update(opt)
    same_layout = meta["world_size"] == mesh.world_size and meta["layout"] == dataclasses.asdict(mesh.par)
    rng_key = f"rng/rank{mesh.rank}"
    if same_layout and not weights_only:
        state[rng_key] = b""
    try:
        with torch.no_grad(), _single_process_quiet():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=ShardLoadPlanner(flatten_state_dict=False))
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path} could not be loaded: {err}") from err
    for name, buf in _persistent_buffers(chunks):  # DCP may hand back new tensors for plain values
        loaded = state[f"model/{name}"]
        if loaded is not buf:
            buf.copy_(loaded)
    if optimizer is not None:  # an offloaded optimizer re-reads its main weights
        optimizer.mark_weights_changed()
    if weights_only:
        return TrainState()
    optimizer.load_param_moments(moments, float(state["optim/step"]))
    if same_layout:
        _restore_rng(state[rng_key])
    return TrainState(**meta["train_state"])
