"""training.optim / mpu.adamw: weight-decay groups and torch's fused AdamW where it applies."""

from __future__ import annotations

import torch
from torch import nn

from meshtron.mpu.adamw import adamw, fused_supported
from meshtron.training.optim import build_optimizer


def test_build_optimizer_is_fused_with_decay_on_matrices_only():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert [p.ndim for p in decay["params"]] == [2] and decay["weight_decay"] == 0.1
    assert all(p.ndim == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert all(g["fused"] for g in opt.param_groups)


def test_fused_matches_the_single_tensor_update_within_rounding():
    torch.manual_seed(0)
    params = [torch.randn(64, 32), torch.randn(32)]
    grads = [torch.randn_like(p) for p in params]
    results = []
    for fused in (True, False):
        ps = [nn.Parameter(p.clone()) for p in params]
        opt = adamw([{"params": ps, "weight_decay": 0.1}], lr=1e-2, eps=1e-6) if fused else \
            torch.optim.AdamW([{"params": ps, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-6)
        assert bool(opt.param_groups[0]["fused"]) is fused
        for _ in range(5):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            opt.step()
        results.append(ps)
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_fused_supported():
    assert fused_supported([torch.zeros(2)])
    assert not fused_supported([])
    assert not fused_supported([torch.zeros(2, device="meta")])
