"""Context parallelism: causal self-attention over a sequence sharded across a cp group.

Load-balanced sharding (as Megatron-Core): the sequence is cut into 2*cp chunks and cp rank i
holds chunks i and 2*cp-1-i, so under the causal mask every rank has the same work.
`shard_sequence` / `unshard_sequence` / `gather_sequence` cut and restore that layout and
`sequence_positions` gives a rank's global token positions (RoPE, learned positions).

`context_parallel_attention(q, k, v, group, comm)` with q [b, h, s/cp, d] and k, v
[b, hkv, s/cp, d] (this rank's shard, chunk order as above; grouped-query when hkv < h):

* comm="ring": kv blocks travel around the cp group with batched isend/irecv, the next block's
  transfer overlapping the current block's compute; partial results merge with the online
  log-sum-exp rule (`mpu.attention_blocks`). Work is done per chunk pair: pairs the causal mask
  hides entirely are skipped (not computed), only diagonal pairs are masked, and every rank
  computes 2*cp+1 chunk pairs forward and backward. Backward passes kv and the accumulating
  dk/dv around the ring, recomputing P from q, k and the saved log-sum-exp, so no rank ever
  holds more than a (s/cp) x (s/cp) block of scores. A chunk pair is computed by fp32 score
  tiles (`attention_block`, any device, document masks) or, on CUDA in fp16/bf16 without
  documents, by torch's flash-attention kernel, which returns the log-sum-exp the merge needs
  and takes the final out and log-sum-exp in backward (`flash_block`; no score matrix at
  all). `ring_attention(blocks=...)` picks; the CPU runs tiles unless told, and the tests hold
  the two equal (the CPU flash kernel in fp32).
* comm="a2a" (Ulysses): all-to-all from sequence shards to head shards, full-sequence attention
  on h/cp heads, all-to-all back (backward: the reverse all-to-alls). Needs h divisible by cp;
  kv heads are replicated as needed when hkv is not a multiple of cp.

Both take optional per-token document ids (see `mpu.attention_blocks.document_ids`): tokens
then attend only within their document. `doc_ids` [b, s/cp] is sharded like q and gathered
over the group; a caller that holds the whole sequence's ids [b, s] (the model: every cp rank
loads the full microbatch) passes them as `sequence_doc_ids` and nothing is gathered. A group
of size 1 (or None) is plain causal / document-masked attention. Dropout is not supported
with context parallelism (dropout_p > 0 raises); attention math accumulates in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtron.mpu.attention_blocks import (
    attention_block,
    attention_block_backward,
    attention_delta,
    attention_mask,
    flash_block,
    flash_block_backward,
    flash_blocks_apply,
    merge_blocks,
)
from meshtron.mpu.document_attention import document_attention
from meshtron.mpu.mappings import all_gather_stats, all_to_all
from meshtron.mpu.mesh import group_rank, group_size

CP_COMMS = ("ring", "a2a")
RING_BLOCKS = ("auto", "tiles", "flash")  # how the ring computes a chunk pair (ring_attention)


# ------------------------------------------------------------------- load-balanced sharding


def check_cp_shapes(seq_len: int, num_heads: int, cp: int, comm: str = "ring") -> None:
    """Raise ValueError naming the numbers when a sequence of `seq_len` tokens with `num_heads`
    (this tensor-parallel rank's) query heads cannot be split over `cp` ranks with `comm`."""
    if comm not in CP_COMMS:
        raise ValueError(f"cp_comm={comm!r}: choose one of {', '.join(CP_COMMS)}")
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp} "
            f"(cp={cp} cuts it into 2*cp load-balanced chunks)"
        )
    if comm == "a2a" and num_heads % cp:
        raise ValueError(
            f"cp_comm=a2a needs the attention heads per tensor-parallel rank ({num_heads}) divisible by cp={cp}"
        )


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunk indices (of 2*cp) that cp rank `rank` holds: (rank, 2*cp-1-rank)."""
    return rank, 2 * cp - 1 - rank


def _chunk_order(cp: int) -> list[int]:
    """Global chunk index of each chunk of the ranks' shards concatenated in rank order."""
    return [c for r in range(cp) for c in chunk_ids(cp, r)]


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This cp rank's load-balanced shard of `x` along `dim` (chunks rank and 2*cp-1-rank)."""
    check_cp_shapes(x.shape[dim], 1, cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(cp, rank)], dim=dim)


def _reorder_chunks(x: torch.Tensor, dim: int, order: list[int]) -> torch.Tensor:
    """Cut `x` into len(order) chunks along `dim`; chunk k goes to place order[k]."""
    chunks = x.chunk(len(order), dim=dim)
    place = {o: k for k, o in enumerate(order)}
    return torch.cat([chunks[place[g]] for g in range(len(order))], dim=dim)


def unshard_sequence(shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The full sequence from every cp rank's shard (in rank order): inverse of `shard_sequence`."""
    return _reorder_chunks(torch.cat(shards, dim=dim), dim, _chunk_order(len(shards)))


def gather_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather the cp shards of `x` over `group` and restore the sequence order along `dim`
    (not differentiable: for positions, ids, tests)."""
    return unshard_sequence(list(all_gather_stats(x, group).unbind(0)), dim)


def sequence_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global token positions [seq_len/cp] (int64) of cp rank `rank`'s shard."""
    return shard_sequence(torch.arange(seq_len, device=device), 0, cp, rank)


# ------------------------------------------------------------------------- ring attention


@dataclass
class RingStats:
    """Chunk pairs (q chunk x kv chunk of s/(2*cp) tokens each) one rank computed: forward and
    backward. Filled in by `ring_attention` when passed; for tests and benchmarks."""

    forward_blocks: int = 0
    backward_blocks: int = 0


def _visible(cp: int, rank: int, src: int) -> list[tuple[int, int, bool]]:
    """For q held by `rank` and kv held by `src`: per local q chunk a (0, 1) that sees anything,
    (a, number n of leading local kv chunks it sees, whether the causal mask is needed). The
    visible kv chunks are always a prefix of the two (chunk 2cp-1-src > chunk src)."""
    q_chunks, kv_chunks = chunk_ids(cp, rank), chunk_ids(cp, src)
    plan = []
    for a, qc in enumerate(q_chunks):
        seen = [kc for kc in kv_chunks if kc <= qc]
        if seen:
            plan.append((a, len(seen), qc in seen))
    return plan


class _Ring:
    """Ring neighbours over `group` and batched point-to-point exchange with them."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = group_size(group), group_rank(group)
        ranks = dist.get_process_group_ranks(group) if self.size > 1 else [0]
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def start(self, send: torch.Tensor, recv: torch.Tensor, tag: int):
        """Send `send` to the next rank and receive into `recv` from the previous one, asynchronously."""
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, docs, group, scale, stats, flash, window):
        ring = _Ring(group)
        cp, rank = ring.size, ring.rank
        c = q.shape[2] // 2
        pos = [torch.arange(g * c, (g + 1) * c, device=q.device) for g in range(2 * cp)]
        out = torch.zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # one message per hop
        for step in range(cp):
            src = (rank - step) % cp
            reqs = None
            if step < cp - 1:  # the next block travels while this one is computed
                kv_next = torch.empty_like(kv)
                reqs = ring.start(kv, kv_next, tag=0)
            for a, n, causal in _visible(cp, rank, src):
                qa = chunk_ids(cp, rank)[a]
                kcs = chunk_ids(cp, src)[:n]
                rows = slice(a * c, (a + 1) * c)
                if flash:  # no score matrix; causal only on the diagonal chunk (the prefix's last)
                    blk_out, blk_lse = flash_block(
                        q[:, :, rows],
                        kv[0][:, :, : n * c],
                        kv[1][:, :, : n * c],
                        scale=scale,
                        diagonal_chunk=c if causal else None,
                    )
                else:
                    blk_out, blk_lse = attention_block(
                        q[:, :, rows],
                        kv[0][:, :, : n * c],
                        kv[1][:, :, : n * c],
                        scale=scale,
                        mask=_block_mask(pos, docs, qa, kcs, causal, c, window),
                    )
                out[:, :, rows], lse[:, :, rows] = merge_blocks(out[:, :, rows], lse[:, :, rows], blk_out, blk_lse)
                if stats is not None:
                    stats.forward_blocks += n
            if reqs is not None:
                _wait(reqs)
                kv = kv_next
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.group, ctx.scale, ctx.stats, ctx.flash, ctx.window = group, scale, stats, flash, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, docs = ctx.saved_tensors
        ring = _Ring(ctx.group)
        cp, rank = ring.size, ring.rank
        c = q.shape[2] // 2
        pos = [torch.arange(g * c, (g + 1) * c, device=q.device) for g in range(2 * cp)]
        delta = None if ctx.flash else attention_delta(out, dout)  # the flash kernel forms its own
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = None  # the dk/dv accumulator of the kv block held now (fp32), received from prev
        dkv_reqs = None
        for step in range(cp):
            src = (rank - step) % cp
            kv_reqs = None
            if step < cp - 1:
                kv_next = torch.empty_like(kv)
                kv_reqs = ring.start(kv, kv_next, tag=0)
            mine = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            for a, n, causal in _visible(cp, rank, src):
                qa = chunk_ids(cp, rank)[a]
                rows = slice(a * c, (a + 1) * c)
                q_a, k_n, v_n = q[:, :, rows], kv[0][:, :, : n * c], kv[1][:, :, : n * c]
                if ctx.flash:
                    dq_a, dk, dv = flash_block_backward(
                        q_a,
                        k_n,
                        v_n,
                        out[:, :, rows],
                        lse[:, :, rows],
                        dout[:, :, rows],
                        scale=ctx.scale,
                        diagonal_chunk=c if causal else None,
                    )
                else:
                    mask = _block_mask(pos, docs, qa, chunk_ids(cp, src)[:n], causal, c, ctx.window)
                    dq_a, dk, dv = attention_block_backward(
                        q_a,
                        k_n,
                        v_n,
                        lse[:, :, rows],
                        dout[:, :, rows],
                        delta[:, :, rows],
                        scale=ctx.scale,
                        mask=mask,
                    )
                dq[:, :, rows] += dq_a
                mine[0][:, :, : n * c] += dk
                mine[1][:, :, : n * c] += dv
                if ctx.stats is not None:
                    ctx.stats.backward_blocks += n
            if dkv_reqs is not None:  # the accumulator for this block arrived during the compute
                _wait(dkv_reqs)
                mine += dkv
            if kv_reqs is not None:
                _wait(kv_reqs)
                kv = kv_next
            if cp == 1:
                dkv = mine
                break
            # Pass the accumulator on with its block; after cp hops it is back at its owner.
            dkv = torch.empty_like(mine)
            dkv_reqs = ring.start(mine, dkv, tag=1)
        if cp > 1:
            _wait(dkv_reqs)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def _block_mask(
    pos: list[torch.Tensor],
    docs: torch.Tensor | None,
    q_chunk: int,
    kv_chunks,
    causal: bool,
    c: int,
    window: int | None = None,
) -> torch.Tensor | None:
    """Mask of one q chunk against kv chunks (global indices): causal only on a diagonal pair,
    the document mask wherever documents are given (`docs`: full-sequence ids [b, s]), and a
    sliding `window` (query i sees keys i - window < j) on every pair."""
    k_pos = torch.cat([pos[g] for g in kv_chunks])
    q_doc = k_doc = None
    if docs is not None:
        q_doc = docs[:, q_chunk * c : (q_chunk + 1) * c]
        k_doc = torch.cat([docs[:, g * c : (g + 1) * c] for g in kv_chunks], dim=1)
    mask = attention_mask(pos[q_chunk] if causal else None, k_pos if causal else None, q_doc, k_doc)
    if window is None:
        return mask
    near = (pos[q_chunk][:, None] - k_pos[None, :] < window)[None, None]
    return near if mask is None else mask & near


def _sequence_docs(doc_ids: torch.Tensor | None, sequence_doc_ids: torch.Tensor | None, group) -> torch.Tensor | None:
    """The whole sequence's document ids [b, s]: `sequence_doc_ids` as given, else the shards
    `doc_ids` gathered over `group` (tiny integers: gathered once, not sent around the ring)."""
    if doc_ids is not None and sequence_doc_ids is not None:
        raise ValueError("give doc_ids (this rank's shard) or sequence_doc_ids (the whole sequence), not both")
    return sequence_doc_ids if doc_ids is None else gather_sequence(doc_ids, 1, group)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    *,
    doc_ids: torch.Tensor | None = None,
    scale: float | None = None,
    stats: RingStats | None = None,
    sequence_doc_ids: torch.Tensor | None = None,
    blocks: str = "auto",
    window: int | None = None,
) -> torch.Tensor:
    """Causal (and, with `doc_ids`, document-masked) attention of this rank's load-balanced
    shard q [b, h, s/cp, d] over the whole sequence, kv [b, hkv, s/cp, d] passed around the ring
    of `group` (P2P); returns out [b, h, s/cp, d] in q's dtype. Backward: ring of kv and dk/dv.
    `blocks` computes each chunk pair: "tiles" (fp32 score tiles, any device, documents),
    "flash" (torch's flash attention returning the log-sum-exp; no documents) or "auto" (flash
    where `mpu.attention_blocks.flash_blocks_apply`: CUDA, fp16/bf16, no documents)."""
    if k.shape != v.shape:
        raise ValueError(f"ring attention needs k and v of one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if blocks not in RING_BLOCKS:
        raise ValueError(f"ring attention blocks={blocks!r} is unknown; use one of {', '.join(RING_BLOCKS)}")
    docs = _sequence_docs(doc_ids, sequence_doc_ids, group)
    masked = docs is not None or window is not None
    if blocks == "flash" and masked:
        raise ValueError("ring attention blocks='flash' takes no document mask or window; use 'tiles' or 'auto'")
    flash = blocks == "flash" or (blocks == "auto" and flash_blocks_apply(q, masked))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, docs, group, scale, stats, flash, window)


# ----------------------------------------------------------------- all-to-all (Ulysses)


def _seq_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[b, n, s/cp, d] sequence shard -> [b, n/cp, s, d] head shard with the sequence in order."""
    b, n, sl, d = x.shape
    x = x.reshape(b, cp, n // cp, sl, d).transpose(0, 1)  # head group r goes to rank r
    x = all_to_all(x, [1] * cp, [1] * cp, group)  # [cp (source rank), b, n/cp, s/cp, d]
    x = x.permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * sl, d)
    return _reorder_chunks(x, 2, _chunk_order(cp))


def _heads_to_seq(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """Inverse of `_seq_to_heads`: [b, n/cp, s, d] in sequence order -> [b, n, s/cp, d] shard."""
    b, nl, s, d = x.shape
    order = _chunk_order(cp)
    chunks = x.chunk(2 * cp, dim=2)
    x = torch.cat([chunks[g] for g in order], dim=2)  # ranks' shards one after another
    x = x.reshape(b, nl, cp, s // cp, d).permute(2, 0, 1, 3, 4)  # sequence shard r goes to rank r
    x = all_to_all(x, [1] * cp, [1] * cp, group)  # [cp (source head group), b, n/cp, s/cp, d]
    return x.transpose(0, 1).reshape(b, cp * nl, s // cp, d)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    *,
    doc_ids: torch.Tensor | None = None,
    scale: float | None = None,
    sequence_doc_ids: torch.Tensor | None = None,
    attention_backend: str = "auto",
    window: int | None = None,
) -> torch.Tensor:
    """Causal (and, with `doc_ids`, document-masked; with `window`, query i sees keys
    i - window < j <= i only) attention of this rank's load-balanced
    shard q [b, h, s/cp, d] over the whole sequence by all-to-all over `group` to h/cp heads of
    the full sequence and back; kv heads [b, hkv, s/cp, d] are replicated first when hkv is not a
    multiple of cp. Documents: `mpu.document_attention` with `attention_backend` on the whole
    sequence. Returns out [b, h, s/cp, d]; backward through the all-to-alls' autograd."""
    cp = group_size(group)
    h, hkv = q.shape[1], k.shape[1]
    check_cp_shapes(q.shape[2] * cp, h, cp, "a2a")
    if hkv % cp:
        # Each rank's h/cp q heads must find their kv heads: repeat each kv head m times
        # (m = cp / gcd(hkv, cp) divides h/hkv because cp divides h).
        m = cp // math.gcd(hkv, cp)
        k, v = k.repeat_interleave(m, dim=1), v.repeat_interleave(m, dim=1)
    if cp > 1:
        q, k, v = (_seq_to_heads(t, cp, group) for t in (q, k, v))
    docs = _sequence_docs(doc_ids, sequence_doc_ids, group)
    if docs is not None or window is not None:
        out = document_attention(q, k, v, docs, scale=scale, backend=attention_backend, window=window)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return _heads_to_seq(out, cp, group) if cp > 1 else out


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    comm: str = "ring",
    *,
    doc_ids: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    stats: RingStats | None = None,
    sequence_doc_ids: torch.Tensor | None = None,
    attention_backend: str = "auto",
    window: int | None = None,
) -> torch.Tensor:
    """Causal self-attention over the cp group `group` (see the module doc) with `comm` "ring" or
    "a2a". q [b, h, s/cp, d], k, v [b, hkv, s/cp, d] in the load-balanced chunk order; returns
    out [b, h, s/cp, d]. Document masks from `doc_ids` [b, s/cp] (this rank's shard, gathered)
    or `sequence_doc_ids` [b, s] (the whole sequence, as the model holds it); a2a runs them by
    `attention_backend` (`mpu.document_attention`), ring by its own blocks (auto or dense only).
    `dropout_p` > 0 is not supported with context parallelism (raises); a sliding `window`
    limits query i to keys i - window < j <= i (the ring: in its score tiles)."""
    if dropout_p > 0:
        raise ValueError(
            f"attention dropout {dropout_p} is not supported with context parallelism (set model.attention_dropout=0)"
        )
    check_cp_shapes(q.shape[2] * group_size(group), q.shape[1], group_size(group), comm)
    docs = dict(doc_ids=doc_ids, sequence_doc_ids=sequence_doc_ids)
    if comm == "ring":
        if attention_backend not in ("auto", "dense"):
            raise ValueError(f"attention backend {attention_backend!r} applies to cp_comm=a2a, not ring")
        return ring_attention(q, k, v, group, scale=scale, stats=stats, window=window, **docs)
    return ulysses_attention(q, k, v, group, scale=scale, attention_backend=attention_backend, window=window, **docs)
