"""A step whose loss or gradient norm is not finite is skipped: weights and optimizer state
are untouched and the next finite step proceeds; evaluation equals the direct formula."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.models.config import GPTConfig
from meshtron.models.gpt import GPT
from meshtron.mpu.init import initialize_parameters
from meshtron.mpu.mesh import single_process_mesh
from meshtron.training.optim import build_optimizer
from meshtron.training.step import evaluate, train_step

CFG = GPTConfig(num_layers=1, hidden_size=32, num_heads=2, vocab_size=256, seq_len=8)


def _setup():
    mesh = single_process_mesh()
    model = GPT(CFG, mesh)
    initialize_parameters(model, 0, mesh)
    reducer = DataParallelGradReducer(list(model.named_parameters()), mesh)
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    batch = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    return mesh, model, reducer, optimizer, [(batch[:, :-1], batch[:, 1:])]


def test_non_finite_step_is_skipped_and_the_next_one_runs():
    mesh, model, reducer, optimizer, micro = _setup()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    hook = model.layers["0"].mlp.register_forward_hook(lambda mod, inp, out: out * float("inf"))
    out = train_step(model, reducer, optimizer, micro, mesh, lr=1e-2, max_grad_norm=1.0)
    hook.remove()
    assert out.skipped is True and not torch.isfinite(out.loss)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), f"{name} changed in a skipped step"
    assert not optimizer.state, "the optimizer must not have taken a step"
    out = train_step(model, reducer, optimizer, micro, mesh, lr=1e-2, max_grad_norm=1.0)
    assert out.skipped is False and torch.isfinite(out.loss)
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_evaluate_is_the_mean_cross_entropy_without_gradients():
    mesh, model, _, _, micro = _setup()
    loss = evaluate([model], micro + micro, mesh)
    x, y = micro[0]
    with torch.no_grad():
        want = F.cross_entropy(model(x)[..., :256].reshape(-1, 256), y.reshape(-1))
    assert torch.allclose(loss, want, rtol=1e-6)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    assert model.training, "evaluate restores training mode"
