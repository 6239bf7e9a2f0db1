"""MoE router math (top-k gating, Switch aux loss, z-loss, aux-free bias) and expert capacity.

Single process. Multi-rank behaviour is simulated honestly with `FakeGroup`: each "rank"
runs the real code in its own thread and the patched stats collectives exchange the
tensors the ranks actually pass in (a barrier per call), exactly like a real all-reduce /
all-gather would.
"""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch

from meshtron.moe import capacity as capacity_module
from meshtron.moe.capacity import capacity_for, capacity_keep_mask
from meshtron.moe.router import RouterOutput, TopKRouter


class FakeGroup:
    """A process group of `world` threads; `run` starts one thread per rank."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.local = threading.local()
        self.calls = 0

    def rank(self) -> int:
        return self.local.rank

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.rank()] = x.detach().clone()
        self.barrier.wait()
        out = [s.clone() for s in self.slots]
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        if self.rank() == 0:
            self.calls += 1
        return out

    def all_reduce_stats(self, x, group, op="sum"):
        assert group is self, "the stats collective must go over the group passed in"
        vals = self._exchange(x)
        return torch.stack(vals).sum(0) if op == "sum" else torch.stack(vals).amax(0)

    def all_gather_stats(self, x, group):
        assert group is self, "the stats collective must go over the group passed in"
        return torch.stack(self._exchange(x))

    def group_rank(self, group):
        assert group is self
        return self.rank()

    def run(self, fns):
        results, errors = [None] * self.world, []

        def body(r):
            self.local.rank = r
            try:
                results[r] = fns[r]()
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def router_with_weight(weight: torch.Tensor, top_k: int, **kw) -> TopKRouter:
    E, h = weight.shape
    r = TopKRouter(h, E, top_k, **kw)
    with torch.no_grad():
        r.weight.copy_(weight)
    return r


# ---------------------------------------------------------------- hand-computed losses


def test_aux_and_z_loss_by_hand():
    # W = I (3 experts, hidden 3), so logits = x. Each row is log(p) + c_t: softmax(row) = p
    # exactly and logsumexp(row) = log(sum p) + c_t = c_t.
    p = torch.tensor(
        [
            [0.50, 0.25, 0.25],  # -> expert 0
            [0.25, 0.50, 0.25],  # -> expert 1
            [0.60, 0.20, 0.20],  # -> expert 0
            [0.20, 0.20, 0.60],
        ]
    )  # -> expert 2
    c = torch.tensor([1.0, 2.0, 0.0, -1.0])
    x = p.log() + c[:, None]
    r = router_with_weight(torch.eye(3), top_k=1, aux_loss_coef=0.5, z_loss_coef=0.25)
    out = r(x, None)
    assert isinstance(out, RouterOutput)
    assert out.topk_idx.tolist() == [[0], [1], [0], [2]]
    # f = counts / (T*k) = [2, 1, 1] / 4 = [0.5, 0.25, 0.25]
    # P = column means of p = [1.55, 1.15, 1.30] / 4 = [0.3875, 0.2875, 0.325]
    # aux = E * sum f*P = 3 * (0.19375 + 0.071875 + 0.08125) = 3 * 0.346875 = 1.040625
    assert out.aux_value.item() == pytest.approx(1.040625, abs=1e-6)
    assert out.aux_loss.item() == pytest.approx(0.5 * 1.040625, abs=1e-6)
    # z = mean(lse^2) = mean(c^2) = (1 + 4 + 0 + 1) / 4 = 1.5
    assert out.z_value.item() == pytest.approx(1.5, abs=1e-6)
    assert out.z_loss.item() == pytest.approx(0.25 * 1.5, abs=1e-6)
    assert out.tokens_per_expert.tolist() == [2.0, 1.0, 1.0]
    assert out.num_tokens.item() == 4
    # k=1 with renormalize: the single weight is 1
    assert torch.allclose(out.topk_weight, torch.ones(4, 1))


def test_num_microbatches_and_zero_coefficients():
    torch.manual_seed(0)
    x = torch.randn(10, 8)
    r = TopKRouter(8, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.01)
    a = r(x, None)
    b = r(x, None, num_microbatches=4)
    assert torch.allclose(b.aux_loss * 4, a.aux_loss) and torch.allclose(b.z_loss * 4, a.z_loss)
    assert torch.allclose(a.aux_value, b.aux_value)  # value: no coefficient, no division
    r0 = TopKRouter(8, 4, 2)
    r0.load_state_dict(r.state_dict())
    o = r0(x, None)
    assert o.aux_loss.item() == 0.0 and o.z_loss.item() == 0.0 and o.aux_loss.dim() == 0
    assert torch.allclose(o.aux_value, a.aux_value) and torch.allclose(o.z_value, a.z_value)


def closed_form_aux(x, w, k):
    probs = torch.softmax(x @ w.t(), dim=-1)
    idx = probs.topk(k, dim=-1).indices
    E = w.shape[0]
    f = torch.zeros(E).index_add_(0, idx.reshape(-1), torch.ones(idx.numel())) / idx.numel()
    return E * (f * probs.mean(0)).sum()


def test_aux_gradient_matches_closed_form():
    torch.manual_seed(1)
    x = torch.randn(16, 8)
    w = torch.randn(4, 8)
    r = router_with_weight(w, top_k=2, aux_loss_coef=1.0)
    out = r(x, None)
    out.aux_loss.backward()
    w_ref = w.clone().requires_grad_(True)
    ref = closed_form_aux(x, w_ref, 2)
    ref.backward()
    assert torch.allclose(out.aux_loss, ref, atol=1e-6)
    assert torch.allclose(r.weight.grad, w_ref.grad, atol=1e-6)


def test_sigmoid_aux_uses_per_token_normalized_scores():
    torch.manual_seed(7)
    x, w = torch.randn(12, 8), torch.randn(4, 8)
    out = router_with_weight(w, 2, score="sigmoid", bias_update_rate=0.1)(x, None)
    s = torch.sigmoid(x @ w.t())
    P = (s / s.sum(-1, keepdim=True)).mean(0)
    f = torch.zeros(4).index_add_(0, out.topk_idx.reshape(-1), torch.ones(24)) / 24
    assert torch.allclose(out.aux_value, 4 * (f * P).sum(), atol=1e-6)
    assert torch.equal(out.topk_idx, s.topk(2, dim=-1).indices)  # bias is still zero


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_two_ranks_sum_to_full_batch(score):
    torch.manual_seed(2)
    x = torch.randn(16, 8)
    full = TopKRouter(8, 4, 2, score=score, aux_loss_coef=1.0, z_loss_coef=1.0)
    ranks = [copy.deepcopy(full) for _ in range(2)]

    xf = x.clone().requires_grad_(True)
    ref = full(xf, None)
    (ref.aux_loss + ref.z_loss + ref.topk_weight.sum()).backward()

    group = FakeGroup(2)
    for rank in ranks:
        rank.reduce_stats = group.all_reduce_stats  # the router's all-reduce hook
    halves = [x[:8].clone().requires_grad_(True), x[8:].clone().requires_grad_(True)]
    outs = group.run([lambda r=r: ranks[r](halves[r], group) for r in range(2)])
    assert group.calls == 1, "one stats all-reduce per forward"
    for o in outs:
        (o.aux_loss + o.z_loss + o.topk_weight.sum()).backward()

    # contributions sum to the global losses; global values are the same on both ranks
    assert torch.allclose(outs[0].aux_loss + outs[1].aux_loss, ref.aux_loss, atol=1e-6)
    assert torch.allclose(outs[0].z_loss + outs[1].z_loss, ref.z_loss, atol=1e-6)
    for o in outs:
        assert torch.allclose(o.aux_value, ref.aux_value, atol=1e-6)
        assert torch.allclose(o.z_value, ref.z_value, atol=1e-6)
        assert torch.equal(o.tokens_per_expert, ref.tokens_per_expert)
        assert o.num_tokens.item() == 16
    assert torch.equal(torch.cat([o.topk_idx for o in outs]), ref.topk_idx)
    assert torch.allclose(torch.cat([o.topk_weight for o in outs]), ref.topk_weight)
    # gradients summed over the group == single-process gradient
    assert torch.allclose(ranks[0].weight.grad + ranks[1].weight.grad, full.weight.grad, atol=1e-6)
    assert torch.allclose(torch.cat([h.grad for h in halves]), xf.grad, atol=1e-6)


# ---------------------------------------------------------------- gating


def test_softmax_renormalize_vs_raw():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]])
    x = p.log()
    raw = router_with_weight(torch.eye(3), 2, renormalize=False)(x, None)
    ren = router_with_weight(torch.eye(3), 2, renormalize=True)(x, None)
    assert raw.topk_idx.tolist() == [[0, 1], [2, 1]] == ren.topk_idx.tolist()
    assert torch.allclose(raw.topk_weight, torch.tensor([[0.5, 0.3], [0.7, 0.2]]))
    assert torch.allclose(ren.topk_weight, torch.tensor([[0.5 / 0.8, 0.3 / 0.8], [0.7 / 0.9, 0.2 / 0.9]]))


def test_sigmoid_weights_normalized_over_chosen_k():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    out = router_with_weight(torch.eye(4), 2, score="sigmoid")(x, None)
    s = torch.sigmoid(x[0])
    assert out.topk_idx.tolist() == [[0, 1]]
    assert torch.allclose(out.topk_weight[0], s[:2] / s[:2].sum())
    with pytest.raises(ValueError, match="renormalize"):
        TopKRouter(4, 4, 2, score="sigmoid", renormalize=False)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_bias_changes_selection_not_weights(score):
    x = torch.tensor([[2.0, 1.0, 0.0]])
    r = router_with_weight(torch.eye(3), 2, score=score, bias_update_rate=0.1)
    assert r(x, None).topk_idx.tolist() == [[0, 1]]
    r.expert_bias.copy_(torch.tensor([0.0, 0.0, 1.0]))  # expert 2 now beats both on selection
    out = r(x, None)
    assert out.topk_idx.tolist() == [[2, 0]]
    s = torch.softmax(x[0], -1) if score == "softmax" else torch.sigmoid(x[0])
    chosen = torch.stack([s[2], s[0]])
    assert torch.allclose(out.topk_weight[0], chosen / chosen.sum())  # bias-free scores


def test_softmax_without_bias_rate_ignores_bias():
    x = torch.tensor([[2.0, 1.0, 0.0]])
    r = router_with_weight(torch.eye(3), 1)
    r.expert_bias.fill_(5.0)
    r.expert_bias[2] = 10.0
    assert r(x, None).topk_idx.tolist() == [[0]]


def test_ties_go_to_lower_expert_index():
    r = router_with_weight(torch.zeros(6, 4), 3)
    out = r(torch.randn(5, 4), None)
    assert out.topk_idx.tolist() == [[0, 1, 2]] * 5
    assert torch.allclose(out.topk_weight, torch.full((5, 3), 1 / 3))


def test_fp32_math_and_leading_dims():
    r = TopKRouter(8, 4, 2, dtype=torch.bfloat16, z_loss_coef=1.0)
    x = torch.randn(3, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    out = r(x, None)
    assert out.topk_idx.shape == (3, 5, 2) and out.topk_idx.dtype == torch.long
    assert out.topk_weight.dtype == torch.float32 and out.z_loss.dtype == torch.float32
    out.topk_weight.sum().backward()
    assert x.grad is not None and r.weight.grad is not None


def test_router_computes_in_fp32_under_autocast():
    """The gate GEMM runs in fp32 under autocast too: choices, weights and losses equal the
    fp32 router's exactly (a bf16 gate GEMM would round the logits)."""
    torch.manual_seed(4)
    r = TopKRouter(32, 8, 2, aux_loss_coef=0.1, z_loss_coef=0.01)
    x = torch.randn(64, 32)
    want = r(x, None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = r(x, None)
    assert got.topk_weight.dtype == torch.float32
    assert torch.equal(got.topk_idx, want.topk_idx) and torch.equal(got.topk_weight, want.topk_weight)
    assert torch.equal(got.aux_loss, want.aux_loss) and torch.equal(got.z_loss, want.z_loss)


def test_forward_is_route_then_statistics():
    """`forward` = `statistics(route(x))`, the two halves the MoE layer calls apart."""
    torch.manual_seed(5)
    r = TopKRouter(16, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.01)
    x = torch.randn(6, 3, 16)
    whole = r(x, None, 2, per_sequence=True)
    routing = r.route(x)
    halves = r.statistics(routing, None, 2, per_sequence=True)
    assert routing.topk_idx.shape == (6, 3, 2) and torch.equal(halves.topk_idx, whole.topk_idx)
    for name in ("topk_weight", "aux_loss", "z_loss", "aux_value", "z_value", "tokens_per_expert", "set_counts"):
        assert torch.equal(getattr(halves, name), getattr(whole, name)), name
    with pytest.raises(ValueError, match=r"per-sequence statistics need tokens \[s, b, h\]"):
        r.statistics(r.route(x.view(18, 16)), None, per_sequence=True)


# ---------------------------------------------------------------- aux-loss-free bias


def test_update_expert_bias_exact():
    r = TopKRouter(4, 4, 1, bias_update_rate=0.1)
    r.step_load.copy_(torch.tensor([10.0, 2.0, 6.0, 6.0]))  # mean 6: sign(6 - load) = [-1, 1, 0, 0]
    r.update_expert_bias()
    assert r.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    assert r.step_load.tolist() == [0.0] * 4
    r.step_load.copy_(torch.tensor([1.0, 1.0, 1.0, 5.0]))  # mean 2: [+1, +1, +1, -1]
    r.update_expert_bias()
    assert r.expert_bias.tolist() == pytest.approx([0.0, 0.2, 0.1, -0.1])


def test_step_load_accumulates_only_in_training_and_rate_zero_keeps_bias():
    torch.manual_seed(3)
    r = TopKRouter(8, 4, 2)
    x = torch.randn(6, 8)
    o1, o2 = r(x, None), r(x, None)
    assert torch.equal(r.step_load, o1.tokens_per_expert + o2.tokens_per_expert)
    assert r.step_load.sum().item() == 2 * 6 * 2
    r.eval()
    r(x, None)
    assert r.step_load.sum().item() == 24
    r.update_expert_bias()
    assert r.step_load.sum().item() == 0 and r.expert_bias.abs().sum().item() == 0
    sd = r.state_dict()
    assert "expert_bias" in sd and "step_load" not in sd
    assert r.weight.tp_shard_dim is None and callable(r.weight.init_fn)


# ---------------------------------------------------------------- capacity


def brute_force_keep(idx: torch.Tensor, E: int, cap: int) -> torch.Tensor:
    s, b, k = idx.shape
    keep = torch.zeros(s, b, k, dtype=torch.bool)
    for bi in range(b):
        used = [0] * E
        for j in range(k):
            for t in range(s):
                e = int(idx[t, bi, j])
                keep[t, bi, j] = used[e] < cap
                used[e] += 1
    return keep


def test_capacity_by_hand():
    # seq 6, b=1, k=2, E=3, capacity 2. Rows: (first choice, second choice) per position.
    idx = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 1], [2, 1], [1, 0]]).unsqueeze(1)
    keep = capacity_keep_mask(idx, 3, 2, None)
    # First choices, in sequence order:
    #   t0->e0 (e0 #0 keep), t1->e0 (e0 #1 keep), t2->e1 (e1 #0 keep),
    #   t3->e0 (e0 #2 DROP: e0 full), t4->e2 (e2 #0 keep), t5->e1 (e1 #1 keep)
    # Then second choices, in sequence order:
    #   t0->e1 (e1 #2 DROP: t2, t5 first choices came first though later in the sequence),
    #   t1->e2 (e2 #1 keep), t2->e0 (e0 #3 DROP), t3->e1 (#3 DROP), t4->e1 (#4 DROP), t5->e0 (#4 DROP)
    assert keep[:, 0, 0].tolist() == [True, True, True, False, True, True]
    assert keep[:, 0, 1].tolist() == [False, True, False, False, False, False]
    assert torch.equal(keep, brute_force_keep(idx, 3, 2))


def test_capacity_random_matches_brute_force():
    g = torch.Generator().manual_seed(4)
    for cap in (0, 1, 3, 100):
        idx = torch.rand(20, 3, 8, generator=g).argsort(-1)[..., :2]  # distinct experts per token
        assert torch.equal(capacity_keep_mask(idx, 8, cap, None), brute_force_keep(idx, 8, cap))


def test_capacity_samples_are_independent():
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, 4, (10, 1, 2), generator=g)
    b1 = torch.randint(0, 4, (10, 1, 2), generator=g)
    b2 = torch.zeros(10, 1, 2, dtype=torch.long)  # sample 2 floods expert 0
    alone_a = capacity_keep_mask(a, 4, 2, None)
    alone_b1 = capacity_keep_mask(b1, 4, 2, None)
    for other in (b1, b2):
        both = capacity_keep_mask(torch.cat([a, other], dim=1), 4, 2, None)
        assert torch.equal(both[:, :1], alone_a)
    assert torch.equal(capacity_keep_mask(torch.cat([a, b1], 1), 4, 2, None)[:, 1:], alone_b1)


@pytest.mark.parametrize("world", [2, 3])
def test_capacity_sharded_equals_full(monkeypatch, world):
    g = torch.Generator().manual_seed(6)
    s_local, b, k, E, cap = 4, 3, 2, 4, 3
    idx = torch.rand(world * s_local, b, E, generator=g).argsort(-1)[..., :k]
    full = capacity_keep_mask(idx, E, cap, None)
    assert not full.all(), "the case must drop something to be meaningful"

    group = FakeGroup(world)
    monkeypatch.setattr(capacity_module, "all_gather_stats", group.all_gather_stats)
    monkeypatch.setattr(capacity_module, "group_rank", group.group_rank)
    shards = idx.chunk(world, dim=0)
    masks = group.run([lambda r=r: capacity_keep_mask(shards[r], E, cap, group) for r in range(world)])
    assert group.calls == 1, "one stats all-gather per call"
    assert torch.equal(torch.cat(masks, dim=0), full)


def test_capacity_for():
    assert capacity_for(64, 8, 2, 1.0) == 16
    assert capacity_for(64, 8, 2, 1.25) == 20
    assert capacity_for(10, 4, 1, 1.0) == 3  # ceil(2.5)
    assert capacity_for(100, 10, 1, 1.1) == 11  # not 12 from 1.1 * 100 = 110.00000000000001
    assert capacity_for(7, 3, 2, 0.5) == math.ceil(0.5 * 7 * 2 / 3)
    with pytest.raises(ValueError):
        capacity_for(8, 4, 2, 0.0)
