"""Bytes crossing nodes per step: flat vs hierarchical data-parallel gradient all-reduce, as JSON.

    # two torchrun agents on this host, 2 ranks each (2 "nodes"): node = rank // LOCAL_WORLD_SIZE
    OMP_NUM_THREADS=1 torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d \\
        --rdzv_endpoint=127.0.0.1:29411 --rdzv_id=hier bench/hierarchical_allreduce.py   # run twice, one per agent
    # one agent, nodes simulated: 4 ranks as 2 nodes of 2
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 bench/hierarchical_allreduce.py --ranks-per-node 2

Trains nothing: each step is one forward/backward of a tiny GPT (dp = world) whose gradient
buckets the `DataParallelGradReducer` reduces, once with `parallel.dp_hierarchical=false` and
once with `true`, on the same data. `InterNodeCounter` counts, per rank, the bytes each
collective of the step sends to a rank on another node, modelling every collective as the
ring over its group's ranks in group order (ring all-reduce: 2(n-1)/n x B to the next rank;
reduce-scatter and all-gather: (n-1)/n x B): the bytes are counted from the calls the code
really makes; which link carries them is the ring model's (gloo and NCCL pick their own
algorithms: a tree or halving-doubling all-reduce moves the same bytes per rank but over other
pairs). Prints, per mode, the per-rank inter-node bytes (max, total) beside the formulas
flat 2(n-1)/n x B per boundary rank (N of them) and hierarchical 2(N-1)/N x B/L per rank,
with n = N x L ranks, N nodes, L ranks per node, B = the dp buckets' bytes; and the largest
relative difference between the two modes' reduced gradients.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

# The "nodes" here are torchrun agents on one host, where the flat dp buckets would be summed
# through shared memory (dp/grad_reduce.py); on real nodes they go through the process
# group, whose calls this bench counts. Read by mpu.shm_collectives at import.
os.environ["MESHTRON_SHM_COLLECTIVES"] = "0"

import meshtron.dp.hierarchical as hierarchical  # noqa: E402
from meshtron.dp.grad_reduce import DataParallelGradReducer  # noqa: E402
from meshtron.models.config import GPTConfig  # noqa: E402
from meshtron.models.gpt import init_model_chunks  # noqa: E402
from meshtron.mpu.mesh import ParallelConfig, build_mesh  # noqa: E402


class InterNodeCounter:
    """Within the block, count the bytes this rank's collectives send to other nodes
    (`inter_node`) and in all (`sent`), node = rank // ranks_per_node, each collective modelled
    as a ring over its group in group-rank order (module doc). Wraps `dist.all_reduce` and the
    reduce-scatter/all-gather the hierarchical all-reduce calls."""

    def __init__(self, ranks_per_node: int):
        self.ranks_per_node = ranks_per_node
        self.inter_node = 0.0
        self.sent = 0.0
        self.calls = 0

    def _count(self, group, nbytes: int, fraction_of) -> None:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        n = len(ranks)
        if n <= 1:
            return
        me = ranks.index(dist.get_rank())
        nxt = ranks[(me + 1) % n]
        amount = fraction_of(n) * nbytes
        self.sent += amount
        self.calls += 1
        if nxt // self.ranks_per_node != dist.get_rank() // self.ranks_per_node:
            self.inter_node += amount

    def __enter__(self):
        self._originals = (dist.all_reduce, hierarchical.reduce_scatter_into, hierarchical.all_gather_into)
        all_reduce, reduce_scatter, all_gather = self._originals

        def counted_all_reduce(tensor, *args, group=None, **kwargs):
            self._count(group, tensor.numel() * tensor.element_size(), lambda n: 2 * (n - 1) / n)
            return all_reduce(tensor, *args, group=group, **kwargs)

        def counted_reduce_scatter(output, input, group, async_op=False):
            self._count(group, input.numel() * input.element_size(), lambda n: (n - 1) / n)
            return reduce_scatter(output, input, group=group, async_op=async_op)

        def counted_all_gather(output, input, group, async_op=False):
            self._count(group, output.numel() * output.element_size(), lambda n: (n - 1) / n)
            return all_gather(output, input, group=group, async_op=async_op)

        dist.all_reduce = counted_all_reduce
        hierarchical.reduce_scatter_into = counted_reduce_scatter
        hierarchical.all_gather_into = counted_all_gather
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce, hierarchical.reduce_scatter_into, hierarchical.all_gather_into = self._originals


def formulas(bucket_bytes: int, nodes: int, local: int) -> dict:
    """Inter-node bytes per step of the ring model: flat (per boundary rank, N of them; total)
    and hierarchical (per rank; total)."""
    n = nodes * local
    flat = 2 * (n - 1) / n * bucket_bytes
    hier = 2 * (nodes - 1) / nodes * bucket_bytes / local
    return {
        "flat_per_boundary_rank": flat,
        "flat_total": nodes * flat if nodes > 1 else 0.0,
        "hierarchical_per_rank": hier,
        "hierarchical_total": n * hier,
    }


def measure(cfg: GPTConfig, ranks_per_node: int, steps: int, mode: bool) -> dict:
    """`steps` forward/backward + gradient reductions with parallel.dp_hierarchical=`mode`:
    this rank's counted bytes, the dp buckets' bytes, the reduced gradients and the time."""
    mesh = build_mesh(ParallelConfig(tp=1, dp_hierarchical=mode), cfg, ranks_per_node=ranks_per_node)
    (model,) = init_model_chunks(cfg, mesh, 1234)
    reducer = DataParallelGradReducer(list(model.named_parameters()), mesh)
    if mode and reducer.hierarchy is None:
        raise SystemExit("parallel.dp_hierarchical=true did not select the hierarchical all-reduce")
    gen = torch.Generator().manual_seed(7 + mesh.dp_rank)
    counter = InterNodeCounter(ranks_per_node)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=gen)
        reducer.zero_grad()
        start = time.perf_counter()
        with counter:
            with reducer.sync(True):
                model.loss_per_token(model(tokens[:, :-1]), tokens[:, 1:]).mean().backward()
            reducer.finish()
        times.append(time.perf_counter() - start)
    grads = torch.cat([b.buffer.clone() for b in reducer.buckets])
    bucket_bytes = sum(b.numel * b.buffer.element_size() for b in reducer.buckets if b.key == "dp")
    reducer.remove_hooks()
    return {
        "inter_node": counter.inter_node / steps,
        "sent": counter.sent / steps,
        "calls": counter.calls / steps,
        "bucket_bytes": bucket_bytes,
        "grads": grads,
        "step_s": sorted(times)[len(times) // 2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="simulate nodes of this many ranks (default: torchrun's LOCAL_WORLD_SIZE)",
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise SystemExit("run under torchrun with at least 2 processes (see the module doc)")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rpn = args.ranks_per_node or int(os.environ["LOCAL_WORLD_SIZE"])
    world = dist.get_world_size()
    cfg = GPTConfig(
        arch="gpt2",
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=4,
        vocab_size=256,
        seq_len=args.seq,
        tie_embeddings=True,
    )
    flat = measure(cfg, rpn, args.steps, False)
    hier = measure(cfg, rpn, args.steps, True)
    diff = ((hier["grads"] - flat["grads"]).norm() / flat["grads"].norm()).item()
    mine = {
        "rank": dist.get_rank(),
        "flat": flat["inter_node"],
        "hierarchical": hier["inter_node"],
        "flat_sent": flat["sent"],
        "hierarchical_sent": hier["sent"],
        "rel_diff": diff,
        "flat_step_s": flat["step_s"],
        "hierarchical_step_s": hier["step_s"],
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    shape = hierarchical.hierarchy_shape(ParallelConfig(tp=1).resolved(world), world, rpn)
    if dist.get_rank() == 0:
        nodes, local = shape
        b = flat["bucket_bytes"]
        print(
            json.dumps(
                {
                    "world": world,
                    "nodes": nodes,
                    "ranks_per_node": local,
                    "bucket_bytes_per_step": b,
                    "model": "ring over each group's ranks in group order; bytes counted from the collectives called",
                    "flat": {
                        "inter_node_bytes_per_rank": [r["flat"] for r in everyone],
                        "max": max(r["flat"] for r in everyone),
                        "total": sum(r["flat"] for r in everyone),
                        "all_bytes_per_rank": [r["flat_sent"] for r in everyone],
                        "median_step_s": [r["flat_step_s"] for r in everyone],
                    },
                    "hierarchical": {
                        "inter_node_bytes_per_rank": [r["hierarchical"] for r in everyone],
                        "max": max(r["hierarchical"] for r in everyone),
                        "total": sum(r["hierarchical"] for r in everyone),
                        "all_bytes_per_rank": [r["hierarchical_sent"] for r in everyone],
                        "median_step_s": [r["hierarchical_step_s"] for r in everyone],
                    },
                    "formula": formulas(b, nodes, local),
                    "max_rel_diff_of_reduced_gradients": max(r["rel_diff"] for r in everyone),
                },
                indent=1,
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
