"""The planner measures the model instead of copying it (planning/activations.py): what a
module saves for backward reaches the plan without any edit to planning/plan.py, and the
traced saved bytes equal a real run's, sequence parallelism included."""

from __future__ import annotations

import pytest
import torch

from meshtron.models import gpt
from meshtron.models.config import ExecutionConfig
from meshtron.moe import experts
from meshtron.mpu.mesh import ParallelConfig
from meshtron.planning.activations import clear_trace_cache
from meshtron.planning.plan import chunk_activations, plan_rank
from tests.test_plan import gpt2_tiny, llama_tiny

EXTRA = 1000  # fp32 elements the patched module saves: 4000 bytes


class _SavesExtra(torch.autograd.Function):
    """Identity that saves one new fp32 tensor of `elements` for backward."""

    @staticmethod
    def forward(ctx, x, elements):
        ctx.save_for_backward(x.new_empty(elements, dtype=torch.float32))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@pytest.fixture(autouse=True)
def _fresh_traces():
    """Traces are cached per config; a patched module must be traced anew, and forgotten after."""
    clear_trace_cache()
    yield
    clear_trace_cache()


def _save_extra(monkeypatch, module_class) -> None:
    """Make every `module_class` forward also save EXTRA fp32 elements for backward."""
    forward = module_class.forward
    monkeypatch.setattr(
        module_class, "forward", lambda self, *args, **kw: _SavesExtra.apply(forward(self, *args, **kw), EXTRA)
    )
    clear_trace_cache()


def _plan(cfg, par: ParallelConfig, world: int, rank: int, **kw) -> dict:
    return plan_rank(cfg, par, world, rank, micro_batch_size=2, global_batch_size=8, **kw)["memory"]


def test_dense_mlp_change_reaches_the_plan(monkeypatch):
    cfg = gpt2_tiny()
    before = _plan(cfg, ParallelConfig(tp=2, sp=True), 4, 0)
    _save_extra(monkeypatch, gpt.MLP)
    after = _plan(cfg, ParallelConfig(tp=2, sp=True), 4, 0)
    grown = after["bytes"]["activations_per_microbatch"] - before["bytes"]["activations_per_microbatch"]
    assert grown == cfg.num_layers * 4 * EXTRA
    assert after["activation_terms"][0]["layer_mlp"] - before["activation_terms"][0]["layer_mlp"] == grown


def test_expert_change_reaches_the_plan_of_moe_layers_only(monkeypatch):
    cfg = llama_tiny(num_layers=4, num_experts=4, top_k=2, moe_every=2, ffn_hidden_size=128)
    before = _plan(cfg, ParallelConfig(tp=2, ep=2), 4, 1)
    _save_extra(monkeypatch, experts.GroupedExperts)
    after = _plan(cfg, ParallelConfig(tp=2, ep=2), 4, 1)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert moe_layers == 2
    grown = after["bytes"]["activations_per_microbatch"] - before["bytes"]["activations_per_microbatch"]
    assert grown == moe_layers * 4 * EXTRA


def test_change_scales_with_microbatches_in_flight(monkeypatch):
    """1F1B on pp=2: the first stage holds 2 layers of 2 microbatches at its peak."""
    cfg = gpt2_tiny(num_layers=4)
    par = ParallelConfig(pp=2)
    before = _plan(cfg, par, 2, 0)
    _save_extra(monkeypatch, gpt.MLP)
    after = _plan(cfg, par, 2, 0)
    assert before["microbatches_in_flight"] == after["microbatches_in_flight"] == 2
    per_microbatch = 2 * 4 * EXTRA  # this stage's 2 layers
    assert (
        after["bytes"]["activations_per_microbatch"] - before["bytes"]["activations_per_microbatch"] == per_microbatch
    )
    assert after["bytes"]["activations_peak"] - before["bytes"]["activations_peak"] == 2 * per_microbatch


@pytest.mark.parametrize("cfg,recompute", [(gpt2_tiny(dropout=0.1), "none"), (llama_tiny(num_kv_heads=2), "selective")])
def test_sequence_parallel_trace_shards_the_sequence(cfg, recompute):
    """Under SP the norms, residual dropout and block input hold s/tp tokens (the virtual mesh's
    collectives gather and scatter shapes); attention and MLP work on the gathered sequence."""
    kw = dict(
        layers=range(cfg.num_layers),
        pre_process=True,
        post_process=True,
        tp=2,
        execution=ExecutionConfig(recompute=recompute),
    )
    plain, sp = chunk_activations(cfg, 2, **kw), chunk_activations(cfg, 2, sp=True, **kw)
    for term in ("layer_norm1", "layer_norm2", "final_norm", "layer_block"):
        assert 2 * sp.terms.get(term, 0) == plain.terms.get(term, 0), term
    assert "head" not in plain.terms  # the fused LM loss (default): the head's saved tensors are the loss's
    for term in ("layer_attn", "loss"):
        assert sp.terms[term] == plain.terms[term], term
