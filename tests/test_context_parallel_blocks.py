"""Single-process checks of the context-parallel building blocks: the attention block and its
log-sum-exp merge and backward against an explicit masked softmax and SDPA (values and
gradients; causal, document masks, GQA), packed-document ids, the load-balanced sharding,
and cp attention over a group of one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from meshtron.mpu.attention_blocks import (
    attention_block,
    attention_block_backward,
    attention_delta,
    attention_mask,
    document_ids,
    flash_blocks_apply,
    merge_blocks,
)
from meshtron.mpu.context_parallel import (
    check_cp_shapes,
    context_parallel_attention,
    ring_attention,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)

B, H, S, D = 2, 4, 32, 8
TOL = dict(rtol=1e-5, atol=1e-5)


def _qkv(hkv: int, seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g)
    k = torch.randn(B, hkv, S, D, generator=g)
    v = torch.randn(B, hkv, S, D, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _docs(seed: int = 0) -> torch.Tensor:
    """Document ids of packed sequences: eos (id 0) at a few random places per row."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (B, S), generator=g)
    tokens[0, [4, 5, 17]] = 0  # includes a one-token document
    tokens[1, [9, S - 1]] = 0
    return document_ids(tokens, 0)[0]


def _explicit(q, k, v, mask):
    """softmax(q k^T / sqrt(d) masked) v, written out, in float64."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _mask(docs=None):
    pos = torch.arange(S)
    return attention_mask(pos, pos, docs, docs)


@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize("with_docs", [False, True])
def test_block_matches_explicit_softmax(hkv, with_docs):
    q, k, v = _qkv(hkv)
    mask = _mask(_docs() if with_docs else None)
    out, lse = attention_block(q, k, v, scale=D**-0.5, mask=mask)
    want_out, want_lse = _explicit(q, k, v, mask)
    torch.testing.assert_close(out, want_out.float(), **TOL)
    torch.testing.assert_close(lse, want_lse.float(), **TOL)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=hkv != H)
    torch.testing.assert_close(out, sdpa, **TOL)


@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("with_docs", [False, True])
def test_merged_blocks_and_blockwise_backward_match_full_attention(hkv, with_docs):
    q, k, v = _qkv(hkv, seed=1, requires_grad=True)
    docs = _docs(1) if with_docs else None
    pos = torch.arange(S)
    full_mask = attention_mask(pos, pos, docs, docs)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=full_mask, enable_gqa=hkv != H)
    dout = torch.randn_like(want)
    want.backward(dout)
    # Three kv blocks of uneven size, visited out of order: the merge is order-free.
    cuts = [(20, 32), (0, 7), (7, 20)]
    out = torch.zeros(B, H, S, D)
    lse = torch.full((B, H, S), float("-inf"))
    for lo, hi in cuts:
        m = attention_mask(pos, pos[lo:hi], docs, None if docs is None else docs[:, lo:hi])
        bo, bl = attention_block(q.detach(), k.detach()[:, :, lo:hi], v.detach()[:, :, lo:hi], scale=D**-0.5, mask=m)
        out, lse = merge_blocks(out, lse, bo, bl)
    torch.testing.assert_close(out, want.detach(), **TOL)
    delta = attention_delta(out, dout)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for lo, hi in cuts:
        m = attention_mask(pos, pos[lo:hi], docs, None if docs is None else docs[:, lo:hi])
        a, b, c = attention_block_backward(
            q.detach(), k.detach()[:, :, lo:hi], v.detach()[:, :, lo:hi], lse, dout, delta, scale=D**-0.5, mask=m
        )
        dq += a
        dk[:, :, lo:hi] += b
        dv[:, :, lo:hi] += c
    torch.testing.assert_close(dq, q.grad, **TOL)
    torch.testing.assert_close(dk, k.grad, **TOL)
    torch.testing.assert_close(dv, v.grad, **TOL)


def test_fully_masked_rows_merge_to_nothing():
    """A kv block a query cannot see at all (another document) leaves that row unchanged."""
    q, k, v = _qkv(4)
    mask = torch.zeros(B, 1, S, S, dtype=torch.bool)
    bo, bl = attention_block(q, k, v, scale=0.3, mask=mask)
    assert torch.equal(bo, torch.zeros_like(bo)) and torch.isneginf(bl).all()
    out, lse = attention_block(q, k, v, scale=0.3, mask=_mask())
    merged, merged_lse = merge_blocks(out, lse, bo, bl)
    assert torch.equal(merged, out) and torch.equal(merged_lse, lse)
    empty = merge_blocks(bo, bl, bo, bl)
    assert not torch.isnan(empty[0]).any() and torch.isneginf(empty[1]).all()


def test_document_ids_and_positions():
    tokens = torch.tensor([[5, 9, 0, 7, 0, 0, 3, 4], [1, 2, 3, 4, 5, 6, 7, 0]])
    docs, pos = document_ids(tokens, eos_id=0)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]


def test_sharding_round_trip_and_positions():
    x = torch.arange(2 * 16 * 3).reshape(2, 16, 3)
    for cp in (1, 2, 4):
        shards = [shard_sequence(x, 1, cp, r) for r in range(cp)]
        assert all(s.shape == (2, 16 // cp, 3) for s in shards)
        assert torch.equal(unshard_sequence(shards, 1), x)
    # cp=2, 8 tokens: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert sequence_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert sequence_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sequence_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    # Every rank's causal work (sum of positions + 1) is the same.
    assert len({int((sequence_positions(64, 4, r) + 1).sum()) for r in range(4)}) == 1


def test_bad_shapes_name_the_numbers():
    with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by 2\*cp = 4"):
        check_cp_shapes(30, 4, 2)
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2\*cp = 8"):
        shard_sequence(torch.zeros(1, 12), 1, 4, 0)
    with pytest.raises(ValueError, match=r"heads per tensor-parallel rank \(6\) divisible by cp=4"):
        check_cp_shapes(32, 6, 4, "a2a")
    check_cp_shapes(32, 6, 4, "ring")  # the ring has no constraint on heads
    with pytest.raises(ValueError, match="cp_comm='p2p'"):
        check_cp_shapes(32, 4, 2, "p2p")
    q, k, v = _qkv(4)
    with pytest.raises(ValueError, match="dropout 0.1 is not supported with context parallelism"):
        context_parallel_attention(q, k, v, None, "ring", dropout_p=0.1)


@pytest.mark.parametrize("comm", ["ring", "a2a"])
@pytest.mark.parametrize("hkv", [4, 2])
@pytest.mark.parametrize("with_docs", [False, True])
def test_group_of_one_is_plain_masked_attention(comm, hkv, with_docs):
    q, k, v = _qkv(hkv, seed=2, requires_grad=True)
    docs = _docs(2) if with_docs else None
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(docs), enable_gqa=hkv != H)
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    out = context_parallel_attention(q, k, v, None, comm, doc_ids=docs)
    torch.testing.assert_close(out, want, **TOL)
    for got, ref in zip(torch.autograd.grad(out, (q, k, v), dout), want_grads):
        torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("comm", ["ring", "a2a"])
def test_bf16_inputs_accumulate_in_fp32(comm):
    """bf16 q, k, v give bf16 outputs and gradients within bf16 rounding of the fp32 result."""
    q, k, v = _qkv(2, seed=3)
    docs = _docs(3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(docs), enable_gqa=True)
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*low, None, comm, doc_ids=docs)
    out.sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in low)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_document_positions_shard_like_the_tokens():
    """Per-document positions of a packed sequence, sharded for cp=2, are each rank's RoPE positions."""
    tokens = torch.tensor([[1, 2, 0, 3, 4, 5, 0, 6]])
    docs, pos = document_ids(tokens, 0)
    assert shard_sequence(pos, 1, 2, 0).tolist() == [[0, 1, 3, 0]]
    assert shard_sequence(pos, 1, 2, 1).tolist() == [[2, 0, 1, 2]]
    assert shard_sequence(docs, 1, 2, 1).tolist() == [[0, 1, 1, 1]]


@pytest.mark.parametrize("with_docs", [False, True])
def test_row_tiles_give_the_untiled_block(monkeypatch, with_docs):
    """A block computed a few query rows at a time (TILE_SCORE_BYTES small) equals the block in
    one piece: outputs, log-sum-exp and the backward's dq, dk, dv (rows are independent)."""
    import meshtron.mpu.attention_blocks as blocks

    q, k, v = _qkv(2, seed=5)
    docs = _docs(5) if with_docs else None
    mask = _mask(docs)
    dout = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(6))
    whole, lse = attention_block(q, k, v, scale=0.3, mask=mask)
    delta = attention_delta(whole, dout)
    grads = attention_block_backward(q, k, v, lse, dout, delta, scale=0.3, mask=mask)
    monkeypatch.setattr(blocks, "TILE_SCORE_BYTES", B * H * S * 4 * 5)  # 5 query rows per tile
    assert len(blocks.row_tiles(q, S)) == math.ceil(S / 5)
    tiled, tiled_lse = attention_block(q, k, v, scale=0.3, mask=mask)
    torch.testing.assert_close(tiled, whole, **TOL)
    torch.testing.assert_close(tiled_lse, lse, **TOL)
    for got, want in zip(attention_block_backward(q, k, v, lse, dout, delta, scale=0.3, mask=mask), grads):
        torch.testing.assert_close(got, want, **TOL)


def _ring_one_rank(q, k, v, dout, blocks: str):
    """The ring over a group of one (two chunks: one diagonal pair, one with an earlier chunk)
    with its chunk pairs computed by `blocks`: out and (dq, dk, dv)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, None, blocks=blocks)
    return out, torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("hkv", [4, 2])
def test_ring_flash_blocks_equal_tiles_on_cpu(hkv):
    """The flash chunk pairs (torch's CPU flash kernel, fp32, returning the log-sum-exp) give the
    tiles' output and gradients (1e-5): the merge, the diagonal split and the backward from the
    final out and log-sum-exp; GQA kv gradients summed per kv head."""
    q, k, v = _qkv(hkv, seed=5)
    dout = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(6))
    want, want_grads = _ring_one_rank(q, k, v, dout, "tiles")
    got, got_grads = _ring_one_rank(q, k, v, dout, "flash")
    torch.testing.assert_close(got, want, **TOL)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch's flash attention kernel)")
def test_ring_flash_blocks_equal_tiles_on_cuda_bf16():
    """On CUDA in bf16 `auto` picks the flash chunk pairs; they equal the fp32 tiles within bf16
    tolerance (output and gradients), GQA included."""
    q, k, v = (t.cuda().bfloat16() for t in _qkv(2, seed=7))
    dout = torch.randn(B, H, S, D, generator=torch.Generator().manual_seed(8)).cuda().bfloat16()
    want, want_grads = _ring_one_rank(q, k, v, dout, "tiles")
    got, got_grads = _ring_one_rank(q, k, v, dout, "auto")
    assert flash_blocks_apply(q, has_docs=False)
    bf16 = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **bf16)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.float(), w.float(), **bf16)
