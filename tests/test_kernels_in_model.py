"""A whole training step with kernels.backend=triton (Triton interpreter on CPU) equals
kernels.backend=torch: losses, every gradient and the updated weights, for both model
families and an MoE model (fused norms, linear+activation, cross-entropy, grouped GEMM)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import pytest  # noqa: E402
import torch  # noqa: E402

from meshtron.dp.grad_reduce import DataParallelGradReducer  # noqa: E402
from meshtron.models.config import ExecutionConfig, GPTConfig  # noqa: E402
from meshtron.models.gpt import GPT  # noqa: E402
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
