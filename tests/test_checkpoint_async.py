"""Asynchronous checkpoints (checkpoint.async) and ZeRO moments saved as shards, in one
process: the background save writes the same files as a synchronous one; training goes on
while a slowed writer runs and does not change what is saved; a failure in the writer thread
surfaces at the next save/wait as the synchronous save's CheckpointError; a train.py run
killed with SIGKILL mid-write resumes from the previous checkpoint with the uninterrupted
losses. `flat_range_pieces` turns any flat range of a parameter into boxes that rebuild it."""

from __future__ import annotations

import dataclasses
import random
import signal
import sys
import time

import pytest
import torch
from torch import nn

from meshtron.dp.distributed_optimizer import ShardedAdamW
from meshtron.mpu.mesh import single_process_mesh
from meshtron.training import checkpoint
from meshtron.training.checkpoint import (
    WRITE_DELAY_ENV,
    AsyncCheckpointer,
    TrainState,
    load_checkpoint,
    save_checkpoint,
)
from meshtron.training.checkpoint_files import CheckpointError, check_checkpoint_crcs, list_checkpoints, read_meta
from meshtron.training.config import ConfigError, RunConfig
from meshtron.training.sharded_state import _boxes, flat_range_pieces
from tests.distributed.dense_cases import ADAM_EPS, LR, build, model_config
from tests.test_checkpoint import _FillingDisk, _step, _trained
from tests.test_resume_cli import COMMON, _losses, _start, _wait_for, reference  # noqa: F401 (fixture)
from tests.test_train_cli import metrics, run

pytestmark = pytest.mark.serial  # staging is bounded in seconds and a slowed write must overlap two steps


def _params_and_moments(model, optimizer) -> dict[str, torch.Tensor]:
    moments, step = optimizer.param_moments()
    out = {"step": torch.tensor(step)}
    for name, p in model.named_parameters():
        out[name] = p.detach().clone()
        out[f"{name}/exp_avg"], out[f"{name}/exp_avg_sq"] = (m.clone() for m in moments[p])
    return out


def _loaded(path, cfg, zero: bool = False) -> dict[str, torch.Tensor]:
    mesh = single_process_mesh()
    model, reducer, optimizer = build(cfg, mesh)
    if zero:
        optimizer = ShardedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    load_checkpoint(path, [model], optimizer, mesh)
    return _params_and_moments(model, optimizer)


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


# ------------------------------------------------------------------------ boxes of a flat range


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2)])
def test_boxes_rebuild_every_flat_range(shape):
    """Every range [a, b) of a row-major tensor is covered exactly, in order, by its boxes
    (at most 2·ndim - 1 of them)."""
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    n = full.numel()
    for a in range(n):
        for b in range(a + 1, n + 1):
            boxes = _boxes(shape, a, b)
            assert len(boxes) <= 2 * len(shape) - 1, (a, b, boxes)
            got = torch.cat(
                [full[tuple(slice(s, s + k) for s, k in zip(start, box))].reshape(-1) for start, box in boxes]
            )
            assert torch.equal(got, full.reshape(-1)[a:b]), (a, b, boxes)


def test_flat_range_pieces_leave_out_vocabulary_padding():
    """A padded (vocabulary) parameter: pieces of any range cover only the real rows, as views."""
    mesh = single_process_mesh()
    param = nn.Parameter(torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4))
    param.valid_rows = 5  # the last row is padding
    flat = param.detach().reshape(-1)
    rng = random.Random(0)
    for _ in range(50):
        a = rng.randrange(24)
        b = rng.randrange(a + 1, 25)
        pieces = flat_range_pieces(param, a, flat[a:b], mesh)
        covered = torch.zeros(5, 4, dtype=torch.bool)
        for piece in pieces:
            assert piece.global_shape == (5, 4)
            rows, cols = (slice(o, o + k) for o, k in zip(piece.offsets, piece.local.shape))
            assert torch.equal(piece.local, param.detach()[rows, cols])
            assert piece.local.data_ptr() >= flat.data_ptr()  # a view, not a copy
            assert not covered[rows, cols].any()
            covered[rows, cols] = True
        assert covered.reshape(-1).nonzero().reshape(-1).tolist() == list(range(a, min(b, 20)))


# ------------------------------------------------------------------------------ async saves


def _save_both(tmp_path, zero: bool):
    cfg = model_config("gpt2")
    model, reducer, optimizer, mesh, _ = _trained(cfg, 2, zero)
    state = TrainState(step=2, consumed_samples=8)
    sync = save_checkpoint(tmp_path / "sync", state, [model], optimizer, mesh, model_config=dataclasses.asdict(cfg))
    saver = AsyncCheckpointer(None)
    saver.save(tmp_path / "async", state, [model], optimizer, mesh, model_config=dataclasses.asdict(cfg))
    return cfg, sync, saver.wait(), (model, reducer, optimizer, mesh)


@pytest.mark.parametrize("zero", [False, True])
def test_async_save_writes_the_same_checkpoint(tmp_path, zero):
    """The same state saved synchronously and in the background: the same data files byte for
    byte (same CRC32s in the manifest), the same manifest (DCP's `.metadata` aside: it names the
    folder), the same tensors loaded."""
    cfg, sync, background, _ = _save_both(tmp_path, zero)
    assert background == tmp_path / "async" / "step_00000002"
    check_checkpoint_crcs(background)
    sync_meta, async_meta = read_meta(sync), read_meta(background)
    for meta in (sync_meta, async_meta):  # DCP's .metadata records the folder's path: it differs
        del meta["files"][".metadata"]
    assert sync_meta == async_meta
    for name in sync_meta["files"]:
        if name.endswith(".distcp"):
            assert (sync / name).read_bytes() == (background / name).read_bytes(), name
    _assert_equal(_loaded(background, cfg, zero), _loaded(sync, cfg, zero))


def test_training_goes_on_while_a_slowed_writer_runs(tmp_path, monkeypatch):
    """With a writer slowed by the test hook, steps run while the save is in flight; the
    checkpoint holds the state at the save (staged copy), not the weights trained after it."""
    monkeypatch.setenv(WRITE_DELAY_ENV, "1.0")
    cfg = model_config("gpt2")
    model, reducer, optimizer, mesh, _ = _trained(cfg, 2)
    at_save = _params_and_moments(model, optimizer)
    saver = AsyncCheckpointer(None)
    started = time.monotonic()
    saver.save(
        tmp_path, TrainState(step=2, consumed_samples=8), [model], optimizer, mesh, model_config=dataclasses.asdict(cfg)
    )
    assert time.monotonic() - started < 0.9  # staging only: the write goes on in the background
    for step in (2, 3):
        _step(model, reducer, optimizer, mesh, cfg, step)
        assert saver.in_flight
    # On a loaded host the writer thread may not have reached DCP's folder yet after the two
    # steps: wait for it (its first file write then sleeps 1 s, so the save is still in flight).
    partial = tmp_path / ".tmp-step_00000002"
    deadline = time.monotonic() + 5.0
    while not partial.is_dir() and saver.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert saver.in_flight and partial.is_dir() and list_checkpoints(tmp_path) == []
    path = saver.wait()
    assert not saver.in_flight and list_checkpoints(tmp_path) == [path]
    assert any(not torch.equal(p, at_save[n]) for n, p in model.named_parameters())  # training went on
    _assert_equal(_loaded(path, cfg), at_save)


def test_background_failure_surfaces_at_the_next_save_and_wait(tmp_path, monkeypatch):
    """Disk full in the writer thread: the next save (and wait) raises the synchronous save's
    CheckpointError; the partial folder is removed and the previous checkpoint stays intact."""
    cfg = model_config("gpt2")
    model, _, optimizer, mesh, _ = _trained(cfg, 1)
    saver = AsyncCheckpointer(None)
    args = ([model], optimizer, mesh)
    saver.save(tmp_path, TrainState(step=1), *args, model_config=dataclasses.asdict(cfg))
    previous = saver.wait()
    real_init = checkpoint._ChecksummedFile.__init__
    monkeypatch.setattr(
        checkpoint._ChecksummedFile,
        "__init__",
        lambda self, file, path, on_error: real_init(self, _FillingDisk(file), path, on_error),
    )
    saver.save(tmp_path, TrainState(step=2), *args, model_config=dataclasses.asdict(cfg), keep=1)
    expected = (
        r"could not save the checkpoint of step 2 \(earlier checkpoints are intact\): rank 0: "
        r"\S+/\.tmp-step_00000002/__0_0\.distcp: No space left on device"
    )
    with pytest.raises(CheckpointError, match=expected):
        saver.save(tmp_path, TrainState(step=3), *args, model_config=dataclasses.asdict(cfg))
    monkeypatch.undo()
    assert saver.wait() is None  # the failed save was reported once; nothing else in flight
    assert sorted(p.name for p in tmp_path.iterdir()) == [previous.name]
    check_checkpoint_crcs(previous)
    saver.save(tmp_path, TrainState(step=2), *args, model_config=dataclasses.asdict(cfg), keep=1)
    assert saver.wait() == tmp_path / "step_00000002"  # the next save works again
    assert list_checkpoints(tmp_path) == [tmp_path / "step_00000002"]


def test_zero_moments_are_saved_without_param_moments(tmp_path, monkeypatch):
    """ZeRO checkpoints never call the gathering `param_moments` while saving."""
    cfg = model_config("gpt2")
    model, _, optimizer, mesh, _ = _trained(cfg, 2, zero=True)
    want = _params_and_moments(model, optimizer)

    def refuse(self):
        raise AssertionError("param_moments (an all-gather of full moments) called during a save")

    monkeypatch.setattr(ShardedAdamW, "param_moments", refuse)
    path = save_checkpoint(tmp_path, TrainState(step=2), [model], optimizer, mesh, model_config=dataclasses.asdict(cfg))
    monkeypatch.undo()
    _assert_equal(_loaded(path, cfg, zero=False), want)


def test_checkpoint_async_config_key():
    """`checkpoint.async` (a Python keyword) is the field `async_`; bad values name the key."""
    assert RunConfig.from_dict({"checkpoint": {"async": True, "dir": "x"}}).checkpoint.async_ is True
    assert RunConfig.from_dict({}).checkpoint.async_ is False
    with pytest.raises(ConfigError, match=r"^checkpoint.async='yes' must be true or false$"):
        RunConfig.from_dict({"checkpoint": {"async": "yes"}})
    with pytest.raises(ConfigError, match=r"^checkpoint.async=true needs checkpoint.dir \(where to write"):
        RunConfig.from_dict({"checkpoint": {"async": True}})
    with pytest.raises(ConfigError, match="unknown key checkpoint.async_; did you mean checkpoint.async"):
        RunConfig.from_dict({"checkpoint": {"async_": True}})


# ----------------------------------------------------------------- train.py killed mid-write


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigkill_during_a_background_write_resumes_from_the_previous(tmp_path, reference):  # noqa: F811
    """A run with checkpoint.async=true and a slowed writer is killed while step 4's checkpoint
    is being written and steps after it run: the `.tmp-` folder is not taken, resume=auto
    starts from step 2 and gives the uninterrupted losses bit for bit."""
    ckpt, killed = tmp_path / "ckpt", tmp_path / "killed"
    proc = _start(
        ckpt,
        killed,
        "checkpoint.every=2",
        "checkpoint.keep=null",
        "checkpoint.async=true",
        env={WRITE_DELAY_ENV: "1.5"},
    )

    def mid_write() -> bool:
        done = [r["step"] for r in metrics(killed)] if (killed / "metrics.jsonl").exists() else []
        return (
            (ckpt / "step_00000002" / "meshtron.json").exists()
            and (ckpt / ".tmp-step_00000004").is_dir()
            and bool(done)
            and max(done) >= 5
        )

    _wait_for(mid_write, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [p.name for p in list_checkpoints(ckpt)] == ["step_00000002"]
    assert (ckpt / ".tmp-step_00000004").is_dir()
    out = run(
        [
            sys.executable,
            "train.py",
            *COMMON,
            f"checkpoint.dir={ckpt}",
            "checkpoint.resume=auto",
            "checkpoint.async=true",
            "checkpoint.every=2",
            f"hydra.run.dir={tmp_path / 'resumed'}",
        ],
        timeout=200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed from {ckpt / 'step_00000002'} at step 2" in out.stdout
    assert "checkpoint of step 12 saved to" in out.stdout
    resumed = _losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(3, 13))
    assert all(resumed[s] == reference[s] for s in resumed), (resumed, reference)  # bit for bit
    assert [p.name for p in list_checkpoints(ckpt)][-1] == "step_00000012"
    assert not (ckpt / ".tmp-step_00000004").exists()
