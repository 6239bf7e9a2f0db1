"""Run some multi-process cases outside pytest, in one world, and print each verdict:

    python -m tests.distributed 8                               # every case of the 8-rank world
    python -m tests.distributed 4 moe_dispatch_cases            # one module's cases at world 4
    python -m tests.distributed 8 pipeline_cases async          # those whose name contains a word

Cases are the same functions pytest runs (tests/distributed/registry.py), started once per
world by the harness with a file store and a collective timeout. Exit status 1 when a case
failed, 2 when nothing matched.
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.distributed.harness import run_world
from tests.distributed.registry import COLLECTIVE_TIMEOUT_S, WORLD_TIMEOUT_S, cases_for_world


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.distributed", description=__doc__.splitlines()[0])
    p.add_argument("world", type=int, help="world size (2, 4 or 8 have cases)")
    p.add_argument("module", nargs="?", default=None, help="case module, e.g. pipeline_cases (default: all)")
    p.add_argument("contains", nargs="?", default="", help="run only cases whose name contains this")
    args = p.parse_args(argv)
    module = None if args.module is None else f"tests.distributed.{args.module.removeprefix('tests.distributed.')}"
    try:
        cases = [c for c in cases_for_world(args.world, module) if args.contains in c.split(":", 1)[1]]
    except ModuleNotFoundError as err:
        print(f"{err}: name a module of tests/distributed, e.g. pipeline_cases", file=sys.stderr)
        return 2
    if not cases:
        print(
            f"no case of world {args.world} matches module={args.module!r} contains={args.contains!r}", file=sys.stderr
        )
        return 2
    start = time.perf_counter()
    results = run_world(args.world, cases, timeout=WORLD_TIMEOUT_S, collective_timeout=COLLECTIVE_TIMEOUT_S)
    failed = [case for case, result in results.items() if not result["ok"]]
    for case, result in results.items():
        print(("OK  " if result["ok"] else "FAIL") + f" {case}")
        for rank, error in [] if result["ok"] else result["errors"].items():
            print(f"--- rank {rank} ---\n{error}")
    print(f"{len(cases) - len(failed)}/{len(cases)} passed in {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
