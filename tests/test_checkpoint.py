"""Single-process checkpoints: exact round trip of weights, AdamW state and RNG; atomic
folders; keep; resume discovery; clear errors for corrupt and mismatched checkpoints;
per-file CRC32 checksums; failed saves that keep the previous checkpoint; the
checkpoint.dir lock."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import socket
import subprocess
import sys
import zlib

import pytest
import torch

from meshtron.dp.distributed_optimizer import ShardedAdamW
from meshtron.mpu.mesh import single_process_mesh
from meshtron.training import checkpoint
from meshtron.training.checkpoint import (
    LOCK_FILE,
    TrainState,
    check_compatible,
    hold_checkpoint_dir,
    load_checkpoint,
    save_checkpoint,
)
from meshtron.training.checkpoint_files import (
    META_FILE,
    CheckpointError,
    check_checkpoint_crcs,
    list_checkpoints,
    read_meta,
    resolve_resume,
    step_folders,
)
from meshtron.training.step import train_step
from tests.distributed.dense_cases import ADAM_EPS, LR, build, microbatches, model_config
from tests.distributed.moe_cases import moe_config


def _trained(cfg, steps: int, zero: bool = False):
    mesh = single_process_mesh()
    model, reducer, optimizer = build(cfg, mesh)
    if zero:
        optimizer = ShardedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    losses = [_step(model, reducer, optimizer, mesh, cfg, s) for s in range(steps)]
    return model, reducer, optimizer, mesh, losses


def _step(model, reducer, optimizer, mesh, cfg, step: int) -> float:
    out = train_step(model, reducer, optimizer, microbatches(cfg, step, 0, 1, 2), mesh, lr=LR, max_grad_norm=1.0)
    return out.loss.item()


def _save(root, model, optimizer, mesh, cfg, step: int, keep=None):
    return save_checkpoint(
        root,
        TrainState(step=step, consumed_samples=4 * step),
        [model],
        optimizer,
        mesh,
        model_config=dataclasses.asdict(cfg),
        keep=keep,
    )


def _config(arch: str):
    """moe: GeLU experts (w_up, w_down); moe_swiglu: SwiGLU experts (w_gate too) and a shared expert."""
    if arch == "moe":
        return moe_config("gpt2", 2, "sigmoid", None)
    if arch == "moe_swiglu":
        return moe_config("llama", 2, "softmax", None)
    return model_config(arch)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "moe", "moe_swiglu"])
@pytest.mark.parametrize("zero", [False, True])
def test_resume_continues_bit_for_bit(tmp_path, arch, zero):
    cfg = _config(arch)
    cfg = dataclasses.replace(cfg, dropout=0.1)  # exercises the saved RNG streams
    model, reducer, optimizer, mesh, _ = _trained(cfg, 2, zero)
    path = _save(tmp_path, model, optimizer, mesh, cfg, 2)
    want = [_step(model, reducer, optimizer, mesh, cfg, s) for s in (2, 3)]

    torch.manual_seed(999)  # a different RNG state: the checkpoint must restore it
    fresh, fresh_reducer, fresh_opt = build(cfg, mesh)
    if zero:
        fresh_opt = ShardedAdamW(fresh_reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    state = load_checkpoint(path, [fresh], fresh_opt, mesh)
    assert state == TrainState(step=2, consumed_samples=8)
    got = [_step(fresh, fresh_reducer, fresh_opt, mesh, cfg, s) for s in (2, 3)]
    assert got == want  # bit for bit
    for (name, a), (_, b) in zip(fresh.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), name
    for name, buf in model.named_buffers():
        assert torch.equal(buf, dict(fresh.named_buffers())[name]), name


def test_zero1_checkpoint_loads_into_replicated_adamw(tmp_path):
    cfg = model_config("gpt2")
    model, reducer, optimizer, mesh, _ = _trained(cfg, 2, zero=True)
    path = _save(tmp_path, model, optimizer, mesh, cfg, 2)
    want = _step(model, reducer, optimizer, mesh, cfg, 2)
    fresh, fresh_reducer, fresh_opt = build(cfg, mesh)  # zero=0
    load_checkpoint(path, [fresh], fresh_opt, mesh)
    assert _step(fresh, fresh_reducer, fresh_opt, mesh, cfg, 2) == pytest.approx(want, rel=1e-6)


def test_atomic_layout_keep_and_discovery(tmp_path):
    cfg = model_config("gpt2")
    model, _, optimizer, mesh, _ = _trained(cfg, 1)
    for step in (1, 2, 3):
        _save(tmp_path, model, optimizer, mesh, cfg, step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())
    meta = read_meta(tmp_path / "step_00000003")
    assert meta["train_state"]["step"] == 3 and meta["train_state"]["consumed_samples"] == 12
    assert resolve_resume(str(tmp_path), "auto") == tmp_path / "step_00000003"
    assert resolve_resume(str(tmp_path), None) is None
    assert resolve_resume(str(tmp_path / "empty"), "auto") is None
    # A folder left by a crash mid-save (no meshtron.json) is never picked up.
    crashed = tmp_path / "step_00000009"
    crashed.mkdir()
    (crashed / "__0_0.distcp").write_bytes(b"partial")
    assert resolve_resume(str(tmp_path), "auto") == tmp_path / "step_00000003"
    with pytest.raises(CheckpointError, match="not a complete meshtron checkpoint"):
        resolve_resume(str(tmp_path), str(crashed))


def test_truncated_file_is_reported(tmp_path):
    cfg = model_config("gpt2")
    model, _, optimizer, mesh, _ = _trained(cfg, 1)
    path = _save(tmp_path, model, optimizer, mesh, cfg, 1)
    data = next(p for p in path.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{data.name} has 100 bytes.*truncated"):
        read_meta(path)
    assert list_checkpoints(tmp_path) == []
    (path / META_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        read_meta(path)


def test_mismatched_model_names_the_tensor(tmp_path):
    cfg = model_config("gpt2")
    model, _, optimizer, mesh, _ = _trained(cfg, 1)
    path = _save(tmp_path, model, optimizer, mesh, cfg, 1)
    check_compatible(path, cfg)
    wider = dataclasses.replace(cfg, ffn_hidden_size=cfg.ffn_hidden_size * 2)
    with pytest.raises(
        CheckpointError, match=r"tensor layers\.0\.mlp\.\S+ has shape .* needs .*ffn_hidden_size 64 -> 128"
    ):
        check_compatible(path, wider)
    deeper = dataclasses.replace(cfg, num_layers=3)
    with pytest.raises(CheckpointError, match=r"has no tensor layers\.2\."):
        check_compatible(path, deeper)
    shallower = dataclasses.replace(cfg, num_layers=1)
    with pytest.raises(CheckpointError, match=r"holds tensor layers\.1\..* does not have"):
        check_compatible(path, shallower)


def test_vocab_padding_is_not_saved(tmp_path):
    cfg = model_config("llama")  # vocab 200, padded to 256
    model, _, optimizer, mesh, _ = _trained(cfg, 1)
    path = _save(tmp_path, model, optimizer, mesh, cfg, 1)
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert tuple(md["model/embed.weight"].size) == (200, cfg.hidden_size)
    assert tuple(md["model/head.weight"].size) == (200, cfg.hidden_size)
    assert tuple(md["optim/head.weight/exp_avg"].size) == (200, cfg.hidden_size)
    assert json.loads((path / META_FILE).read_text())["layout"]["tp"] == 1


# ------------------------------------------------------------------ checksums, save failures, the lock


def _corrupt(file, offset: int = 100, length: int = 64 << 10) -> None:
    """Overwrite `length` bytes of `file` from `offset` with random ones, keeping its size."""
    data = bytearray(file.read_bytes())
    length = min(length, len(data) - offset)
    data[offset : offset + length] = os.urandom(length)
    file.write_bytes(bytes(data))


def test_manifest_holds_each_file_crc32_and_corruption_is_named(tmp_path, capsys):
    cfg = model_config("gpt2")
    model, _, optimizer, mesh, _ = _trained(cfg, 1)
    first = _save(tmp_path, model, optimizer, mesh, cfg, 1)
    newest = _save(tmp_path, model, optimizer, mesh, cfg, 2)
    files = json.loads((newest / META_FILE).read_text())["files"]
    assert set(files) == {p.name for p in newest.iterdir()} - {META_FILE}
    for name, entry in files.items():  # computed while writing, equal to the bytes on disk
        data = (newest / name).read_bytes()
        assert entry == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name
    check_checkpoint_crcs(newest)
    shard = newest / "__0_0.distcp"
    _corrupt(shard)
    read_meta(newest)  # sizes unchanged: only the checksum sees it
    with pytest.raises(CheckpointError, match=rf"checkpoint file {shard} is corrupt: its CRC32 is"):
        check_checkpoint_crcs(newest)
    with pytest.raises(CheckpointError, match=rf"{shard} is corrupt"):
        resolve_resume(str(tmp_path), str(newest))
    assert resolve_resume(str(tmp_path), "auto") == first
    err = capsys.readouterr().err
    assert f"meshtron: warning: skipping checkpoint {newest}: checkpoint file {shard} is corrupt" in err
    _corrupt(first / ".metadata", offset=10, length=16)
    with pytest.raises(CheckpointError, match=r"no intact checkpoint .*__0_0.distcp is corrupt"):
        resolve_resume(str(tmp_path), "auto")


def test_version_1_checkpoints_still_load(tmp_path):
    cfg = model_config("gpt2")
    model, _, optimizer, mesh, _ = _trained(cfg, 1)
    path = _save(tmp_path, model, optimizer, mesh, cfg, 1)
    meta = json.loads((path / META_FILE).read_text())
    meta["version"], meta["files"] = 1, {name: entry["bytes"] for name, entry in meta["files"].items()}
    (path / META_FILE).write_text(json.dumps(meta))
    assert resolve_resume(str(tmp_path), "auto") == path
    fresh, _, fresh_opt = build(cfg, mesh)
    assert load_checkpoint(path, [fresh], fresh_opt, mesh).step == 1


class _FillingDisk:
    """A file whose disk is full after 50 kB: further writes fail with ENOSPC."""

    def __init__(self, file):
        self.file, self.written = file, 0

    def write(self, data) -> int:
        size = len(memoryview(data).cast("B"))
        if self.written + size > 50_000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.written += size
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_failed_save_names_the_file_and_keeps_the_previous(tmp_path, monkeypatch):
    """Disk full in the middle of a shard: one CheckpointError naming the file and the cause; the
    partial folder is removed and the previous checkpoint still verifies and loads."""
    cfg = model_config("gpt2")
    model, _, optimizer, mesh, _ = _trained(cfg, 1)
    previous = _save(tmp_path, model, optimizer, mesh, cfg, 1)
    real_init = checkpoint._ChecksummedFile.__init__
    monkeypatch.setattr(
        checkpoint._ChecksummedFile,
        "__init__",
        lambda self, file, path, on_error: real_init(self, _FillingDisk(file), path, on_error),
    )
    with pytest.raises(
        CheckpointError,
        match=r"could not save the checkpoint of step 2 .*: rank 0: "
        r"\S+/\.tmp-step_00000002/__0_0\.distcp: No space left on device",
    ):
        _save(tmp_path, model, optimizer, mesh, cfg, 2, keep=1)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [previous.name]
    check_checkpoint_crcs(previous)
    fresh, _, fresh_opt = build(cfg, mesh)
    assert load_checkpoint(previous, [fresh], fresh_opt, mesh).step == 1


def test_keep_never_removes_the_checkpoint_just_saved(tmp_path):
    """Checkpoints of later steps (left by an earlier run) do not count against keep."""
    cfg = model_config("gpt2")
    model, _, optimizer, mesh, _ = _trained(cfg, 1)
    for step in (1, 2, 5):
        _save(tmp_path, model, optimizer, mesh, cfg, step)
    _save(tmp_path, model, optimizer, mesh, cfg, 3, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003", "step_00000005"]


def test_keep_removes_incomplete_older_folders(tmp_path):
    """An older step folder that can never load (a truncated file, or its manifest gone) is
    removed by keep, whatever its age; a complete one within keep stays; a newer incomplete one
    (left by an earlier run) is not this save's to judge."""
    cfg = model_config("gpt2")
    model, _, optimizer, mesh, _ = _trained(cfg, 1)
    for step in (1, 2, 3, 6):
        _save(tmp_path, model, optimizer, mesh, cfg, step)
    shard = tmp_path / "step_00000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    (tmp_path / "step_00000006" / META_FILE).unlink()
    _save(tmp_path, model, optimizer, mesh, cfg, 4, keep=3)
    assert [p.name for p in step_folders(tmp_path)] == [
        "step_00000001",
        "step_00000003",
        "step_00000004",
        "step_00000006",
    ]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000003", "step_00000004"]


def _write_lock(root, **fields):
    record = {"pid": os.getpid(), "pid_start": None, "host": socket.gethostname(), "started": "earlier", **fields}
    root.mkdir(parents=True, exist_ok=True)
    (root / LOCK_FILE).write_text(json.dumps(record))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_checkpoint_dir_lock(tmp_path, capsys):
    root = tmp_path / "ckpt"
    with hold_checkpoint_dir(root):
        lock = json.loads((root / LOCK_FILE).read_text())
        assert lock["pid"] == os.getpid() and lock["host"] == socket.gethostname() and lock["started"]
        with pytest.raises(
            CheckpointError,
            match=rf"checkpoint.dir {root} is in use by another run "
            rf"\(pid {os.getpid()} on host",
        ):
            with hold_checkpoint_dir(root):
                pass
        assert (root / LOCK_FILE).exists()  # the refused holder leaves it alone
    assert not (root / LOCK_FILE).exists()

    _write_lock(root, pid=_dead_pid())
    with hold_checkpoint_dir(root):
        assert json.loads((root / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"meshtron: warning: taking over the stale lock {root / LOCK_FILE}" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == []

    _write_lock(root, pid_start="1")  # a live pid that another process held before (pid reuse)
    with hold_checkpoint_dir(root):
        pass
    assert "taking over the stale lock" in capsys.readouterr().err

    _write_lock(root, host="elsewhere")
    with pytest.raises(CheckpointError, match=rf"in use by pid \d+ on host elsewhere .*rm {root / LOCK_FILE}"):
        with hold_checkpoint_dir(root):
            pass
    (root / LOCK_FILE).write_text("")
    with pytest.raises(CheckpointError, match="unreadable lock file"):
        with hold_checkpoint_dir(root):
            pass


def test_unwritable_checkpoint_dir_is_refused(tmp_path, monkeypatch):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(CheckpointError, match=rf"checkpoint.dir {a_file} is a file, not a directory"):
        with hold_checkpoint_dir(a_file):
            pass
    with pytest.raises(CheckpointError, match=rf"checkpoint.dir {a_file / 'sub'} cannot be created: .*Not a directory"):
        with hold_checkpoint_dir(a_file / "sub"):
            pass
    real_open = os.open

    def denied(path, *args):
        if str(path).endswith(LOCK_FILE):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args)

    monkeypatch.setattr(checkpoint.os, "open", denied)  # root ignores permission bits: simulate them
    with pytest.raises(
        CheckpointError,
        match=rf"checkpoint.dir {tmp_path} is not writable: "
        rf"{tmp_path / LOCK_FILE}: Permission denied",
    ):
        with hold_checkpoint_dir(tmp_path):
            pass
