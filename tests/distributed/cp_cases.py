"""Context-parallel attention over a cp group equals full attention in one process: ring and
all-to-all (Ulysses), causal and document masks, GQA, cp in {2, 4}; outputs and dq, dk, dv
gathered from the load-balanced shards match (1e-5); the ring skips causally invisible
blocks and every rank computes the same number of them."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtron.mpu.attention_blocks import attention_mask, document_ids
from meshtron.mpu.context_parallel import (
    RingStats,
    context_parallel_attention,
    gather_sequence,
    ring_attention,
    shard_sequence,
)

B, H, S, D = 2, 4, 32, 8
TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(hkv: int, with_docs: bool, seed: int, heads: int = H):
    """The same full q, k, v, dout and document ids on every rank."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, S, D, generator=g, requires_grad=True)
    k = torch.randn(B, hkv, S, D, generator=g, requires_grad=True)
    v = torch.randn(B, hkv, S, D, generator=g, requires_grad=True)
    dout = torch.randn(B, heads, S, D, generator=g)
    docs = None
    if with_docs:
        tokens = torch.randint(1, 50, (B, S), generator=g)
        tokens[0, [3, 4, 13, 20]] = 0  # documents across chunk and rank borders, one of one token
        tokens[1, [15]] = 0
        docs = document_ids(tokens, 0)[0]
    return q, k, v, dout, docs


def _check_attention(group, comm: str, hkv: int, with_docs: bool, seed: int, blocks: str | None = None) -> RingStats:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout, docs = _inputs(hkv, with_docs, seed)
    pos = torch.arange(S)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(pos, pos, docs, docs), enable_gqa=hkv != H)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    local = [shard_sequence(t.detach(), 2, cp, rank).requires_grad_() for t in (q, k, v)]
    stats = RingStats()
    local_docs = None if docs is None else shard_sequence(docs, 1, cp, rank)
    if blocks is None:
        out = context_parallel_attention(*local, group, comm, stats=stats, doc_ids=local_docs)
    else:  # the ring with its chunk pairs computed by `blocks`
        out = ring_attention(*local, group, stats=stats, doc_ids=local_docs, blocks=blocks)
    grads = torch.autograd.grad(out, local, shard_sequence(dout, 2, cp, rank))
    what = f"cp={cp} {comm} hkv={hkv} docs={with_docs} blocks={blocks}"
    torch.testing.assert_close(gather_sequence(out.detach(), 2, group), want, **TOL, msg=lambda m: f"{what} out: {m}")
    for name, got, ref in zip("qkv", grads, want_grads):
        torch.testing.assert_close(
            gather_sequence(got, 2, group), ref, **TOL, msg=lambda m, name=name: f"{what} d{name}: {m}"
        )
    return stats


def _groups(cp: int):
    """This rank's cp group: the world, or consecutive ranks in groups of `cp`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if cp == world:
        return dist.group.WORLD
    mine = None
    for start in range(0, world, cp):
        g = dist.new_group(list(range(start, start + cp)))
        if start <= rank < start + cp:
            mine = g
    return mine


def ring_equals_full_attention() -> None:
    """Ring attention at cp=world (and cp=2 in sub-groups of a 4-rank world): causal and
    document masks, MHA and GQA."""
    world = dist.get_world_size()
    for i, (hkv, with_docs) in enumerate([(4, False), (2, True), (1, False)]):
        _check_attention(dist.group.WORLD, "ring", hkv, with_docs, seed=10 + i)
    if world > 2:  # ring neighbours are global ranks of a group that is not the world
        _check_attention(_groups(2), "ring", 2, True, seed=13)


def ring_flash_blocks_equal_full_attention() -> None:
    """The ring's chunk pairs by flash-attention calls returning the log-sum-exp (CPU: torch's
    flash kernel for CPU, fp32) equal full attention as the score tiles do, MHA and GQA, and
    count the same blocks; the flash blocks refuse a document mask."""
    for i, hkv in enumerate((4, 2, 1)):
        stats = _check_attention(dist.group.WORLD, "ring", hkv, False, seed=40 + i, blocks="flash")
        cp = dist.get_world_size()
        assert (stats.forward_blocks, stats.backward_blocks) == (2 * cp + 1, 2 * cp + 1), stats
    q = torch.zeros(1, 4, 4, 8)
    try:
        ring_attention(
            q, q, q, dist.group.WORLD, sequence_doc_ids=torch.zeros(1, 4 * dist.get_world_size()), blocks="flash"
        )
    except ValueError as e:
        assert str(e) == "ring attention blocks='flash' takes no document mask or window; use 'tiles' or 'auto'", str(e)
    else:
        raise AssertionError("flash blocks with a document mask did not raise")


def a2a_equals_full_attention() -> None:
    """Ulysses attention at cp=world: causal and document masks, MHA and GQA (at cp=4, 2 and 1
    kv heads are replicated to 4)."""
    group = dist.group.WORLD
    for i, (hkv, with_docs) in enumerate([(4, True), (2, False), (1, True)]):
        _check_attention(group, "a2a", hkv, with_docs, seed=20 + i)


def ring_skips_invisible_blocks() -> None:
    """Each rank computes 2*cp+1 chunk pairs forward and backward (of its 2*cp total); over the
    group that is cp*(2*cp+1), exactly the (2*cp)(2*cp+1)/2 pairs on or below the diagonal."""
    group = dist.group.WORLD
    cp = dist.get_world_size()
    stats = _check_attention(group, "ring", 2, True, seed=30)
    counts = torch.tensor([stats.forward_blocks, stats.backward_blocks])
    every = [torch.zeros_like(counts) for _ in range(cp)]
    dist.all_gather(every, counts, group=group)
    assert all(c.tolist() == [2 * cp + 1] * 2 for c in every), f"blocks per rank (fwd, bwd): {every}"
    assert sum(int(c[0]) for c in every) == (2 * cp) * (2 * cp + 1) // 2


def bad_shapes_raise_before_communicating() -> None:
    """Heads not divisible by cp for a2a, sequence not divisible by 2*cp: ValueError naming the
    numbers, raised on every rank before any collective (so nothing hangs)."""
    cp = dist.get_world_size()
    q = torch.zeros(1, 3 * cp - 1, 4, 8)
    try:
        context_parallel_attention(q, q, q, dist.group.WORLD, "a2a")
    except ValueError as e:
        assert f"({3 * cp - 1}) divisible by cp={cp}" in str(e), str(e)
    else:
        raise AssertionError("a2a with heads not divisible by cp did not raise")
    q = torch.zeros(1, 4, 3, 8)
    try:
        context_parallel_attention(q, q, q, dist.group.WORLD, "ring")
    except ValueError as e:
        assert f"sequence length {3 * cp} is not divisible by 2*cp = {2 * cp}" in str(e), str(e)
    else:
        raise AssertionError("a sequence not divisible by 2*cp did not raise")


def cases_for_world(world_size: int) -> list[str]:
    if world_size not in (2, 4):
        return []
    return [
        "ring_equals_full_attention",
        "ring_flash_blocks_equal_full_attention",
        "a2a_equals_full_attention",
        "ring_skips_invisible_blocks",
        "bad_shapes_raise_before_communicating",
        "a2a_kv_heads_not_dividing_cp",
    ]


def a2a_kv_heads_not_dividing_cp() -> None:
    """Ulysses attention with kv heads that neither divide nor are a multiple of cp (supported:
    each kv head is repeated cp / gcd(hkv, cp) times before the all-to-all; the module doc):
    cp=2 with 3 kv heads of 6 query heads, cp=4 with 6 (and 3) kv heads of 12, equal to full
    attention in one process, outputs and dq, dk, dv, causal and document masks."""
    group = dist.group.WORLD
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    shapes = {2: [(6, 3, False), (6, 3, True)], 4: [(12, 6, True), (12, 3, False)]}[cp]
    for i, (h, hkv, with_docs) in enumerate(shapes):
        q, k, v, dout, docs = _inputs(hkv, with_docs, 50 + i, heads=h)
        pos = torch.arange(S)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(pos, pos, docs, docs), enable_gqa=True)
        want_grads = torch.autograd.grad(want, (q, k, v), dout)
        local = [shard_sequence(t.detach(), 2, cp, rank).requires_grad_() for t in (q, k, v)]
        local_docs = None if docs is None else shard_sequence(docs, 1, cp, rank)
        out = context_parallel_attention(*local, group, "a2a", doc_ids=local_docs)
        assert out.shape == (B, h, S // cp, D), out.shape
        grads = torch.autograd.grad(out, local, shard_sequence(dout, 2, cp, rank))
        what = f"cp={cp} a2a h={h} hkv={hkv} docs={with_docs}"
        torch.testing.assert_close(
            gather_sequence(out.detach(), 2, group), want, **TOL, msg=lambda m: f"{what} out: {m}"
        )
        for name, got, ref in zip("qkv", grads, want_grads):
            assert got.shape == local["qkv".index(name)].shape, (what, name, got.shape)
            torch.testing.assert_close(
                gather_sequence(got, 2, group), ref, **TOL, msg=lambda m, name=name: f"{what} d{name}: {m}"
            )
