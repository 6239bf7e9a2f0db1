"""The deduplicated MoE dispatch in one process: rows sent = distinct (token, destination ep
rank) pairs (counted by `plan_rows`, the planner the dispatcher sends by), and the row path
(one row per token and destination, the pairs' combine weights travelling with it) gives the
pair path's outputs and gradients. The multi-process checks are in
tests/distributed/moe_dispatch_cases.py."""

from __future__ import annotations

import copy

import pytest
import torch

from meshtron.moe.dispatcher import AllToAllDispatcher, gather_permuted, plan_rows
from meshtron.mpu.mesh import single_process_mesh
from tests.test_moe_layer import OpLog, _layer


def test_both_choices_on_one_rank_send_one_row():
    """8 experts on ep=4 ranks (2 each); token t picks experts 2*(t%4) and 2*(t%4)+1, both on
    rank t%4: T rows for 2T pairs, T/4 to each rank."""
    T, E, ep = 12, 8, 4
    t = torch.arange(T)
    pair_expert = torch.stack([2 * (t % ep), 2 * (t % ep) + 1], 1).reshape(-1)
    pair_token = t.repeat_interleave(2)
    plan = plan_rows(pair_expert, pair_token, T, E, ep)
    assert plan.rows_per_dest.tolist() == [T // ep] * ep
    assert plan.pairs_per_dest.tolist() == [2 * T // ep] * ep
    assert int(plan.rows_per_dest.sum()) == T  # the pair-per-row dispatcher sent 2T


@pytest.mark.parametrize("ep,top_k", [(2, 2), (4, 2), (4, 3), (8, 2)])
def test_rows_equal_distinct_token_destination_pairs(ep, top_k):
    """Random top-k routing, some pairs dropped: rows to rank d = #{tokens with a kept pair on
    d}, pairs to d = #{kept pairs on d}; every sorted pair's row, slot and token are consistent."""
    T, E = 64, 8
    gen = torch.Generator().manual_seed(ep * 10 + top_k)
    pair_expert = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)]).reshape(-1)
    pair_token = torch.arange(T).repeat_interleave(top_k)
    keep = torch.rand(T * top_k, generator=gen) > 0.2
    plan = plan_rows(pair_expert, pair_token, T, E, ep, keep)
    dest = pair_expert // (E // ep)
    want_rows = [len({int(tok) for tok, d, k in zip(pair_token, dest, keep) if k and d == r}) for r in range(ep)]
    want_pairs = [int(((dest == r) & keep).sum()) for r in range(ep)]
    assert plan.rows_per_dest.tolist() == want_rows
    assert plan.pairs_per_dest.tolist() == want_pairs
    kept = int(keep.sum())
    assert sum(want_rows) < kept or top_k == 1 or ep >= E  # some tokens had two choices on one rank
    order = plan.order[:kept]
    assert keep[order].all() and not keep[plan.order[kept:]].any()  # dropped pairs sort last
    row, slot = plan.row_of_pair[:kept], plan.slot_of_pair[:kept]
    assert torch.equal(plan.token_of_pair[:kept], pair_token[order])
    assert int(row.max()) + 1 == sum(want_rows)
    cells = row * top_k + slot
    assert cells.unique().numel() == kept and int(slot.max()) < min(top_k, E // ep)
    # one token and one destination per row (so rows = distinct pairs, counted above); rows
    # ordered by destination
    row_token = torch.zeros(sum(want_rows), dtype=torch.long).scatter(0, row, pair_token[order])
    row_dest = torch.zeros(sum(want_rows), dtype=torch.long).scatter(0, row, dest[order])
    assert torch.equal(row_token[row], pair_token[order]) and torch.equal(row_dest[row], dest[order])
    assert torch.all(row_dest.diff() >= 0)


@pytest.mark.parametrize("copies", [1, 3])
def test_gather_permuted_equals_index_select_without_scatter_adds(copies):
    """gather_permuted(x, index, inverse) = x[index] in value and gradient, for a permutation
    (copies 1) and for each row gathered `copies` times (the dropless dispatch, top_k copies);
    its backward gathers (and sums each row's copies): no index_add / scatter on the way."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 4, generator=gen)
    index = torch.arange(5).repeat_interleave(copies)[torch.randperm(5 * copies, generator=gen)]
    # inverse: positions in `index` ordered by (row, copy)
    inverse = torch.argsort(index, stable=True)
    grad = torch.randn(5 * copies, 4, generator=gen)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = a.index_select(0, index)
    want.backward(grad)

    got = gather_permuted(b, index, inverse)
    with OpLog() as log:
        got.backward(grad)
    assert torch.equal(got, want) and torch.allclose(b.grad, a.grad, atol=1e-6)
    assert not {"index_add", "index_add_", "scatter_add", "scatter_add_", "index_put"} & set(log.ops), log.ops


@pytest.mark.parametrize(
    "activation,top_k,capacity_factor,shared",
    [("gelu", 2, None, 0), ("swiglu", 2, 0.5, 1), ("swiglu", 3, None, 1), ("gelu", 1, 0.75, 0)],
)
def test_row_path_equals_pair_path(activation, top_k, capacity_factor, shared):
    """Forcing the row path (what ep/etp > 1 use) without communication: output and every
    gradient (input, router through the combine weights, experts, shared experts) equal the
    pair path's to 1e-6."""
    cfg, pairs = _layer(activation, capacity_factor, shared, top_k, seed=7)
    rows = copy.deepcopy(pairs)
    rows.dispatcher = AllToAllDispatcher(cfg.num_experts, top_k, single_process_mesh(), rows=True)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 3, 16, generator=gen)
    grad = torch.randn(8, 3, 16, generator=gen)
    results = []
    for layer in (pairs, rows):
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.backward(grad)
        results.append((out.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (out_a, gx_a, g_a), (out_b, gx_b, g_b) = results
    if capacity_factor is not None:
        assert pairs.last_dropped > 0, "the case should drop something"

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()

    assert rel(out_b, out_a) < 1e-6
    assert rel(gx_b, gx_a) < 1e-6
    assert g_a["router.weight"].abs().sum() > 0
    for name, g in g_a.items():
        assert rel(g_b[name], g) < 1e-6, name


@pytest.mark.parametrize("capacity_factor, chunks", [(None, 1), (0.5, 1), (None, 3), (0.5, 2)])
def test_after_the_host_sync_dispatch_issues_only_the_row_gather(monkeypatch, capacity_factor, chunks):
    """On a GPU the ops issued after a host sync run on a drained device, so the row path's
    dispatch builds every send buffer before its one sync (`host_sync`) and issues only the
    row gather afterwards (plus views; the all-to-all itself is no aten op over gloo/NCCL
    here: one process). Capacity drops included: their rows sort after the kept ones. With
    dispatch chunks: still one sync, then one row gather per chunk."""
    from meshtron.moe import dispatcher as dispatcher_module

    log = OpLog()
    real_sync = dispatcher_module.host_sync

    def marked_sync(counts):
        log.ops.append("HOST SYNC")
        return real_sync(counts)

    monkeypatch.setattr(dispatcher_module, "host_sync", marked_sync)
    cfg, layer = _layer("swiglu", capacity_factor, 0, 2, seed=7)
    layer.dispatcher = AllToAllDispatcher(cfg.num_experts, 2, single_process_mesh(), rows=True)
    layer.dispatch_chunks = chunks
    x = torch.randn(8, 3, 16, generator=torch.Generator().manual_seed(3))
    real_dispatch = layer.dispatcher.dispatch_chunks

    def logged_dispatch(*args, **kwargs):
        with log:
            return real_dispatch(*args, **kwargs)

    layer.dispatcher.dispatch_chunks = logged_dispatch
    layer(x)
    assert log.ops.count("HOST SYNC") == 1 and len(log.ops) > 10
    assert log.ops[log.ops.index("HOST SYNC") + 1 :] == ["index_select"] * chunks, " ".join(log.ops)
