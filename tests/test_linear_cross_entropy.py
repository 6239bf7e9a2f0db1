"""The LM head fused with the cross-entropy in row chunks (kernels/linear_cross_entropy.py) against
the unfused head + vocab-parallel cross-entropy: values, gradients, chunking, padding, ignored
targets, no-grad evaluation, autocast, and the model's forward(targets=...) in both modes.
The multi-process layouts (tp, sp, pp, cp, ep) are proven by the distributed cases, whose
serial references run unfused (tests/distributed/dense_cases.UNFUSED)."""

from __future__ import annotations

import math

import pytest
import torch

from meshtron.kernels.linear_cross_entropy import chunk_rows_for, linear_cross_entropy_sum
from meshtron.models.config import ExecutionConfig
from meshtron.models.gpt import GPT
from meshtron.mpu.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from meshtron.mpu.init import initialize_parameters
from meshtron.mpu.mesh import single_process_mesh
from tests.distributed.dense_cases import model_config


def _problem(rows=37, hidden=16, local_vocab=48, vocab_size=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    w = torch.randn(local_vocab, hidden, generator=g) * 0.5
    target = torch.randint(0, vocab_size, (rows,), generator=g)
    target[3] = IGNORE_INDEX
    target[5] = vocab_size - 1
    return x, w, target


def _unfused(x, w, target, vocab_size, scale=1.0):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x @ w.t(), target, vocab_size=vocab_size).sum()
    (loss * scale).backward()
    return loss.detach(), x.grad, w.grad


def _fused(x, w, target, vocab_size, scale=1.0, **kw):
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = linear_cross_entropy_sum(x, w, target, vocab_size=vocab_size, **kw)
    (loss * scale).backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("chunk_rows", [1, 5, 16, 37, 1000])
def test_equals_unfused_for_any_chunking(chunk_rows):
    x, w, target = _problem()
    want = _unfused(x, w, target, 40, scale=0.25)
    got = _fused(x, w, target, 40, scale=0.25, chunk_rows=chunk_rows)
    for name, a, b in zip(("loss", "grad x", "grad w"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


class _LogitsBuffers(torch.utils._python_dispatch.TorchDispatchMode):
    """Distinct storages of every fp32 op output shaped like one chunk's logits [rows, cols]."""

    def __init__(self, rows, cols):
        super().__init__()
        self.shape, self.storages = (rows, cols), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape and t.dtype == torch.float32:
                self.storages.add(t.untyped_storage().data_ptr())
        return out


def test_fp32_chunk_overwrites_its_logits_with_exponentials_and_gradient():
    x, w, target = _problem(rows=12, local_vocab=40)
    x.requires_grad_(True)
    with _LogitsBuffers(12, 40) as seen:  # one chunk
        linear_cross_entropy_sum(x, w, target, vocab_size=40, chunk_rows=12)
    assert len(seen.storages) == 1  # the logits, then the exponentials, then the gradient
    with torch.autocast("cpu", dtype=torch.bfloat16), _LogitsBuffers(12, 40) as seen16:
        linear_cross_entropy_sum(x, w, target, vocab_size=40, chunk_rows=12)
    assert len(seen16.storages) == 1  # bf16 logits widened once, then the same


def test_padding_rows_are_never_used_and_get_zero_gradient():
    x, w, target = _problem()
    w_other_padding = w.clone()
    w_other_padding[40:] = 1e4  # padding rows must not reach the loss
    loss, _, grad_w = _fused(x, w_other_padding, target, 40, chunk_rows=8)
    torch.testing.assert_close(loss, _unfused(x, w, target, 40)[0], rtol=1e-5, atol=0)
    assert torch.count_nonzero(grad_w[40:]) == 0


def test_ignored_rows_add_nothing():
    x, w, target = _problem()
    all_ignored = torch.full_like(target, IGNORE_INDEX)
    loss, grad_x, grad_w = _fused(x, w, all_ignored, 40)
    assert loss.item() == 0.0
    assert torch.count_nonzero(grad_x) == 0 and torch.count_nonzero(grad_w) == 0


def test_hand_computed_value():
    """One row, two classes: x = [1], W = [[2], [0]], target 0 -> log(1 + e^-2)."""
    x = torch.tensor([[1.0]])
    w = torch.tensor([[2.0], [0.0]])
    loss = linear_cross_entropy_sum(x, w, torch.tensor([0]))
    assert loss.item() == pytest.approx(math.log1p(math.exp(-2.0)), rel=1e-6)


def test_vocab_shard_offset_reads_targets_of_its_own_slice():
    """A shard holding vocabulary [100, 148) of 140 alone: targets in its slice count, others
    are 'in another shard' (target logit 0), exactly as the unfused per-shard statistics."""
    x, w, _ = _problem()
    target = torch.randint(90, 140, (x.shape[0],), generator=torch.Generator().manual_seed(2))
    ref = vocab_parallel_cross_entropy(x @ w.t(), target, vocab_start=100, vocab_size=140).sum()
    got = linear_cross_entropy_sum(x, w, target, vocab_start=100, vocab_size=140, chunk_rows=7)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_target_in_padding_is_infinite_as_unfused():
    x, w, target = _problem()
    target[0] = 45  # padding column of this shard: an impossible token
    assert torch.isinf(linear_cross_entropy_sum(x, w, target, vocab_size=40))
    assert torch.isinf(vocab_parallel_cross_entropy(x @ w.t(), target, vocab_size=40).sum())


def test_no_grad_builds_no_gradients_and_same_value():
    x, w, target = _problem()
    xg = x.clone().requires_grad_(True)
    with torch.no_grad():
        value = linear_cross_entropy_sum(xg, w, target, vocab_size=40)
    assert value.grad_fn is None
    torch.testing.assert_close(value, _unfused(x, w, target, 40)[0], rtol=1e-5, atol=0)


def test_bad_input_is_named():
    x, w, target = _problem()
    with pytest.raises(ValueError, match="disagree on the leading dims"):
        linear_cross_entropy_sum(x, w, target[:-1])
    with pytest.raises(ValueError, match="features"):
        linear_cross_entropy_sum(x[:, :-1], w, target)
    with pytest.raises(ValueError, match="backend"):
        linear_cross_entropy_sum(x, w, target, backend="cuda")
    with pytest.raises(ValueError, match="chunk_rows"):
        linear_cross_entropy_sum(x, w, target, chunk_rows=0)


def test_chunk_rows_follow_the_local_vocabulary_and_device():
    assert chunk_rows_for(8192) == 1024  # CPU: 8 Mi logits, at least 256 rows
    assert chunk_rows_for(1024) == 8192
    assert chunk_rows_for(32000) == 262
    assert chunk_rows_for(128 * 1024) == 256
    assert chunk_rows_for(128 * 1024, "cuda") == 1024  # CUDA: 128 Mi, at least 1,024 rows
    assert chunk_rows_for(32 * 1024, "cuda") == 4096
    assert chunk_rows_for(1 << 30, "cuda") == 1024


def test_bf16_autocast_runs_the_gemms_in_16_bits_like_the_unfused_head():
    x, w, target = _problem(rows=64, hidden=32, local_vocab=128, vocab_size=128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _fused(x, w, target, 128, chunk_rows=16)
        want = _unfused(x, w, target, 128)
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    # Both paths round the logits and the gradient GEMMs' operands to bf16 (2^-8 relative).
    for name, a, b in zip(("loss", "grad x", "grad w"), got, want):
        assert ((a - b).norm() / b.norm()).item() < 2e-2, name


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_model_forward_with_targets_fused_equals_unfused(arch):
    """forward(x, targets=t) returns the summed loss; fused and unfused give the same loss and
    the same gradient on every parameter (tied embedding included)."""
    cfg, mesh = model_config(arch), single_process_mesh()  # vocab 200: padded to 256
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :4] = IGNORE_INDEX
    results = {}
    for fused in (False, True):  # fused in chunks of 5 rows: 48 tokens -> 10 chunks, the last short
        model = GPT(cfg, mesh, execution=ExecutionConfig(fused_lm_loss=fused, lm_loss_chunk_rows=5))
        initialize_parameters(model, 7, mesh)
        loss = model(inputs, targets=targets)
        (loss / 10).backward()
        results[fused] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
        logits = model(inputs)  # without targets: the logits, in both modes
        assert logits.shape == (3, cfg.seq_len, cfg.padded_vocab_size(1))
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-6, atol=0)
    for name, grad in results[False][1].items():  # tensor-level relative error, as the layout cases
        assert ((results[True][1][name] - grad).norm() / grad.norm()).item() < 1e-5, name


def test_chunk_rows_config_is_validated():
    with pytest.raises(ValueError, match="lm_loss_chunk_rows"):
        ExecutionConfig(lm_loss_chunk_rows=0)
