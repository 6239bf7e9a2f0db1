"""Activation memory kept for backward, per recompute mode, beside the planner's estimate, as JSON.

    python bench/activation_memory.py --layers 4 --hidden 256 --heads 4 --seq 512 --batch 4
    python bench/activation_memory.py --arch llama --kv-heads 2 --dropout 0

Counts the bytes of the tensors autograd saves for backward during one forward and loss of
one microbatch (through `torch.autograd.graph.saved_tensors_hooks`, each storage counted once,
parameters excluded), for trainer.recompute = none, selective and full, single process, and
prints them beside the dry-run planner's estimate of the same quantity
(`planning.plan.chunk_activations(...).saved`, the planner's `activations_per_microbatch`:
the same hooks on the real modules traced on the meta device, `planning.activations`)
with the ratio planned / measured (the measurement also counts the whole token window
its input ids are a view of: 8 bytes per sample). `bench/memory.py` measures a whole step's peak instead.
"""

from __future__ import annotations

import argparse
import json

import torch  # noqa: E402

from meshtron.models.config import ExecutionConfig, GPTConfig  # noqa: E402
from meshtron.models.gpt import init_model_chunks  # noqa: E402
from meshtron.mpu.mesh import single_process_mesh  # noqa: E402
from meshtron.planning.activations import saved_activation_bytes  # noqa: E402
from meshtron.planning.plan import chunk_activations  # noqa: E402


def planned_saved_bytes(cfg: GPTConfig, batch: int, execution: ExecutionConfig) -> int:
    """The planner's saved-activation bytes of one microbatch through the whole model (tp = 1)."""
    return chunk_activations(
        cfg, batch, layers=range(cfg.num_layers), pre_process=True, post_process=True, device="cpu", execution=execution
    ).saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gpt2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dropout", type=float, default=0.1)
    args = parser.parse_args()
    report = {"config": vars(args), "modes": {}}
    for mode in ("none", "selective", "full"):
        cfg = GPTConfig(
            arch=args.arch,
            num_layers=args.layers,
            hidden_size=args.hidden,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            seq_len=args.seq,
            vocab_size=args.vocab,
            dropout=args.dropout,
        )
        execution = ExecutionConfig(recompute=mode)
        mesh = single_process_mesh()
        (model,) = init_model_chunks(cfg, mesh, 0, execution=execution)
        model.train()
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        measured = saved_activation_bytes(model, tokens[:, :-1], tokens[:, 1:])
        planned = planned_saved_bytes(cfg, args.batch, execution)
        report["modes"][mode] = {
            "saved_bytes": measured,
            "saved_mib": measured / 2**20,
            "planned_bytes": planned,
            "planned_mib": planned / 2**20,
            "planned_over_measured": planned / measured,
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
