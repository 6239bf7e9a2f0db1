"""Activation memory kept for backward, per recompute mode, as JSON.

    python bench/activation_memory.py --layers 4 --hidden 256 --heads 4 --seq 512 --batch 4

Counts the bytes of the tensors autograd saves for backward during one forward of one
microbatch (through `torch.autograd.graph.saved_tensors_hooks`, each storage counted once),
for trainer.recompute = none, selective and full, single process, and prints them beside
the dry-run planner's estimate (`training.flops.activation_bytes_per_microbatch`, which
models no recomputation). Parameters are excluded (they are not activations).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from models.config import GPTConfig  # noqa: E402
from models.gpt import init_model_chunks  # noqa: E402
from mpu.mesh import single_process_mesh  # noqa: E402
from training.flops import activation_bytes_per_microbatch  # noqa: E402


def saved_activation_bytes(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """Bytes of distinct storages autograd keeps for backward during one forward (no params)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_ptrs:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss_per_token(model(inputs), targets).mean()
    loss.backward()
    return sum(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gpt2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dropout", type=float, default=0.1)
    args = parser.parse_args()
    report = {"config": vars(args), "modes": {}}
    for mode in ("none", "selective", "full"):
        cfg = GPTConfig(arch=args.arch, num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                        seq_len=args.seq, vocab_size=args.vocab, dropout=args.dropout, recompute=mode)
        mesh = single_process_mesh()
        model, = init_model_chunks(cfg, mesh, 0)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        measured = saved_activation_bytes(model, tokens[:, :-1], tokens[:, 1:])
        report["modes"][mode] = {"saved_bytes": measured, "saved_mib": measured / 2**20}
    planner = activation_bytes_per_microbatch(cfg, args.batch, 1, False)
    report["planner_estimate_no_recompute_mib"] = planner / 2**20
    report["planner_over_measured_none"] = planner / report["modes"]["none"]["saved_bytes"]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
