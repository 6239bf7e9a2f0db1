"""End-to-end MoE training speed beside Megatron-Core, in one run on the same machine.

Alternates rounds of Megatron-Core's MoE GPT (../shared/peers/mcore_moe.py, run in its own
venv $MCORE_VENV, default ~/.cache/meshtron-peers/mcore, made by ../shared/peers/setup) and
meshtron's real training step (bench/throughput.py) at the same shape: Llama-like, 4 layers,
hidden 256, 4 heads, seq 128, global batch 8, vocab 8192, tied embeddings, 8 experts top-2 with
expert ffn 512 in every layer, aux-loss coefficient 0.01, dropless, fp32, AdamW. Each layout
runs as 1 process x 2 threads (ep=1) or 2 processes x 1 thread (ep=2, dp=2), one command at a
time, so both systems see the same machine load in every round.

    python bench/moe_vs_megatron.py                     # ep=1 and ep=2, 3 rounds
    python bench/moe_vs_megatron.py --layouts 1 --rounds 5

Prints ONE JSON object: per layout the tokens/s of every round for both systems, their
medians and meshtron / Megatron-Core (median of the per-round ratios, which cancels slow
drifts of the host load).

meshtron's processes keep freed host memory for reuse (training/host_malloc.py: mallopt, as
train.py runs do). To show what that alone is worth, `megatron_core_keep_freed` runs
Megatron-Core a second time per round with the same glibc settings given as environment
variables (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=2147483647); `--no-peer-keep-freed`
skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
SHAPE = dict(layers=4, hidden=256, heads=4, seq=128, batch=8, vocab=8192, experts=8, topk=2, moe_ffn=512)


KEEP_FREED_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


def commands(ep: int, steps: int, warmup: int, mcore_python: str) -> dict[str, list[str]]:
    """The Megatron-Core and meshtron commands of one layout (ep = number of processes)."""
    s = SHAPE
    common = ["--layers", str(s["layers"]), "--hidden", str(s["hidden"]), "--heads", str(s["heads"]),
              "--seq", str(s["seq"]), "--batch", str(s["batch"]), "--vocab", str(s["vocab"]),
              "--steps", str(steps), "--warmup", str(warmup), "--threads", str(2 // ep)]
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ep}"]
    mcore = [mcore_python, *launch, str(PEERS / "mcore_moe.py"), *common, "--ep", str(ep),
             "--experts", str(s["experts"]), "--topk", str(s["topk"]), "--moe-ffn", str(s["moe_ffn"]),
             "--aux-loss-coeff", "0.01"]
    meshtron = [sys.executable, *launch, str(ROOT / "bench" / "throughput.py"), *common, "--arch", "llama",
                "--experts", str(s["experts"]), "--top-k", str(s["topk"]), "--moe-ffn", str(s["moe_ffn"]),
                "--ep", str(ep)]
    return {"megatron_core": mcore, "meshtron": meshtron}


def run_json(cmd: list[str], threads: int, extra_env: dict | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **(extra_env or {}))
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", type=int, nargs="+", default=[1, 2], help="ep values (= processes)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-peer-keep-freed", action="store_true",
                   help="skip the Megatron-Core run with meshtron's glibc malloc settings")
    p.add_argument("--mcore-venv", default=os.environ.get("MCORE_VENV",
                                                          str(Path.home() / ".cache/meshtron-peers/mcore")))
    args = p.parse_args(argv)
    mcore_python = str(Path(args.mcore_venv) / "bin" / "python")
    if not Path(mcore_python).exists():
        sys.exit(f"no Megatron-Core venv at {args.mcore_venv}: run ../shared/peers/setup (or set MCORE_VENV)")
    result = {"bench": "moe_vs_megatron", "shape": SHAPE, "rounds": args.rounds, "layouts": {}}
    for ep in args.layouts:
        cmds = commands(ep, args.steps, args.warmup, mcore_python)
        envs = {}
        if not args.no_peer_keep_freed:
            cmds["megatron_core_keep_freed"] = cmds["megatron_core"]
            envs["megatron_core_keep_freed"] = KEEP_FREED_ENV
        rounds = {name: [] for name in cmds}
        for r in range(args.rounds):
            order = list(cmds) if r % 2 == 0 else list(reversed(cmds))  # alternate who goes first
            for name in order:
                record = run_json(cmds[name], 2 // ep, envs.get(name))
                rounds[name].append(float(record["tokens_per_s"]))
                print(f"ep={ep} round {r} {name}: {record['tokens_per_s']} tokens/s", file=sys.stderr)
        ratios = {peer: [m / c for m, c in zip(rounds["meshtron"], rounds[peer])] for peer in rounds
                  if peer != "meshtron"}
        result["layouts"][f"ep{ep}"] = {
            "processes_x_threads": f"{ep}x{2 // ep}",
            "tokens_per_s": rounds,
            "median_tokens_per_s": {name: statistics.median(v) for name, v in rounds.items()},
            "meshtron_over": {peer: round(statistics.median(r), 3) for peer, r in ratios.items()},
            "per_round_ratio": {peer: [round(x, 3) for x in r] for peer, r in ratios.items()},
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
