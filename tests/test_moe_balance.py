"""Load-balancing options of the MoE router: aux-loss scopes (per microbatch, per sequence,
global) and group-limited routing, against hand-computed values and per-token formulas.
Layout invariance of each scope is proven with real process groups in
tests/distributed/moe_cases.py; here `FakeGroup` threads stand in for the tp sequence shards."""

from __future__ import annotations

import copy

import pytest
import torch

from meshtron.models.config import GPTConfig
from meshtron.moe import router as router_module
from meshtron.moe.scope import aux_loss_scope
from meshtron.mpu.mesh import ParallelConfig, virtual_mesh
from tests.test_moe_router import FakeGroup, router_with_weight

# Two sequences of two tokens, E=2, k=1, W = I so softmax(x) = p. Layout [s, b, h].
P_TOKENS = torch.tensor(
    [
        [[0.8, 0.2], [0.3, 0.7]],  # t=0: sequence 0 -> e0, sequence 1 -> e1
        [[0.6, 0.4], [0.9, 0.1]],
    ]
)  # t=1: sequence 0 -> e0, sequence 1 -> e0


def test_sequence_wise_aux_by_hand():
    r = router_with_weight(torch.eye(2), top_k=1, aux_loss_coef=1.0)
    out = r(P_TOKENS.log(), None, per_sequence=True)
    # sequence 0: f = [1, 0], P = [0.7, 0.3] -> 2 * 0.7 = 1.4
    # sequence 1: f = [0.5, 0.5], P = [0.6, 0.4] -> 2 * (0.3 + 0.2) = 1.0; mean 1.2
    assert out.aux_value.item() == pytest.approx(1.2, abs=1e-6)
    assert out.aux_loss.item() == pytest.approx(1.2, abs=1e-6)
    assert out.tokens_per_expert.tolist() == [3.0, 1.0]
    assert out.num_tokens.item() == 4


def test_microbatch_aux_by_hand_pools_the_sequences():
    out = router_with_weight(torch.eye(2), top_k=1, aux_loss_coef=1.0)(P_TOKENS.log(), None)
    # f = [3/4, 1/4], P = [2.6/4, 1.4/4] -> 2 * (0.75 * 0.65 + 0.25 * 0.35) = 1.15
    assert out.aux_value.item() == pytest.approx(1.15, abs=1e-6)


def test_sequence_wise_gradient_matches_formula():
    torch.manual_seed(1)
    s, b, h, E, k = 6, 3, 8, 4, 2
    x = torch.randn(s, b, h)
    w = torch.randn(E, h)
    r = router_with_weight(w, k, aux_loss_coef=1.0)
    out = r(x, None, per_sequence=True)
    out.aux_loss.backward()

    w_ref = w.clone().requires_grad_(True)
    probs = torch.softmax(x @ w_ref.t(), -1)  # [s, b, E]
    f = torch.zeros(b, E)
    for bi in range(b):
        for e in out.topk_idx[:, bi].reshape(-1).tolist():
            f[bi, e] += 1 / (s * k)
    ref = (E * (f * probs.mean(0)).sum(-1)).mean()
    ref.backward()
    assert torch.allclose(out.aux_loss, ref, atol=1e-6)
    assert torch.allclose(r.weight.grad, w_ref.grad, atol=1e-6)


def test_global_aux_by_hand_pools_the_dp_ranks():
    """aux_loss_scope=global: two dp ranks, each holding one sequence of P_TOKENS as its
    microbatch, pool their statistics (the stats group spans dp): both report the pooled value
    1.15, not the mean 1.2 of their own microbatch values (1.4 and 1.0, what `microbatch`
    trains), and their contributions and gradients sum to the pooled loss and its gradient."""
    full = router_with_weight(torch.eye(2), top_k=1, aux_loss_coef=1.0)
    ranks = [copy.deepcopy(full) for _ in range(2)]
    ref = full(P_TOKENS.log(), None)  # all four tokens pooled
    ref.aux_loss.backward()
    assert ref.aux_value.item() == pytest.approx(1.15, abs=1e-6)
    own = [full(P_TOKENS[:, r : r + 1].log(), None).aux_value.item() for r in range(2)]
    assert own == pytest.approx([1.4, 1.0], abs=1e-6)  # sequence 0 alone, sequence 1 alone

    group = FakeGroup(2)
    for rank in ranks:
        rank.reduce_stats = group.all_reduce_stats
    outs = group.run([lambda r=r: ranks[r](P_TOKENS[:, r : r + 1].log(), group) for r in range(2)])
    for o in outs:
        o.aux_loss.backward()
        assert o.aux_value.item() == pytest.approx(1.15, abs=1e-6)
        assert o.tokens_per_expert.tolist() == [3.0, 1.0] and o.num_tokens.item() == 4
    assert (outs[0].aux_loss + outs[1].aux_loss).item() == pytest.approx(1.15, abs=1e-6)
    assert torch.allclose(ranks[0].weight.grad + ranks[1].weight.grad, full.weight.grad, atol=1e-6)


@pytest.mark.parametrize("per_sequence", [False, True])
def test_sequence_shards_sum_to_full(per_sequence):
    """tp=2: each rank holds half of every sequence; contributions and gradients summed over
    the shards equal the unsharded router, values are identical on both ranks."""
    torch.manual_seed(2)
    x = torch.randn(8, 3, 8)
    full = router_module.TopKRouter(8, 4, 2, aux_loss_coef=1.0, z_loss_coef=1.0)
    ranks = [copy.deepcopy(full) for _ in range(2)]
    ref = full(x, None, per_sequence=per_sequence)
    (ref.aux_loss + ref.z_loss).backward()

    group = FakeGroup(2)
    for rank in ranks:
        rank.reduce_stats = group.all_reduce_stats  # the router's all-reduce hook
    shards = x.chunk(2, dim=0)
    outs = group.run([lambda r=r: ranks[r](shards[r], group, per_sequence=per_sequence) for r in range(2)])
    assert group.calls == 1
    for o in outs:
        (o.aux_loss + o.z_loss).backward()
        assert torch.allclose(o.aux_value, ref.aux_value, atol=1e-6)
        assert torch.equal(o.tokens_per_expert, ref.tokens_per_expert)
    assert torch.allclose(outs[0].aux_loss + outs[1].aux_loss, ref.aux_loss, atol=1e-6)
    assert torch.allclose(ranks[0].weight.grad + ranks[1].weight.grad, full.weight.grad, atol=1e-6)


def test_per_sequence_needs_three_dims():
    with pytest.raises(ValueError, match=r"\[s, b, h\]"):
        router_module.TopKRouter(8, 4, 2)(torch.randn(5, 8), None, per_sequence=True)


# ---------------------------------------------------------------- scopes on a layout


def test_scope_groups_and_divisors():
    """tp=2, dp=2 (ranks 0..3): microbatch and sequence pool over tp and average over dp;
    global pools over tp x dp. Coordinates only (no process groups are created)."""
    mesh = virtual_mesh(ParallelConfig(tp=2, dp=2), 4, 0)
    for name, per_sequence in (("microbatch", False), ("sequence", True)):
        scope = aux_loss_scope(name, mesh)
        assert scope.stats_group is mesh.tp and scope.replica_group is mesh.dp
        assert scope.per_sequence is per_sequence
    scope = aux_loss_scope("global", mesh)
    assert scope.stats_group is mesh.tp_dp and scope.replica_group is None
    assert scope.objective_divisor(3) == 3
    with pytest.raises(ValueError, match="aux_loss_scope"):
        aux_loss_scope("batch", mesh)


def test_config_rejects_unknown_scope_and_bad_groups():
    base = dict(num_experts=8, top_k=2)
    with pytest.raises(ValueError, match="model.aux_loss_scope='token'"):
        GPTConfig(aux_loss_scope="token", **base)
    with pytest.raises(ValueError, match="router_groups=3 must divide"):
        GPTConfig(router_groups=3, router_topk_groups=1, **base)
    with pytest.raises(ValueError, match="router_topk_groups=5 must be between 1 and model.router_groups=4"):
        GPTConfig(router_groups=4, router_topk_groups=5, **base)
    with pytest.raises(ValueError, match="top_k=4 experts do not fit"):
        GPTConfig(router_groups=4, router_topk_groups=1, **{**base, "top_k": 4})
    GPTConfig(router_groups=4, router_topk_groups=2, **base)  # valid


# ---------------------------------------------------------------- group-limited routing


def group_limited_choice(select: list[float], groups: int, topk_groups: int, k: int) -> list[int]:
    """The per-token rule: group score = sum of the group's best max(1, k // topk_groups)
    scores; keep the best topk_groups groups (lower index on ties); top-k experts among them
    (lower index on ties)."""
    size = len(select) // groups
    per_group = min(size, max(1, k // topk_groups))
    score = [sum(sorted(select[g * size : (g + 1) * size], reverse=True)[:per_group]) for g in range(groups)]
    best = sorted(range(groups), key=lambda g: (-score[g], g))[:topk_groups]
    allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
    return sorted(allowed, key=lambda e: (-select[e], e))[:k]


@pytest.mark.parametrize(
    "score,groups,topk_groups,k,binds",
    [
        # With one expert scoring each group (k <= topk_groups) the global top-k always lies in
        # the best groups: the limit cannot bind. With two or more, or k > topk_groups, it does.
        ("softmax", 4, 2, 2, False),
        ("sigmoid", 4, 1, 1, False),
        ("sigmoid", 4, 2, 4, True),
        ("softmax", 2, 1, 3, True),
        ("sigmoid", 4, 3, 6, True),
        ("softmax", 2, 1, 2, True),
        ("sigmoid", 8, 3, 3, False),
    ],
)
def test_group_limited_routing_matches_per_token_rule(score, groups, topk_groups, k, binds):
    torch.manual_seed(groups * 10 + k)
    E, h, T = 8, 16, 64
    x, w = torch.randn(T, h), torch.randn(E, h)
    r = router_with_weight(
        w, k, score=score, groups=groups, topk_groups=topk_groups, bias_update_rate=0.1 if score == "sigmoid" else 0.0
    )
    if score == "sigmoid":
        r.expert_bias.copy_(torch.randn(E) * 0.1)  # selection includes the bias, weights do not
    out = r(x, None)
    s = torch.softmax(x @ w.t(), -1) if score == "softmax" else torch.sigmoid(x @ w.t())
    select = s + r.expert_bias if score == "sigmoid" else s
    unlimited = router_with_weight(w, k, score=score, bias_update_rate=0.1 if score == "sigmoid" else 0.0)
    unlimited.expert_bias.copy_(r.expert_bias)
    differs = 0
    for t in range(T):
        want = group_limited_choice(select[t].tolist(), groups, topk_groups, k)
        assert out.topk_idx[t].tolist() == want, f"token {t}"
        chosen = s[t, want]
        assert torch.allclose(out.topk_weight[t], chosen / chosen.sum(), atol=1e-6)
        differs += want != unlimited(x[t : t + 1], None).topk_idx[0].tolist()
    assert (differs > 0) == binds, f"the group limit changed {differs} of {T} tokens' choices"


def test_group_limited_ties_go_to_lower_group():
    # Every score equal: groups 0 and 1 win, experts 0..3 in index order.
    r = router_with_weight(torch.zeros(8, 4), 3, groups=4, topk_groups=2)
    assert r(torch.randn(2, 4), None).topk_idx.tolist() == [[0, 1, 2]] * 2


def test_router_rejects_bad_groups():
    with pytest.raises(ValueError, match="groups=3"):
        router_module.TopKRouter(8, 8, 2, groups=3, topk_groups=1)
    with pytest.raises(ValueError, match="top_k=5 experts do not fit"):
        router_module.TopKRouter(8, 8, 5, groups=4, topk_groups=2)


# ---------------------------------------------------------------- aux pooled across layers


def test_pooled_aux_by_hand():
    """Two layers' routers over the same 2 tokens (E=2, k=1): the pooled aux uses the counts
    and probabilities of both layers at once, not the sum of the two layers' own losses."""
    layer_a = router_with_weight(torch.eye(2), top_k=1, pooled_aux=True, aux_loss_coef=1.0)
    layer_b = router_with_weight(torch.eye(2), top_k=1, pooled_aux=True, aux_loss_coef=1.0)
    a = layer_a(torch.tensor([[0.8, 0.2], [0.6, 0.4]]).log(), None)  # both -> e0; f=[1, 0], P=[0.7, 0.3]
    b = layer_b(torch.tensor([[0.3, 0.7], [0.9, 0.1]]).log(), None)  # e1, e0;   f=[.5, .5], P=[0.6, 0.4]
    assert a.aux_loss.item() == 0.0 and b.aux_loss.item() == 0.0  # no per-layer term when pooled
    assert a.aux_value.item() == pytest.approx(1.4) and b.aux_value.item() == pytest.approx(1.0)
    contribution, value = router_module.pooled_aux_loss([a, b], [a.set_prob_sum, b.set_prob_sum], 2, 1)
    # pooled f = [3/4, 1/4], P = [2.6/4, 1.4/4]: 2 * (0.75 * 0.65 + 0.25 * 0.35) = 1.15
    assert value.item() == pytest.approx(1.15, abs=1e-6)
    assert contribution.item() == pytest.approx(1.15, abs=1e-6)


def test_pooled_aux_needs_one_pipeline_stage():
    from meshtron.models.fits import check_model_fits
    from meshtron.mpu.mesh import ParallelConfigError

    cfg = GPTConfig(num_layers=4, num_experts=4, top_k=2, aux_loss_layers="pooled")
    with pytest.raises(ParallelConfigError, match="aux_loss_layers=pooled .* parallel.pp=2"):
        check_model_fits(ParallelConfig(pp=2, dp=1).resolved(2), cfg)
    with pytest.raises(ValueError, match="model.aux_loss_layers='mean'"):
        GPTConfig(num_experts=4, aux_loss_layers="mean")


# Layer b of the pooled sequence-wise case: [s, b, h] probabilities, W = I.
P_TOKENS_B = torch.tensor(
    [
        [[0.1, 0.9], [0.4, 0.6]],  # t=0: sequence 0 -> e1, sequence 1 -> e1
        [[0.7, 0.3], [0.65, 0.35]],  # t=1: sequence 0 -> e0, sequence 1 -> e0
    ]
)


def test_pooled_sequence_aux_by_hand():
    """aux_loss_layers=pooled with aux_loss_scope=sequence: per sequence, the counts and
    probabilities of both layers are pooled (L=2, T_set=2, k=1, E=2), then the per-sequence
    losses are averaged. Exact value 1.025, distinct from pooling the sequences (1.028125) and
    from the mean of the layers' own sequence-wise losses (1.1); the differentiable contribution
    has the same value and the gradient of the formula."""
    layers = [router_with_weight(torch.eye(2), top_k=1, pooled_aux=True, aux_loss_coef=1.0) for _ in range(2)]
    inputs = [P_TOKENS.log().requires_grad_(True), P_TOKENS_B.log().requires_grad_(True)]
    outs = [r(x, None, per_sequence=True) for r, x in zip(layers, inputs)]
    assert [o.aux_loss.item() for o in outs] == [0.0, 0.0]  # no per-layer term when pooled
    assert [o.aux_value.item() for o in outs] == pytest.approx([1.2, 1.0], abs=1e-6)  # the layers' own
    assert outs[0].set_counts.tolist() == [[2.0, 0.0], [1.0, 1.0]]
    assert outs[1].set_counts.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    contribution, value = router_module.pooled_aux_loss(outs, [o.set_prob_sum for o in outs], 2, 1)
    # sequence 0: counts [2,0]+[1,1] -> f = [3,1]/4; probs [1.4,0.6]+[0.8,1.2] -> P = [2.2,1.8]/4
    #   aux = 2 * (3 * 2.2 + 1 * 1.8) / 16 = 1.05
    # sequence 1: counts [1,1]+[1,1] -> f = [2,2]/4; P sums to 1 -> aux = 2 * 0.5 * 1 = 1.0
    # mean over the 2 sequences: 1.025
    assert value.item() == pytest.approx(1.025, abs=1e-6)
    assert contribution.item() == pytest.approx(1.025, abs=1e-6)
    contribution.backward()
    # gradient of the formula: d/dx of E * sum_s sum_i f_si * P_si / S, f fixed
    refs = [x.detach().clone().requires_grad_(True) for x in inputs]
    f = torch.tensor([[3.0, 1.0], [2.0, 2.0]]) / 4  # [S, E]
    P = sum(torch.softmax(x, -1).sum(0) for x in refs) / 4  # [S, E], pooled over layers and tokens
    (2 * (f * P).sum() / 2).backward()
    for r, ref in zip(layers, refs):
        # W = I: the router's weight gradient is sum_t x_t^T dL/dlogits_t
        want = torch.einsum("sbe,sbh->eh", ref.grad, inputs[layers.index(r)].detach())
        assert torch.allclose(r.weight.grad, want, atol=1e-6)
