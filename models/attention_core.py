"""The attention core of both attention modules (models/gpt.py `Attention`, models/mla.py
`MLAttention`): causal softmax(q k^T * scale) v over this rank's heads, with dropout, packed
documents, a sliding window and context parallelism."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from meshtron.mpu.context_parallel import context_parallel_attention
from meshtron.mpu.document_attention import document_attention
from meshtron.mpu.mesh import Mesh
from meshtron.mpu.random import get_rng_tracker


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: Mesh,
    *,
    doc_ids: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    scale: float | None = None,
    window: int | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v for q [b, h, s/cp, d], k [b, hkv, s/cp, d] and v
    [b, hkv, s/cp, dv] (scale None: 1/sqrt(d)); dropout on the probabilities from the
    tensor-parallel RNG stream. `doc_ids` [b, s] (the whole sequence's, on every cp rank)
    restricts attention to each packed document, by the backend `backend` picks
    (mpu.document_attention: no dense mask where it can); a sliding `window` limits query i to
    keys i - w < j <= i (a sequence no longer than it is plain causal attention).

    With context parallelism the sequence is sharded over `mesh.cp` (talks over it) and the
    ring / all-to-all attention of mpu.context_parallel runs (fp32 accumulation); the ring
    passes k and v as one message of one shape, so a narrower v (latent attention) is
    zero-padded to the q/k width there and the output cut back."""
    window = window if window is not None and window < q.shape[2] * mesh.cp_size else None
    if mesh.cp_size > 1:
        comm, dv = mesh.par.cp_comm, v.shape[-1]
        if comm == "ring" and dv != q.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - dv))
        out = context_parallel_attention(
            q, k, v, mesh.cp, comm, sequence_doc_ids=doc_ids, dropout_p=dropout_p, scale=scale,
            attention_backend=backend, window=window,
        )  # fmt: skip
        return out[..., :dv].to(q.dtype)
    with get_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext():
        if doc_ids is not None or window is not None:
            return document_attention(
                q, k, v, doc_ids, dropout_p=dropout_p, backend=backend, scale=scale, window=window
            )
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
