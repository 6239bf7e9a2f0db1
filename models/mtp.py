"""Multi-token prediction (DeepSeek-V3, section 2.2; `model.mtp_depths`, `model.mtp_loss_weight`).

D sequential depths sit after the main model on the last pipeline stage. Depth k (1..D) at
position i takes the previous depth's hidden state h^{k-1}_i and the embedding of token
t_{i+k}, and predicts t_{i+k+1}:

    h'_i = M_k [enorm_k(Emb(t_{i+k})); hnorm_k(h^{k-1}_i)]      (M_k: [h, 2h], no bias)
    h^k  = TRM_k(h')                                            (one meshtron `Block`)
    loss_k = CE(Head(norm_k(h^k_i)), t_{i+k+1})

Reference points, stated where the sources differ:
* h^0 is the main model's final hidden state *after* the final norm, the tensor the LM head
  reads: Megatron-Core applies the decoder's final layernorm inside the decoder block, before
  `self.mtp` (transformer_block.has_final_layernorm_in_this_stage puts it with the last decoder
  layer when MTP is on).
* The concatenation is [embedding; hidden], in Megatron-Core's `_concat_embeddings` order and
  that of DeepSeek-V3's released `eh_proj` weights (the paper writes [h; emb]; the order only
  permutes M_k's columns).
* Each depth has its own final norm before the shared head (Megatron-Core's per-layer
  `final_layernorm`, DeepSeek-V3's `shared_head.norm`); the head weight and the embedding are
  the main model's (tied or not).
* The embedding is the token embedding alone (DeepSeek-V3 has no learned positions; under
  `position=learned` the depths get no position term), without dropout; the block uses the
  main model's positions i (RoPE) and document masks, as Megatron-Core passes the main
  model's rotary embedding and attention mask to its MTP layers.
* Sequence end: Megatron-Core rolls the ids and labels left (zero fill) and masks the rolled-in
  positions. Here likewise: depth k embeds ids shifted left by k (the last k positions embed
  token 0) and its labels are the targets shifted left by k, the last k positions ignored
  (IGNORE_INDEX): they would need tokens past the sequence. Causal attention keeps those
  filler positions from reaching any counted one.
* Packed documents (`doc_ids`): the label of position i at depth k is ignored when position
  i + k lies in another document than i (the chain i -> i+k would cross a boundary), as
  Megatron-Core's packed-sequence roll zero-fills each sequence's end; a target the main loss
  ignores stays ignored.
* The loss of depth k is its summed cross-entropy over the global batch divided by the global
  number of its counted labels (its mean over the batch, exact under any dp / microbatch
  split); the objective adds mtp_loss_weight / D * sum_k loss_k (Megatron-Core's
  mtp_loss_scaling_factor / mtp_num_layers), computed only in training mode.

The projection M_k is replicated over tp (fed [s/tp, b, 2h] sequence shards under SP, so its
gradient is summed over tp like the norms'; without SP every rank computes the same rows):
no collective of its own.

Context parallelism: the shift crosses cp shards, so a training step computes every depth's
shifted ids and labels on the full sequences before the cp split (`depth_batch`, called by
training/packing.py `local_microbatch`) and cuts them like the tokens; the depths' blocks run
the model's cp attention with this rank's positions and the whole sequence's document ids, as
the main blocks do, and each rank's depth loss covers its own positions (`depth_target_counts`
counts the sharded labels, so the sum over dp x cp is the global count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.mpu.cross_entropy import IGNORE_INDEX
from meshtron.mpu.init import normal_init, tag


def shifted_ids(ids: torch.Tensor, k: int) -> torch.Tensor:
    """Token ids [b, s] shifted left by `k`: position i holds t_{i+k}; the last k positions 0."""
    out = torch.zeros_like(ids)
    out[:, : ids.shape[1] - k] = ids[:, k:]
    return out


def depth_targets(targets: torch.Tensor, k: int, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Labels [b, s] of depth `k` from the main targets [b, s] (targets[i] = t_{i+1}): position
    i gets targets[i + k] = t_{i+k+1}; the last k positions, and (with `doc_ids` [b, s]) those
    whose position i + k lies in another document, are IGNORE_INDEX."""
    s = targets.shape[1]
    out = torch.full_like(targets, IGNORE_INDEX)
    if k >= s:
        return out
    labels = targets[:, k:]
    if doc_ids is not None:
        doc_ids = doc_ids.to(targets.device)
        labels = labels.masked_fill(doc_ids[:, k:] != doc_ids[:, : s - k], IGNORE_INDEX)
    out[:, : s - k] = labels
    return out


def depth_batch(
    ids: torch.Tensor, targets: torch.Tensor, depths: int, doc_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels of depths 1..`depths` from whole sequences: `shifted_ids` of `ids` and
    `depth_targets` of `targets` (with `doc_ids`), each [b, s], stacked to [depths, b, s]."""
    inputs = torch.stack([shifted_ids(ids, k) for k in range(1, depths + 1)])
    labels = torch.stack([depth_targets(targets, k, doc_ids) for k in range(1, depths + 1)])
    return inputs, labels


def _microbatch_labels(mb, depths: int) -> torch.Tensor:
    """[depths, b, s(/cp)] labels of one LocalMicrobatch: the `mtp_labels` cut before the cp
    split when it carries them, else computed from its (whole-sequence) targets."""
    labels = mb.forward_kwargs.get("mtp_labels")
    if labels is not None:
        return labels
    doc_ids = mb.forward_kwargs.get("doc_ids")
    return torch.stack([depth_targets(mb.targets, k, doc_ids) for k in range(1, depths + 1)])


def depth_target_counts(microbatches, depths: int) -> torch.Tensor:
    """Counted labels of each depth 1..`depths` over `microbatches` (LocalMicrobatch: targets
    and forward_kwargs), fp32 [depths], this rank's share (the caller sums it over dp x cp)."""
    counts = [(_microbatch_labels(mb, depths) != IGNORE_INDEX).sum(dim=(1, 2)) for mb in microbatches]
    if not counts:
        return torch.zeros(depths, dtype=torch.float32)
    return torch.stack(counts).sum(0).to(torch.float32)


class MTPDepth(nn.Module):
    """One prediction depth: `enorm`, `hnorm`, the projection `proj` [h, 2h], the block and the
    depth's own final `norm` (the shared head is applied by the model). The norms and the
    block come built from the model (models/gpt.py), so this module holds no layout logic
    beyond the replicated projection."""

    def __init__(self, cfg, mesh, depth: int, *, enorm, hnorm, block, norm, device=None, dtype=None):
        super().__init__()
        h = cfg.hidden_size
        self.depth = depth
        self.enorm, self.hnorm = enorm, hnorm
        self.proj = tag(
            nn.Parameter(torch.empty(h, 2 * h, device=device, dtype=dtype)),
            normal_init((h, 2 * h), cfg.init_std),
            sequence_parallel=mesh.sequence_parallel,
        )
        self.block = block
        self.norm = norm

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope, doc_ids=None) -> torch.Tensor:
        """h^k [s(/tp), b, h] from h^{k-1} and the embedding of the shifted tokens (same shape);
        the depth's final norm is left to the caller (`norm`)."""
        x = F.linear(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1), self.proj)
        return self.block(x, rope, doc_ids)
