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

Prints ONE JSON object: per layout the tokens/s of every round for both systems (from each
run's median step: bench/peer_rounds.py), their medians and meshtron / Megatron-Core (median
of the per-round ratios, which cancels slow drifts of the host load). On one host meshtron's
blocking CPU collectives (MoE statistics, the dispatch's backward all-to-alls, TP) go through
shared memory (mpu/shm_collectives.py); `--gloo` adds meshtron with them on gloo at ep=2.

meshtron's processes keep freed host memory for reuse (training/host_malloc.py: mallopt, as
train.py runs do). To show what that alone is worth, `megatron_core_keep_freed` runs
Megatron-Core a second time per round with the same glibc settings given as environment
variables (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_=2147483647); `--no-peer-keep-freed`
skips it.
"""

from __future__ import annotations

import argparse
import json
import sys

from peer_rounds import DEFAULT_MCORE_VENV, ROOT, launch, layout_rounds, mcore_python, peer_script

SHAPE = dict(layers=4, hidden=256, heads=4, seq=128, batch=8, vocab=8192, experts=8, topk=2, moe_ffn=512)


KEEP_FREED_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


def commands(ep: int, steps: int, warmup: int, mcore_python: str) -> dict[str, list[str]]:
    """The Megatron-Core and meshtron commands of one layout (ep = number of processes)."""
    s = SHAPE
    common = [
        "--layers",
        str(s["layers"]),
        "--hidden",
        str(s["hidden"]),
        "--heads",
        str(s["heads"]),
        "--seq",
        str(s["seq"]),
        "--batch",
        str(s["batch"]),
        "--vocab",
        str(s["vocab"]),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--threads",
        str(2 // ep),
    ]
    mcore = [
        *launch(mcore_python, ep),
        *peer_script("mcore_moe.py"),
        *common,
        "--ep",
        str(ep),
        "--experts",
        str(s["experts"]),
        "--topk",
        str(s["topk"]),
        "--moe-ffn",
        str(s["moe_ffn"]),
        "--aux-loss-coeff",
        "0.01",
    ]
    meshtron = [
        *launch(sys.executable, ep),
        str(ROOT / "bench" / "throughput.py"),
        *common,
        "--arch",
        "llama",
        "--experts",
        str(s["experts"]),
        "--top-k",
        str(s["topk"]),
        "--moe-ffn",
        str(s["moe_ffn"]),
        "--ep",
        str(ep),
    ]
    return {"megatron_core": mcore, "meshtron": meshtron}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", type=int, nargs="+", default=[1, 2], help="ep values (= processes)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--no-peer-keep-freed",
        action="store_true",
        help="skip the Megatron-Core run with meshtron's glibc malloc settings",
    )
    p.add_argument(
        "--gloo",
        action="store_true",
        help="at ep=2 also run meshtron with its CPU collectives on gloo (MESHTRON_SHM_COLLECTIVES=0)",
    )
    p.add_argument("--mcore-venv", default=DEFAULT_MCORE_VENV)
    args = p.parse_args(argv)
    python = mcore_python(args.mcore_venv)

    def keep_freed_peer(cmds: dict, envs: dict) -> None:
        if not args.no_peer_keep_freed:  # Megatron-Core again with meshtron's glibc malloc settings
            cmds["megatron_core_keep_freed"] = cmds["megatron_core"]
            envs["megatron_core_keep_freed"] = KEEP_FREED_ENV

    layouts = layout_rounds(
        "ep",
        args.layouts,
        lambda ep: commands(ep, args.steps, args.warmup, python),
        args.rounds,
        gloo=args.gloo,
        variants=keep_freed_peer,
    )
    print(json.dumps({"bench": "moe_vs_megatron", "shape": SHAPE, "rounds": args.rounds, "layouts": layouts}))


if __name__ == "__main__":
    main()
