"""A whole training step with kernels.backend=triton (Triton interpreter on CPU) equals
kernels.backend=torch: losses, every gradient and the updated weights, for both model
families and an MoE model (fused norms, linear+activation, cross-entropy, grouped GEMM).
The block's fused residual add + norm2 (`Norm.residual`): the torch backend computes bit for
bit the unfused `x + attn; norm2(x)`, and a block under triton_checked (self-checked, then the
fused kernel) equals the torch block."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest  # noqa: E402
import torch  # noqa: E402

from meshtron.dp.grad_reduce import DataParallelGradReducer  # noqa: E402
from meshtron.kernels import norms, selfcheck  # noqa: E402
from meshtron.kernels.backend import CHECKED  # noqa: E402
from meshtron.models import gpt  # noqa: E402
from meshtron.models.config import ExecutionConfig, GPTConfig  # noqa: E402
from meshtron.models.gpt import GPT, Block  # noqa: E402
from meshtron.models.rope import rope_tables  # noqa: E402
from meshtron.mpu.init import initialize_parameters  # noqa: E402
from meshtron.mpu.mesh import single_process_mesh  # noqa: E402
from meshtron.training.optim import build_optimizer  # noqa: E402
from meshtron.training.step import train_step  # noqa: E402

CONFIGS = {
    "gpt2": GPTConfig(arch="gpt2", num_layers=1, hidden_size=32, num_heads=2, vocab_size=200, seq_len=8),
    "llama": GPTConfig(
        arch="llama",
        num_layers=1,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=48,
        vocab_size=200,
        seq_len=8,
        tie_embeddings=False,
    ),
    "moe": GPTConfig(
        arch="llama",
        num_layers=1,
        hidden_size=32,
        num_heads=2,
        vocab_size=200,
        seq_len=8,
        num_experts=4,
        top_k=2,
        moe_ffn_hidden_size=16,
        aux_loss_coef=0.01,
        tie_embeddings=False,
    ),
}


def build_training(cfg: GPTConfig, backend: str):
    """(model, reducer, optimizer, mesh) of a single-process tiny model with `backend` kernels."""
    mesh = single_process_mesh()
    model = GPT(cfg, mesh, execution=ExecutionConfig(kernel_backend=backend))
    initialize_parameters(model, 11, mesh)
    reducer = DataParallelGradReducer(list(model.named_parameters()), mesh)
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, eps=1e-4)
    return model, reducer, optimizer, mesh


def one_step(cfg: GPTConfig, backend: str):
    model, reducer, optimizer, mesh = build_training(cfg, backend)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=torch.Generator().manual_seed(3))
    out = train_step(model, reducer, optimizer, [(tokens[:, :-1], tokens[:, 1:])], mesh, lr=1e-3, max_grad_norm=1.0)
    return out, {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", CONFIGS)
def test_triton_step_equals_torch_step(name):
    want, want_params = one_step(CONFIGS[name], "torch")
    got, got_params = one_step(CONFIGS[name], "triton")
    assert torch.allclose(got.loss, want.loss, rtol=1e-5)
    assert torch.allclose(got.grad_norm, want.grad_norm, rtol=1e-5)
    for param_name, (weight, grad) in want_params.items():
        g_weight, g_grad = got_params[param_name]
        assert torch.allclose(g_grad, grad, rtol=1e-4, atol=1e-6), f"grad {param_name}"
        assert torch.allclose(g_weight, weight, rtol=1e-5, atol=1e-6), f"weight {param_name}"


def _block(cfg: GPTConfig, backend: str) -> Block:
    """Block 0 of `cfg` with `backend` kernels, its parameters seeded alike for every backend."""
    block = Block(cfg, single_process_mesh(), 0, execution=ExecutionConfig(kernel_backend=backend))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2 + (1.0 if param.dim() == 1 else 0.0))
    return block


def _block_run(block: Block, cfg: GPTConfig, x: torch.Tensor, grad: torch.Tensor):
    """(output, input gradient, {parameter: gradient}) of one forward and backward of `block`."""
    x = x.detach().clone().requires_grad_(True)
    rope = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta, x.device) if cfg.position == "rope" else None
    out = block(x, rope)
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


def _unfused_forward(self, x, rope, doc_ids=None):
    """The block before the fusion: the residual add, then norm2 on its own."""
    p = self.cfg.dropout
    x = x + gpt._dropout(self.attn(self.norm1(x), rope, doc_ids), p, self.training, self.mesh)
    return x + gpt._dropout(self.mlp(self.norm2(x)), p, self.training, self.mesh)


def _block_inputs(cfg: GPTConfig):
    gen = torch.Generator().manual_seed(7)
    shape = (cfg.seq_len, 2, cfg.hidden_size)  # [s, b, h]
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_torch_block_is_bit_identical_to_the_unfused_block(name, monkeypatch):
    cfg = CONFIGS[name]
    x, grad = _block_inputs(cfg)
    want = _block_run(_block(cfg, "torch"), cfg, x, grad)
    monkeypatch.setattr(Block, "_forward", _unfused_forward)
    got = _block_run(_block(cfg, "torch"), cfg, x, grad)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for param, g in want[2].items():
        assert torch.equal(got[2][param], g), param


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_checked_block_runs_the_fused_residual_norm_and_equals_torch(name, monkeypatch):
    cfg = CONFIGS[name]
    kernel = "residual_layer_norm" if cfg.norm == "layernorm" else "residual_rms_norm"
    fused = getattr(norms, kernel)
    calls = {"triton": 0}

    def counted(*args, **kwargs):
        calls["triton"] += kwargs.get("backend") == "triton"
        return fused(*args, **kwargs)

    monkeypatch.setattr(norms, kernel, counted)
    selfcheck.reset()
    try:
        x, grad = _block_inputs(cfg)
        want = _block_run(_block(cfg, "torch"), cfg, x, grad)
        block = _block(cfg, CHECKED)
        first = _block_run(block, cfg, x, grad)  # the check (on clones), the real call on torch
        assert selfcheck.verdict(kernel) is True and calls["triton"] == 1
        assert selfcheck.local_result(kernel).error <= selfcheck.TOLERANCES["fp32"]
        block.zero_grad()
        got = _block_run(block, cfg, x, grad)  # now the fused kernel
        assert calls["triton"] == 2
    finally:
        selfcheck.reset()
    for run in (first, got):
        assert torch.allclose(run[0], want[0], rtol=1e-5, atol=1e-5)
        _assert_fp32_close(run[1], want[1], "input gradient")
        for param, g in want[2].items():
            _assert_fp32_close(run[2][param], g, param)


def _assert_fp32_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to fp32 summation order: within 1e-4 relative, or 4e-6 of the tensor's largest
    magnitude (a few ulps there; a gradient reduced over the batch's tokens in another order,
    as the fused norm's backward does, differs by that much where it is near zero)."""
    atol = 4e-6 * float(want.abs().max())
    worst = float(((got - want).abs() - 1e-4 * want.abs()).max())
    assert worst <= atol, f"{what}: off by {worst:.2e} beyond 1e-4 relative (allowed {atol:.2e})"
