"""Many small experts (issue 40, fine-grained MoE: 64-256 experts, top-8): no per-expert Python
loop on the MoE layer's hot path.

The proof is an op count: every aten op one MoELayer forward + backward dispatches (a
TorchDispatchMode sees each op the host issues, views included, in forward and in the
autograd engine's backward) is counted on the same tokens at 8, 64 and 256 experts, top-8,
dropless and with a capacity, on the pair path (ep = etp = 1) and the row path (forced): the
counts must be equal, so nothing in routing-after-the-router, capacity, the dispatch
permutation, the grouped GEMM or the combine runs once per expert. A planted per-expert loop
(the grouped GEMM as one matmul per expert) must make the count grow: the counter can see one.

What the count does not see: work inside one aten op. On the CPU, torch 2.13's `_grouped_mm`
kernel itself loops over the groups in C++ (one `mm` per group and direction); on CUDA in
bf16 it is one CUTLASS grouped GEMM. bench/moe_many_experts.py measures what that costs.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.models.config import GPTConfig
from meshtron.moe import experts as experts_module
from meshtron.moe.capacity import capacity_keep_mask
from meshtron.moe.dispatcher import AllToAllDispatcher
from meshtron.moe.layer import MoELayer
from meshtron.mpu.init import initialize_parameters
from meshtron.mpu.mesh import single_process_mesh

EXPERTS = (8, 64, 256)
TOP_K = 8
TOKENS, HIDDEN, FFN = 64, 32, 16  # FFN a multiple of 4: fp32 rows of 16-byte multiples (grouped_mm)


class OpCount(TorchDispatchMode):
    """Counts every aten op dispatched inside it, by name."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _layer(num_experts: int, capacity_factor: float | None, rows: bool) -> MoELayer:
    cfg = GPTConfig(
        arch="llama",
        num_layers=1,
        hidden_size=HIDDEN,
        num_heads=2,
        num_experts=num_experts,
        top_k=TOP_K,
        moe_ffn_hidden_size=FFN,
        capacity_factor=capacity_factor,
        seq_len=TOKENS,
    )
    mesh = single_process_mesh()
    layer = MoELayer(cfg.moe(), mesh)
    initialize_parameters(layer, 7, mesh)
    if rows:
        layer.dispatcher = AllToAllDispatcher(num_experts, TOP_K, mesh, rows=True)
    return layer


def count_step(layer: MoELayer) -> OpCount:
    """The aten ops of one forward + backward (input and every weight, aux-loss term included)
    on the same tokens whatever the layer's expert count."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(TOKENS, 1, HIDDEN, generator=gen).requires_grad_(True)
    gy = torch.randn(x.shape, generator=gen)
    out = layer(x)  # a first step outside the count: one-time work (caches) is not per step
    torch.autograd.backward([out, layer.last_router.aux_loss], [gy, torch.ones(())])
    layer.zero_grad(set_to_none=True)
    with OpCount() as count:
        out = layer(x)
        torch.autograd.backward([out, layer.last_router.aux_loss], [gy, torch.ones(())])
    return count


@pytest.mark.parametrize("rows", [False, True], ids=["pairs", "rows"])
@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
def test_op_count_does_not_grow_with_experts(capacity_factor, rows):
    """The same ops at 8, 64 and 256 experts, top-8, on the same tokens. One exception, not a
    growth: at 8 experts top-8 takes every expert, so the router's `sort(...)[:, :k].contiguous()`
    is a full view (an `alias`, no copy) where from 9 experts up it is a `slice` and a `clone`.
    Measured 2026-11-28 (torch 2.13, CPU), at 64 and 256 experts: 149 ops pairs dropless, 183
    pairs with capacity (291 before the capacity mask lost its loop over the k choices), 231
    rows dropless, 266 rows with capacity (one fewer each at 8 experts)."""
    counts = {e: count_step(_layer(e, capacity_factor, rows)).ops for e in EXPERTS}
    assert counts[64] == counts[256], "op count grows with the expert count"
    at_8 = dict(counts[8])
    at_8["alias"] -= 1
    at_8["slice"] += 1
    at_8["clone"] = at_8.get("clone", 0) + 1
    assert {k: v for k, v in at_8.items() if v} == counts[64]
    assert counts[256]["_grouped_mm"] == 9  # 3 GEMMs, forward + dx + dW each


def test_planted_per_expert_loop_is_seen(monkeypatch):
    """The counter catches a per-expert loop: the grouped GEMM as one matmul per expert (the
    reference loop a torch path could fall back to) makes the count grow with the experts."""

    def looped(x, weight, group_sizes, backend="torch", offsets=None):
        outs, start = [], 0
        for g, n in enumerate(group_sizes.tolist()):
            outs.append(x[start : start + n] @ weight[g])
            start += n
        return torch.cat(outs)

    monkeypatch.setattr(experts_module, "grouped_matmul", looped)
    totals = {e: count_step(_layer(e, None, False)).total for e in (8, 64)}
    assert totals[64] > totals[8] + 3 * (64 - 8), totals


def _capacity_loop_reference(topk_idx: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """The keep mask as capacity_keep_mask computed it before (2026-11-28): one one-hot per
    choice, a Python loop over the k choices, whole sequence local."""
    s, b, k = topk_idx.shape
    before_local, counts = [], []
    for j in range(k):
        hot = torch.zeros(s, b, num_experts, dtype=torch.int64)
        hot.scatter_(-1, topk_idx[:, :, j : j + 1], 1)
        cum = hot.cumsum(dim=0)
        before_local.append(cum - hot)
        counts.append(cum[-1] if s > 0 else hot.sum(dim=0))
    total = torch.stack(counts, dim=1)
    offset = total.cumsum(dim=1) - total
    keep = torch.empty(s, b, k, dtype=torch.bool)
    for j in range(k):
        pos = before_local[j] + offset[:, j].unsqueeze(0)
        keep[:, :, j] = pos.gather(-1, topk_idx[:, :, j : j + 1]).squeeze(-1) < capacity
    return keep


@pytest.mark.parametrize("num_experts,top_k,capacity", [(8, 2, 3), (64, 8, 2), (256, 8, 1), (4, 4, 5), (8, 2, 0)])
def test_capacity_mask_equals_the_per_choice_loop(num_experts, top_k, capacity):
    """The vectorized keep mask (all k choices in one [s, b, k, E] one-hot) equals the old
    per-choice loop bit for bit, skewed routing included (many pairs over capacity)."""
    gen = torch.Generator().manual_seed(num_experts + top_k)
    s, b = 40, 3
    scores = torch.rand(s, b, num_experts, generator=gen) + torch.linspace(1, 0, num_experts)  # skewed
    topk_idx = scores.topk(top_k, dim=-1).indices
    got = capacity_keep_mask(topk_idx, num_experts, capacity, None)
    assert torch.equal(got, _capacity_loop_reference(topk_idx, num_experts, capacity))
    empty = topk_idx[:0]
    assert capacity_keep_mask(empty, num_experts, capacity, None).shape == (0, b, top_k)
