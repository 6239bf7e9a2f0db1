"""Planned per-GPU memory of a model config under the main 8-GPU layouts (no GPU needed).

    python bench/plan_table.py                        # +model=gpt_1b, JSON on stdout
    python bench/plan_table.py --markdown             # the table in docs/planning.md

Each row is `planning.plan.plan_all_ranks` (what `trainer.dry_run=true` writes) for bf16 on
CUDA kernels, micro batch 1, global batch 16; the heaviest rank's bytes are reported.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.mpu.mesh import ParallelConfig
from meshtron.planning.plan import plan_all_ranks

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [  # (name, parallel sizes, optim.zero, trainer.recompute[, optim.param_dtype])
    ("tp=4 ep=8 (card)", dict(tp=4, ep=8), 0, "none"),
    ("tp=4 ep=8, zero=1", dict(tp=4, ep=8), 1, "none"),
    ("tp=4 ep=8, zero=2", dict(tp=4, ep=8), 2, "none"),
    ("tp=4 ep=8, zero=3", dict(tp=4, ep=8), 3, "none"),
    ("tp=4 ep=8, zero=1, bf16 weights", dict(tp=4, ep=8), 1, "none", "bf16"),
    ("tp=4 ep=8, zero=3, bf16 weights", dict(tp=4, ep=8), 3, "none", "bf16"),
    ("tp=4 ep=8, zero=1, recompute=full", dict(tp=4, ep=8), 1, "full"),
    ("tp=1 dp=8 ep=8, zero=1", dict(tp=1, ep=8), 1, "none"),
    ("tp=1 dp=8 ep=8, zero=3", dict(tp=1, ep=8), 3, "none"),
    ("tp=8 ep=8", dict(tp=8, ep=8), 0, "none"),
    ("tp=4 pp=2 ep=4 (1f1b), zero=1", dict(tp=4, pp=2, ep=4), 1, "none"),
]
KEYS = (
    "weights",
    "main_params",
    "grads",
    "optimizer",
    "activations",
    "total",
)  # main_params: fp32 main weights of bf16-resident runs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt_1b", help="a configs/model/*.yaml name")
    p.add_argument("--markdown", action="store_true", help="print a markdown table (GiB) instead of JSON")
    args = p.parse_args(argv)
    cfg = GPTConfig(**yaml.safe_load((ROOT / "configs" / "model" / f"{args.model}.yaml").read_text()))
    rows = []
    for name, par, zero, recompute, *param_dtype in LAYOUTS:
        plan = plan_all_ranks(
            cfg,
            ParallelConfig(**par),
            8,
            micro_batch_size=1,
            global_batch_size=16,
            precision="bf16",
            zero=zero,
            device="cuda",
            param_dtype=(param_dtype or ["fp32"])[0],
            execution=ExecutionConfig(recompute=recompute),
        )
        heaviest = max(plan["ranks"], key=lambda r: r["memory"]["bytes"]["total"])
        rows.append({"layout": name, "bytes": {k: heaviest["memory"]["bytes"].get(k, 0) for k in KEYS}})
    if not args.markdown:
        print(json.dumps({"model": args.model, "gpus": 8, "precision": "bf16", "rows": rows}))
        return
    print("| layout (8 GPUs, bf16, micro batch 1, global batch 16) | " + " | ".join(KEYS) + " |")
    print("|---" * (len(KEYS) + 1) + "|")
    for row in rows:
        print(f"| {row['layout']} | " + " | ".join(f"{row['bytes'][k] / 2**30:.2f}" for k in KEYS) + " |")


if __name__ == "__main__":
    main()
