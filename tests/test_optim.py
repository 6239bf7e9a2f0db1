"""training.optim / dp.adamw: weight-decay groups and torch's fused AdamW where it applies."""

from __future__ import annotations

import torch
from torch import nn

from meshtron.dp.adamw import adamw, fused_supported
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
        opt = (
            adamw([{"params": ps, "weight_decay": 0.1}], lr=1e-2, eps=1e-6)
            if fused
            else torch.optim.AdamW([{"params": ps, "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95), eps=1e-6)
        )
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


def _clip_then_step(fused: bool, max_norm: float, steps: int = 3):
    """Weights, the gradients after each step, and the norms of `steps` clipped updates of a
    tiny model through the TrainingOptimizer interface (`clip_grad_norm`, `update`)."""
    from meshtron.dp.adamw import ReplicatedAdamW
    from meshtron.mpu.mesh import single_process_mesh

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8))
    opt = ReplicatedAdamW(
        model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, fused=True if fused else None
    )
    # norms ~10x apart per step: the clipped update then differs from the unclipped one
    grads = [[torch.randn_like(p) * 3 * 10**i for p in model.parameters()] for i in range(steps)]
    seen, norms = [], []
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g.clone()
        norms.append(opt.clip_grad_norm([model], max_norm, single_process_mesh()))
        if fused:  # folded: the gradients are untouched until the update reads them
            assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), step_grads))
        opt.update(1e-2)
        seen.append([p.grad.clone() for p in model.parameters()])
    return list(model.parameters()), seen, norms, grads


def test_fused_adamw_folds_clipping_into_its_update():
    """The fused optimizer applies the clipping factor inside its kernel (grad_scale = 1/coef):
    the same weights as scaling the gradients in place first (the unfused path, which
    `scale_gradients` does now), within fp32 rounding, and the gradients left after the update
    are the clipped ones."""
    folded, folded_grads, norms, raw = _clip_then_step(fused=True, max_norm=1.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8))
    reference = adamw([{"params": list(model.parameters()), "weight_decay": 0.0}], lr=1e-2)
    for step_grads, norm, got_grads in zip(raw, norms, folded_grads):
        want_norm = torch.stack([g.norm() for g in step_grads]).norm()
        torch.testing.assert_close(norm, want_norm)
        coef = min(1.0, 1.0 / (float(want_norm) + 1e-6))
        assert coef < 0.5  # clipping is active in every step
        for p, g, got in zip(model.parameters(), step_grads, got_grads):
            p.grad = g * coef
            torch.testing.assert_close(got, p.grad, rtol=1e-6, atol=0)
        reference.step()
    for a, b in zip(folded, model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    unfused, unfused_grads, _, _ = _clip_then_step(fused=False, max_norm=1.0)
    for a, b in zip(folded, unfused):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fused_adamw_without_clipping_steps_on_the_raw_gradients():
    """max_norm <= 0 disables clipping: nothing is folded, the update is bit for bit torch's."""
    got, got_grads, _, raw = _clip_then_step(fused=True, max_norm=0.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8))
    reference = adamw([{"params": list(model.parameters()), "weight_decay": 0.0}], lr=1e-2)
    for step_grads, seen in zip(raw, got_grads):
        for p, g, s in zip(model.parameters(), step_grads, seen):
            p.grad = g.clone()
            assert torch.equal(s, g)
        reference.step()
    assert all(torch.equal(a, b) for a, b in zip(got, model.parameters()))
