"""Single-process checkpoints: exact round trip of weights, AdamW state and RNG; atomic
folders; keep; resume discovery; clear errors for corrupt and mismatched checkpoints."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from meshtron.mpu.distributed_optimizer import ShardedAdamW
from meshtron.mpu.mesh import single_process_mesh
from tests.distributed.dense_cases import ADAM_EPS, LR, build, microbatches, model_config
from tests.distributed.moe_cases import moe_config
from meshtron.training.checkpoint import (
    META_FILE,
    CheckpointError,
    TrainState,
    check_compatible,
    list_checkpoints,
    load_checkpoint,
    read_meta,
    resolve_resume,
    save_checkpoint,
)
from meshtron.training.step import train_step


def _trained(cfg, steps: int, zero: bool = False):
    mesh = single_process_mesh()
    model, reducer, optimizer = build(cfg, mesh)
    if zero:
        optimizer = ShardedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    losses = [_step(model, reducer, optimizer, mesh, cfg, s) for s in range(steps)]
    return model, reducer, optimizer, mesh, losses


def _step(model, reducer, optimizer, mesh, cfg, step: int) -> float:
    out = train_step(model, reducer, optimizer, microbatches(cfg, step, 0, 1, 2), mesh, lr=LR, max_grad_norm=1.0)
    return out["loss"].item()


def _save(root, model, optimizer, mesh, cfg, step: int, keep=None):
    return save_checkpoint(root, TrainState(step=step, consumed_samples=4 * step), [model], optimizer, mesh,
                           model_config=dataclasses.asdict(cfg), keep=keep)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "moe"])
@pytest.mark.parametrize("zero", [False, True])
def test_resume_continues_bit_for_bit(tmp_path, arch, zero):
    cfg = moe_config("gpt2", 2, "sigmoid", None) if arch == "moe" else model_config(arch)
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
    with pytest.raises(CheckpointError, match=r"tensor layers\.0\.mlp\.\S+ has shape .* needs .*ffn_hidden_size 64 -> 128"):
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
