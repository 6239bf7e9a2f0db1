"""A microbatch as this rank feeds it to the model: its context-parallel shard of every
sequence, and, for packed documents, per-token document ids and positions.

The data loader hands every rank of a cp group the same full-length microbatch (token ids are
small); `local_microbatch` computes document ids and positions over the full sequence (a
document may span cp chunks) and then cuts inputs, targets and positions into the
load-balanced cp shard. The document ids stay whole: attention masks against the whole
sequence, so no rank needs to gather them (`mpu.context_parallel.shard_sequence`: chunks cp_rank and
2*cp-1-cp_rank). Targets are cut like inputs, so each rank's loss covers its own tokens and the
sum over dp x cp is the global batch's. With multi-token prediction (`mtp_depths`) every
depth's shifted ids and labels are computed on the full sequences too (they reach across cp
chunks: models/mtp.py `depth_batch`) and cut like the targets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshtron.models.mtp import depth_batch
from meshtron.mpu.attention_blocks import document_ids
from meshtron.mpu.context_parallel import shard_sequence
from meshtron.mpu.mesh import Mesh


@dataclass
class LocalMicrobatch:
    """Inputs [b, s/cp], targets [b, s/cp] and the model's keyword arguments (`positions`
    [b, s/cp] and `doc_ids` [b, s] for packed documents; `mtp_inputs` and `mtp_labels`
    [D, b, s/cp] with D multi-token prediction depths; empty otherwise)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    forward_kwargs: dict = field(default_factory=dict)


def local_microbatch(
    inputs: torch.Tensor, targets: torch.Tensor, mesh: Mesh, eos_id: int | None = None, mtp_depths: int = 0
) -> LocalMicrobatch:
    """This rank's share of one microbatch of full sequences `inputs`/`targets` [b, s]: the cp
    shard along the sequence and, when `eos_id` is given (packed documents, `data.reset_at_eos`),
    the whole sequence's document ids and this shard's positions, restarting after every
    `eos_id` input token; with `mtp_depths`, each depth's shifted ids and labels of the full
    sequences, cut like the targets."""
    kwargs = {}
    if eos_id is not None:
        doc, pos = document_ids(inputs, eos_id)
        kwargs = {"doc_ids": doc, "positions": pos}
    if mtp_depths:
        kwargs["mtp_inputs"], kwargs["mtp_labels"] = depth_batch(inputs, targets, mtp_depths, kwargs.get("doc_ids"))
    cp = mesh.cp_size
    if cp > 1:
        rank = mesh.cp_rank
        inputs, targets = shard_sequence(inputs, 1, cp, rank), shard_sequence(targets, 1, cp, rank)
        for key, dim in (("positions", 1), ("mtp_inputs", 2), ("mtp_labels", 2)):
            if key in kwargs:
                kwargs[key] = shard_sequence(kwargs[key], dim, cp, rank)
    return LocalMicrobatch(inputs, targets, kwargs)


def local_microbatches(
    microbatches, mesh: Mesh, eos_id: int | None = None, mtp_depths: int = 0
) -> list[LocalMicrobatch]:
    """`local_microbatch` of each (inputs, targets) pair."""
    return [local_microbatch(x, y, mesh, eos_id, mtp_depths) for x, y in microbatches]
