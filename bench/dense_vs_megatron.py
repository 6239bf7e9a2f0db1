"""Dense GPT training speed beside Megatron-Core at tp=1 and tp=2, in one run on the same machine.

Alternates rounds of Megatron-Core's GPT (../shared/peers/mcore_gpt.py, run in its own venv
$MCORE_VENV, default ~/.cache/meshtron-peers/mcore, made by ../shared/peers/setup) and
meshtron's real training step (bench/throughput.py) at the issue-15 / DESIGN.md reference
shape: GPT-2 style (LayerNorm, biased linears, GELU MLP 4h, learned positions, tied
embeddings), 4 layers, hidden 256, 4 heads, seq 128, batch 8, vocab 8192, fp32, AdamW.
tp=1 runs as 1 process x 2 threads, tp=2 as 2 processes x 1 thread, one command at a time,
so both systems see the same machine load in every round.

    python bench/dense_vs_megatron.py                    # tp=1 and tp=2, 3 rounds (about 4 minutes)
    python bench/dense_vs_megatron.py --layouts 2 --rounds 5 --gloo   # + meshtron with gloo TP collectives

Prints ONE JSON object: per layout the tokens/s, 1-minute load average and other processes'
busy CPUs of every run for both systems, their medians and meshtron / Megatron-Core (median
of the per-round ratios). On one host meshtron's CPU TP collectives go through shared memory
(mpu/shm_collectives.py); `--gloo` adds meshtron with them on gloo, as Megatron-Core's are.
"""

from __future__ import annotations

import argparse
import json
import sys

from peer_rounds import DEFAULT_MCORE_VENV, ROOT, launch, layout_rounds, mcore_python, peer_script

SHAPE = dict(layers=4, hidden=256, heads=4, seq=128, batch=8, vocab=8192)


def commands(tp: int, steps: int, warmup: int, mcore_python: str) -> dict[str, list[str]]:
    """The Megatron-Core and meshtron commands of one layout (tp = number of processes)."""
    common = [f"--{k}={v}" for k, v in SHAPE.items()]
    common += ["--steps", str(steps), "--warmup", str(warmup), "--threads", str(2 // tp)]
    mcore = [*launch(mcore_python, tp), *peer_script("mcore_gpt.py"), *common]
    meshtron = [
        *launch(sys.executable, tp),
        str(ROOT / "bench" / "throughput.py"),
        *common,
        "--arch",
        "gpt2",
        "--tp",
        str(tp),
    ]
    return {"megatron_core": mcore, "meshtron": meshtron}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", type=int, nargs="+", default=[1, 2], choices=[1, 2], help="tp values (= processes)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--gloo",
        action="store_true",
        help="at tp=2 also run meshtron with its TP collectives on gloo (MESHTRON_SHM_COLLECTIVES=0)",
    )
    p.add_argument("--mcore-venv", default=DEFAULT_MCORE_VENV)
    args = p.parse_args(argv)
    python = mcore_python(args.mcore_venv)
    layouts = layout_rounds(
        "tp", args.layouts, lambda tp: commands(tp, args.steps, args.warmup, python), args.rounds, gloo=args.gloo
    )
    print(json.dumps({"bench": "dense_vs_megatron", "shape": SHAPE, "rounds": args.rounds, "layouts": layouts}))


if __name__ == "__main__":
    main()
