"""Blockwise softmax attention: one q block against one kv block, the online log-sum-exp merge
of partial results, and the flash-attention style backward of a block. No communication: the
ring attention of `mpu.context_parallel` calls these on the blocks it holds, so the full
s x s score matrix never exists on one rank.

Layout: q [b, h, sq, d], k and v [b, hkv, sk, d] with h a multiple of hkv (grouped-query:
q head g*r .. g*r+r-1 uses kv head g, as `models.gpt.Attention` lays them out). Masks come
from global token positions (causal: a key is visible when its position is <= the query's)
and optional per-token document ids (a key is visible only within the query's document).
All math accumulates in fp32; outputs are fp32. A block's fp32 scores are built a tile of query
rows at a time (at most `TILE_SCORE_BYTES` of scores per tile: rows are independent in
softmax), so the working set of a long block stays bounded instead of growing with its
rows x keys.

Packed documents: `document_ids(tokens, eos_id)` gives the per-token document ids and the
positions within each document (reset after every end-of-document token), for the document
mask with or without context parallelism and for RoPE / learned positions.
"""

from __future__ import annotations

import torch

TILE_SCORE_BYTES = 4 << 20  # fp32 scores of one tile of query rows (P; backward also dS)


def document_ids(tokens: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token document ids and positions within the document for packed sequences
    `tokens` [b, s]: an `eos_id` token ends its document (it belongs to the document it ends),
    the next token starts a new one. Returns (doc_ids, positions), both int64 [b, s]."""
    eos = (tokens == eos_id).long()
    doc = torch.cumsum(eos, dim=-1) - eos  # exclusive: the eos itself stays in its document
    idx = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(eos, dtype=torch.bool)
    starts[..., 0] = True
    starts[..., 1:] = eos[..., :-1].bool()
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=-1).values
    return doc, idx - first


def attention_mask(
    q_pos: torch.Tensor | None,
    k_pos: torch.Tensor | None,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Boolean visibility mask (True = attend) broadcastable to [b, 1, sq, sk]: causal by global
    positions `q_pos` [sq] / `k_pos` [sk] when given, within documents `q_doc` [b, sq] /
    `k_doc` [b, sk] when given; None when nothing is masked."""
    mask = None
    if q_pos is not None and k_pos is not None:
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if q_doc is not None and k_doc is not None:
        same = (q_doc[:, :, None] == k_doc[:, None, :])[:, None]
        mask = same if mask is None else mask & same
    return mask


def _rows(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """fp32 [b, h, s, ...] -> [b, hkv, (h/hkv)*s, ...]: the rows of the q heads that share one kv
    head stacked, so each kv head is one plain batched matmul (no expanded k/v, no permute copies)."""
    b, h = x.shape[:2]
    if h % hkv:
        raise ValueError(f"query heads {h} are not a multiple of kv heads {hkv}")
    return x.float().reshape((b, hkv, -1) + tuple(x.shape[3:]))


def _probs(
    q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None, lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, lse) of one block, fp32, P [b, hkv, r*sq, sk] = exp(scores - lse) (0 where masked);
    lse [b, hkv, r*sq] is computed here when not given (forward) or the final one (backward)."""
    s = torch.matmul(_rows(q, k.shape[1]), k.float().transpose(-1, -2)).mul_(scale)
    if mask is not None:
        b, g = s.shape[:2]
        s.view(b, g, -1, q.shape[2], s.shape[-1]).masked_fill_(~mask.unsqueeze(2), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    return s.sub_(_finite(lse).unsqueeze(-1)).exp_(), lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows with nothing visible) replaced by 0, so exp(s - lse) gives 0, not NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def row_tiles(q: torch.Tensor, sk: int) -> list[slice]:
    """Slices of q's rows (dim 2 of [b, h, sq, d]) whose fp32 scores against `sk` keys take at
    most TILE_SCORE_BYTES each (one slice when the whole block fits)."""
    b, h, sq = q.shape[:3]
    per_row = max(1, b * h * sk * 4)
    rows = max(1, min(sq, TILE_SCORE_BYTES // per_row))
    return [slice(i, min(i + rows, sq)) for i in range(0, sq, rows)]


def _mask_rows(mask: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if mask is None else mask[..., rows, :]


def attention_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [b, h, sq, d] over one kv block (k, v [b, hkv, sk, d]) with the
    visibility `mask` (see `attention_mask`). Returns (out [b, h, sq, d], lse [b, h, sq]), fp32:
    out is normalised within the block and lse = log sum_k exp(score) per query row, so blocks
    merge with `merge_blocks`. A row with no visible key gets out 0 and lse -inf."""
    tiles = row_tiles(q, k.shape[2])
    if len(tiles) > 1:
        parts = [attention_block(q[:, :, t], k, v, scale=scale, mask=_mask_rows(mask, t)) for t in tiles]
        return torch.cat([o for o, _ in parts], dim=2), torch.cat([lse for _, lse in parts], dim=2)
    p, lse = _probs(q, k, scale, mask, None)
    out = torch.matmul(p, v.float())
    b, h, sq = q.shape[:3]
    return out.reshape(b, h, sq, v.shape[-1]), lse.reshape(b, h, sq)


def merge_blocks(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online softmax merge of two partial results over disjoint key sets: the attention over
    their union, (out [b, h, sq, d], lse [b, h, sq]). Rows where both lse are -inf stay 0 / -inf."""
    new = torch.logaddexp(lse, block_lse)
    safe = _finite(new)
    merged = torch.exp(lse - safe).unsqueeze(-1) * out + torch.exp(block_lse - safe).unsqueeze(-1) * block_out
    return merged, new


def attention_block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    delta: torch.Tensor,
    *,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradient contributions of one kv block to the attention whose final (all blocks merged)
    log-sum-exp is `lse` [b, h, sq]: recomputes P = exp(q k^T * scale - lse) for this block only,
    then dV = P^T dout, dP = dout V^T, dS = P * (dP - delta), dQ = dS K * scale, dK = dS^T Q * scale.
    `delta` [b, h, sq] = rowsum(dout * out) over the final out. Returns (dq [b, h, sq, d],
    dk, dv [b, hkv, sk, d]) in fp32; dk/dv sum over the q heads that share a kv head."""
    tiles = row_tiles(q, k.shape[2])
    if len(tiles) > 1:
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk = dv = None
        for t in tiles:
            dq_t, dk_t, dv_t = attention_block_backward(
                q[:, :, t], k, v, lse[:, :, t], dout[:, :, t], delta[:, :, t], scale=scale, mask=_mask_rows(mask, t)
            )
            dq[:, :, t] = dq_t
            dk, dv = (dk_t, dv_t) if dk is None else (dk.add_(dk_t), dv.add_(dv_t))
        return dq, dk, dv
    hkv = k.shape[1]
    p, _ = _probs(q, k, scale, mask, _rows(lse, hkv))
    do = _rows(dout, hkv)
    dv = torch.matmul(p.transpose(-1, -2), do)
    ds = torch.matmul(do, v.float().transpose(-1, -2)).sub_(_rows(delta, hkv).unsqueeze(-1)).mul_(p)
    dq = torch.matmul(ds, k.float()).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), _rows(q, hkv)).mul_(scale)
    return dq.reshape(q.shape), dk, dv


def attention_delta(out: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    """rowsum(dout * out) [b, h, sq] in fp32: the D term of the flash-attention backward."""
    return (dout.float() * out.float()).sum(-1)


# ------------------------------------------------------------ flash blocks (no score matrix)

FLASH_DTYPES_CUDA = (torch.float16, torch.bfloat16)


def flash_blocks_apply(q: torch.Tensor, has_docs: bool) -> bool:
    """Whether a flash kernel that returns the log-sum-exp can compute q's blocks: torch's
    flash attention on CUDA for fp16/bf16 q with head dim a multiple of 8 up to 256, and no
    document mask (the flash kernels take causal or nothing). Everything else runs the tiles."""
    d = q.shape[-1]
    return not has_docs and q.is_cuda and q.dtype in FLASH_DTYPES_CUDA and d % 8 == 0 and d <= 256


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """kv [b, hkv, s, d] -> [b, heads, s, d]: q head g*r .. g*r+r-1 reads kv head g."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_kv(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """[b, h, s, d] gradients of the expanded kv -> [b, hkv, s, d]: summed over each group's q heads."""
    b, h = x.shape[:2]
    return x if h == hkv else x.reshape(b, hkv, h // hkv, *x.shape[2:]).sum(2)


def _flash_forward(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One flash-attention call: (out in q's dtype, lse [b, h, sq] fp32)."""
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.float()


def _flash_backward(q, k, v, out, lse, dout, scale: float, causal: bool):
    """Gradients (dq, dk, dv; kv gradients summed to kv heads) of one flash block given the
    final out and lse of q's rows: the kernel recomputes P = exp(S - lse) and uses
    rowsum(dout * out) of the final out, so per-block calls sum to the merged gradient."""
    hkv = k.shape[1]
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    out, dout = out.to(q.dtype).contiguous(), dout.to(q.dtype).contiguous()
    if q.is_cuda:
        sq, sk = q.shape[2], k.shape[2]
        none = torch.empty(0, dtype=torch.int64, device=q.device)  # no varlen, no dropout rng
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, none, none, sq, sk, 0.0, causal, none, none, scale=scale
        )
    else:
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)  # the kernel's own lse dtype
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    return dq.float(), _sum_kv(dk.float(), hkv), _sum_kv(dv.float(), hkv)


def flash_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, diagonal_chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_block` by flash-attention calls, no score matrix: q [b, h, sq, d] over k, v
    [b, hkv, sk, d], every key visible, except that with `diagonal_chunk` = c the last c keys
    are q's own positions (causal among them, the keys before fully visible): one unmasked
    call for the earlier keys and one causal square call, merged by log-sum-exp (each call's
    mask is then the same in top-left and bottom-right alignment). Returns (out, lse) fp32."""
    if diagonal_chunk is None:
        out, lse = _flash_forward(q, k, v, scale, causal=False)
        return out.float(), lse
    c = diagonal_chunk
    out, lse = _flash_forward(q, k[:, :, -c:], v[:, :, -c:], scale, causal=True)
    out = out.float()
    if k.shape[2] > c:
        early, early_lse = _flash_forward(q, k[:, :, :-c], v[:, :, :-c], scale, causal=False)
        out, lse = merge_blocks(out, lse, early.float(), early_lse)
    return out, lse


def flash_block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    *,
    scale: float,
    diagonal_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attention_block_backward` of a `flash_block` (same key layout), given q's rows' final
    (all blocks merged) `out` and `lse`: (dq, dk, dv) in fp32, dk/dv per kv head."""
    if diagonal_chunk is None:
        return _flash_backward(q, k, v, out, lse, dout, scale, causal=False)
    c = diagonal_chunk
    dq, dk_d, dv_d = _flash_backward(q, k[:, :, -c:], v[:, :, -c:], out, lse, dout, scale, causal=True)
    if k.shape[2] == c:
        return dq, dk_d, dv_d
    dq_e, dk_e, dv_e = _flash_backward(q, k[:, :, :-c], v[:, :, :-c], out, lse, dout, scale, causal=False)
    return dq.add_(dq_e), torch.cat([dk_e, dk_d], dim=2), torch.cat([dv_e, dv_d], dim=2)
