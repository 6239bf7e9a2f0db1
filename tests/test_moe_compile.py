"""The dropless MoE block at ep = 1 compiles whole (`torch.compile(fullgraph=True)`: no graph
break, no host sync) and the compiled forward + backward equals eager: output, input and
weight gradients, balancing statistics. That is what `bench/moe_layer.py --compile` times on a
GPU (fused elementwise kernels; CUDA graphs with mode="reduce-overhead"). bf16, because the
meta function of torch's grouped GEMM accepts only bf16 (eager fp32 runs on the CPU)."""

from __future__ import annotations

import pytest
import torch

from meshtron.models.config import GPTConfig
from meshtron.moe.counts import add_counts
from meshtron.moe.layer import MoELayer
from meshtron.mpu.init import initialize_parameters
from meshtron.mpu.mesh import single_process_mesh


def _run(layer, fn, x, gy):
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    routed = layer.last_router
    torch.autograd.backward([out, routed.aux_loss + routed.z_loss], [gy, torch.ones((), dtype=out.dtype)])
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters()}
    for p in layer.parameters():
        p.grad = None
    stats = (routed.aux_value, routed.z_value, routed.tokens_per_expert)
    return out.detach(), x.grad, grads, stats


@pytest.mark.timeout(300)
def test_dropless_block_compiles_whole_and_equals_eager():
    cfg = GPTConfig(arch="llama", hidden_size=64, num_heads=2, num_experts=8, top_k=2, moe_ffn_hidden_size=32,
                    shared_experts=1, seq_len=32, aux_loss_coef=0.01, z_loss_coef=0.001)
    mesh = single_process_mesh()
    layer = MoELayer(cfg.moe(), mesh)
    initialize_parameters(layer, 5, mesh)
    layer = layer.bfloat16().train()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 2, 64, generator=gen).bfloat16()
    gy = torch.randn(32, 2, 64, generator=gen).bfloat16()
    want = _run(layer, layer, x, gy)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)  # raises on any graph break
    got = _run(layer, compiled, x, gy)
    torch._dynamo.reset()

    def close(a, b):
        return torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())

    assert close(got[0], want[0]) and close(got[1], want[1])
    assert want[2].keys() == got[2].keys() and all(close(got[2][n], want[2][n]) for n in want[2])
    assert torch.equal(got[3][2], want[3][2])  # expert counts: exact
    assert close(got[3][0], want[3][0]) and close(got[3][1], want[3][1])


def test_add_counts_counts_every_index():
    idx = torch.tensor([3, 0, 3, 1, 3])
    assert add_counts(torch.zeros(5, dtype=torch.long), idx).tolist() == [1, 1, 0, 3, 0]
    assert add_counts(torch.ones(4, dtype=torch.float64), idx[idx < 4]).tolist() == [2.0, 2.0, 1.0, 4.0]
