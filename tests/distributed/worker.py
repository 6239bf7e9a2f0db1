"""Worker process of `harness.run_world`: join the gloo world, run the cases, write results."""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import importlib
import json
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron.mpu import shm_collectives


def _destroy_case_groups() -> None:
    """Destroy every process group a case created (its meshes' tp/dp/ep/... groups). Each
    gloo group keeps TCP event-loop threads; left alive across the ~20 cases of a world they
    add up to hundreds of threads per rank that busy-poll and starve the cases after them
    (an 8-rank world slowed past its timeout)."""
    world = dist.group.WORLD
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
    shm_collectives.reset()  # their shared-memory segments too (every rank resets at the same point)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--collective-timeout", type=float, default=60.0)
    parser.add_argument("--dump-stacks-after", type=float, default=0.0)
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args()
    if args.dump_stacks_after > 0:
        # A hang shows where every rank was stuck (in the rank's log, shown by the harness).
        faulthandler.dump_traceback_later(args.dump_stacks_after, exit=False)
    torch.set_num_threads(1)
    if args.backend != "gloo":  # recorded_gloo: every call logged, shared memory off (mpu/rehearsal_groups.py)
        from meshtron.mpu import rehearsal_groups

        rehearsal_groups.register_backends()
        shm_collectives.set_enabled(False)
    dist.init_process_group(
        args.backend,
        init_method=f"file://{args.store}",
        rank=args.rank,
        world_size=args.world_size,
        timeout=datetime.timedelta(seconds=args.collective_timeout),
    )
    shm_collectives.set_timeout(args.collective_timeout)
    results: dict[str, str] = {}
    out = Path(args.out) / f"result{args.rank}.json"
    for case in args.cases.split(","):
        try:
            module_name, func = case.split(":")
            getattr(importlib.import_module(module_name), func)()
            results[case] = "ok"
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[case] = traceback.format_exc()
        out.write_text(json.dumps(results))
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001
            break
        _destroy_case_groups()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
