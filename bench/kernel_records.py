"""The records a GPU kernel run writes (issue 36): the targets, the record schema, the check.

    python bench/kernel_records.py merge --dir DIR PART.json ...   # one file DIR/<UTC date>-<device>-kernels.json
    python bench/kernel_records.py check FILE.json ...             # schema and `met` of committed results

A results file `bench/results/gpu/<UTC date>-<device>-kernels.json` is ONE JSON list of
records, one per target of issue 36's "Done means" (`TARGETS`, in that order), each with
every key of `RECORD_KEYS`:

* `name`: the target as the issue names it, with the shape (`gpt_1b_tp4`: 4,096 tokens, h
  2048, ffn 5632/4, vocab 50688/4, experts 8 x 1,024 rows; `8b`: 8,192 tokens, h 4096, ffn
  14336, vocab 128256/4) or the hidden size (`h2048`) where that identifies it;
* `metric` and `unit`: what `meshtron` and `baseline` hold (device time of forward + backward,
  TFLOP/s, bytes, tokens/s ...);
* `ratio`: how many times better meshtron is than the baseline (baseline time / meshtron
  time; meshtron rate / baseline rate), or the fraction a metric names;
* `target`, `better` and `met`: `better` "higher" means met = ratio >= target, "lower" means
  met = meshtron <= target (host microseconds <= 10), "within" means met = |ratio - 1| <= target
  (a figure that must match its baseline to a tolerance: bench/rehearse_gpu.py's memory); no
  target (an informative figure) means met null; no figure (`meshtron` null: not built, failed
  or not measured, said in `note`) means met false;
* `device`, `date` (UTC), `torch`, `triton`: where and when;
* extra keys a record may carry: `shape`, `dtype`, `method` (how the device time was taken,
  per side: `cuda_graph`, `profiler` or `cpu_wall`), `device_ms`, `host_us`, `host_fwd_us`,
  `host_bwd_us`, `wall_ms` (per side), `meshtron_system`, `baseline_system`, `rehearsal`
  (a CPU run at tiny sizes: proves the code paths, measures nothing).

No torch import here: docs/kernels.md's table (bench/results_table.py) and the schema check
read the files without one.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

RECORD_KEYS = ("name", "metric", "meshtron", "baseline", "ratio", "target", "met", "device", "date", "torch", "triton")
EXTRA_KEYS = ("better", "unit")  # every record written here has them too
SHAPES = ("gpt_1b_tp4", "8b")
NOT_BUILT = "not built"


@dataclass(frozen=True)
class Target:
    name: str
    metric: str
    unit: str
    target: float | None
    better: str = "higher"  # "higher": ratio >= target; "lower": meshtron <= target; "within": |ratio - 1| <= target
    part: str = "gpt_1b_tp4"  # which part of the GPU run measures it (bench/gpu_session.sh kernels)


def _targets() -> list[Target]:
    fwd_bwd = "device time, forward + backward"
    out: list[Target] = []
    for s in SHAPES:
        out += [
            Target(f"gemm x·Wᵀ {s}", "device time, one GEMM vs torch.mm", "ms", 0.90, part=s),
            Target(f"gemm dX {s}", "device time, one GEMM vs torch.mm", "ms", 0.90, part=s),
            Target(f"gemm dW {s}", "device time, one GEMM vs torch.mm", "ms", 0.90, part=s),
            Target(f"linear+GeLU {s}", fwd_bwd + " vs torch eager", "ms", 1.00, part=s),
            Target(f"linear+SwiGLU {s}", fwd_bwd + " vs torch eager", "ms", 1.05, part=s),
            Target(f"cross-entropy vs F.cross_entropy {s}", fwd_bwd, "ms", 2.0, part=s),
            Target(f"cross-entropy extra memory {s}", "peak memory above the inputs", "bytes/token", 64, "lower", s),
            Target(f"grouped GEMM grouped_mm vs dense {s}", "fraction of the dense GEMM rate", "TFLOP/s", 0.60, part=s),
            Target(f"grouped GEMM Triton vs grouped_mm {s}", fwd_bwd, "ms", 0.85, part=s),
        ]
    tensors = "saved activations, in [tokens, ffn] tensors"
    out += [
        Target("linear+GeLU saved activations gpt_1b_tp4", tensors, "M×N tensors", 1, "lower"),
        Target("linear+SwiGLU saved activations gpt_1b_tp4", tensors, "M×N tensors", 2, "lower"),
        Target("residual+RMSNorm h2048 device", fwd_bwd + " vs eager x + delta; F.rms_norm", "ms", 1.3),
        Target("residual+RMSNorm h2048 wall", "wall time, forward + backward", "ms", 1.15),
        Target("residual+LayerNorm h2048 device", fwd_bwd + " vs eager x + delta; F.layer_norm", "ms", 1.3),
        Target("residual+LayerNorm h2048 wall", "wall time, forward + backward", "ms", 1.15),
        Target("residual+RMSNorm h2048 host", "host time per call and direction (the larger)", "us", 10, "lower"),
        Target("residual+LayerNorm h2048 host", "host time per call and direction (the larger)", "us", 10, "lower"),
        Target("RMSNorm h2048 host", "host time per call and direction (the larger)", "us", 10, "lower"),
        Target("LayerNorm h2048 host", "host time per call and direction (the larger)", "us", 10, "lower"),
        Target("RMSNorm h2048 device", fwd_bwd + " vs F.rms_norm", "ms", None),
        Target("LayerNorm h2048 device", fwd_bwd + " vs F.layer_norm", "ms", None),
        Target("cross-entropy torch path vs F.cross_entropy gpt_1b_tp4", fwd_bwd, "ms", None),
        Target("RMSNorm h8192 device", fwd_bwd + " vs F.rms_norm", "ms", 1.2, part="8b"),
        Target("LayerNorm h8192 device", fwd_bwd + " vs F.layer_norm", "ms", 1.2, part="8b"),
        Target("fused LM head + loss time vs Liger", fwd_bwd + ", 16k tokens", "ms", 1.0, part="8b"),
        Target("fused LM head + loss peak memory vs Liger", "peak memory above the inputs", "bytes", 1.0, part="8b"),
        Target(
            "FP8 GEMM vs bf16 8b",
            "device time, x·Wᵀ with both operands quantized vs bf16 torch.mm",
            "ms",
            1.3,
            part="8b",
        ),
        Target(
            "FP8 expert GEMM vs bf16 8b",
            "device time, grouped GEMM x_g·W_g with both operands quantized vs the bf16 grouped GEMM",
            "ms",
            1.3,
            part="8b",
        ),
        Target(
            "FP8 training loss vs bf16, 200 steps",
            "relative difference of the last 20 steps' mean loss",
            "fraction",
            0.01,
            "lower",
            "e2e_fp8",
        ),
        Target("linear+SwiGLU recompute mode vs torch + activation checkpointing gpt_1b_tp4", fwd_bwd, "ms", None),
        Target(
            "end to end llama 8L h1024 auto vs torch", "training tokens/s, bf16", "tokens/s", 1.10, part="e2e_llama"
        ),
        Target("end to end gpt_1b 4L auto vs torch", "training tokens/s, bf16", "tokens/s", 1.10, part="e2e_gpt_1b"),
    ]
    return out


TARGETS: tuple[Target, ...] = tuple(_targets())
BY_NAME = {t.name: t for t in TARGETS}
PARTS = tuple(dict.fromkeys(t.part for t in TARGETS if t.part != NOT_BUILT))
assert len(BY_NAME) == len(TARGETS), "target names must be unique"


def met_of(meshtron, ratio, target, better: str) -> bool | None:
    """Whether a figure meets its target: None without a target, False without a figure."""
    if target is None:
        return None
    if better == "lower":
        return meshtron is not None and meshtron <= target
    if better == "within":  # a two-sided tolerance: the ratio within `target` of 1 (to 1e-9: 0.95 is within 0.05)
        return ratio is not None and round(abs(ratio - 1), 9) <= target
    return ratio is not None and ratio >= target


def _finite(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def make_record(name: str, meshtron=None, baseline=None, ratio=None, *, env: dict, note: str | None = None, **extra):
    """One record of target `name` (its metric, unit, target, better from `TARGETS`); `env`
    gives device, date, torch, triton (and rehearsal); `extra` adds keys."""
    t = BY_NAME[name]
    return record_of(t, meshtron, baseline, ratio, env=env, note=note, **extra)


def record_of(t: Target, meshtron=None, baseline=None, ratio=None, *, env: dict, note: str | None = None, **extra):
    """The record of target `t` (any target list's: bench/peers.py has its own) with these figures."""
    meshtron, baseline, ratio = _finite(meshtron), _finite(baseline), _finite(ratio)
    rec = {
        "name": t.name,
        "metric": t.metric,
        "meshtron": meshtron,
        "baseline": baseline,
        "ratio": ratio,
        "target": t.target,
        "met": met_of(meshtron, ratio, t.target, t.better),
        "device": env["device"],
        "date": env["date"],
        "torch": env["torch"],
        "triton": env["triton"],
        "better": t.better,
        "unit": t.unit,
    }
    if env.get("rehearsal"):
        rec["rehearsal"] = True
    if note:
        rec["note"] = note
    rec.update(extra)
    return rec


def missing_record(name: str, env: dict, why: str) -> dict:
    """A target without a figure: not built, or its part did not run to it."""
    return make_record(name, env=env, note=why)


def not_built_records(env: dict) -> list[dict]:
    return [
        missing_record(t.name, env, f"{NOT_BUILT}: no such kernel or mode in meshtron yet")
        for t in TARGETS
        if t.part == NOT_BUILT
    ]


def check(
    records, by_name: dict | None = None, where_listed: str = "issue 36 (bench/kernel_records.py TARGETS)"
) -> list[str]:
    """Problems of one results file's records (empty: fine): a JSON list, every key present,
    known target names (`by_name`: name -> Target, issue 36's by default) without repeats,
    `met` consistent with ratio / meshtron and target."""
    by_name = BY_NAME if by_name is None else by_name
    if not isinstance(records, list) or not records:
        return ["not a non-empty JSON list of records"]
    bad, seen = [], set()
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            bad.append(f"record {i}: not an object")
            continue
        where = f"record {i} ({rec.get('name')!r})"
        missing = [k for k in RECORD_KEYS if k not in rec]
        if missing:
            bad.append(f"{where}: missing keys {missing}")
            continue
        if rec["name"] in seen:
            bad.append(f"{where}: name repeated")
        seen.add(rec["name"])
        t = by_name.get(rec["name"])
        if t is None:
            bad.append(f"{where}: not a target of {where_listed}")
            continue
        if rec["target"] != t.target:
            bad.append(f"{where}: target {rec['target']} but TARGETS says {t.target}")
        for key in ("meshtron", "baseline", "ratio"):
            if rec[key] is not None and not isinstance(rec[key], (int, float)):
                bad.append(f"{where}: {key} {rec[key]!r} is not a number or null")
        want = met_of(rec["meshtron"], rec["ratio"], rec["target"], rec.get("better", t.better))
        if rec["met"] is not want:
            bad.append(f"{where}: met {rec['met']} but {rec.get('better', t.better)} / ratio / target say {want}")
        if rec["meshtron"] is None and not rec.get("note"):
            bad.append(f"{where}: no figure and no note saying why")
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(rec["date"])):
            bad.append(f"{where}: date {rec['date']!r} is not YYYY-MM-DD")
    return bad


def device_slug(device: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100', 'cpu' -> 'cpu'."""
    words = [w for w in re.split(r"[^a-z0-9]+", device.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    return words[0] if words else "unknown"


def results_name(date: str, device: str) -> str:
    return f"{date}-{device_slug(device)}-kernels.json"


def current_env(rehearsal: bool | None = None) -> dict:
    """device, date, torch, triton of this process (imports torch)."""
    import datetime

    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - the CPU suite has it
        triton_version = None
    cuda = torch.cuda.is_available()
    env = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "triton": triton_version,
    }
    if rehearsal if rehearsal is not None else not cuda:
        env["rehearsal"] = True
    return env


def merge(parts: list[list[dict]], env: dict, missing_why: dict[str, str] | None = None) -> list[dict]:
    """One record per target in `TARGETS` order: the parts' records (the first of a name
    wins), the not-built ones, and for every other target a record saying its part did not
    measure it (`missing_why[part]` when given)."""
    got: dict[str, dict] = {}
    for records in parts:
        for rec in records:
            got.setdefault(rec["name"], rec)
    for rec in not_built_records(env):
        got.setdefault(rec["name"], rec)
    why = missing_why or {}
    out = []
    for t in TARGETS:
        rec = got.get(t.name) or missing_record(
            t.name, env, why.get(t.part, f"not measured: part {t.part!r} did not run or did not finish")
        )
        out.append(rec)
    return out


def summary(records: list[dict]) -> dict:
    """{name: the record's figures, ratio, target, met and how the device time was taken}."""
    keys = ("meshtron", "baseline", "unit", "ratio", "target", "met", "method", "note")
    return {r["name"]: {k: r.get(k) for k in keys} for r in records}


def _load(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        print(f"{path}: unreadable ({err}); its records are missing", file=sys.stderr)
        return []
    return data if isinstance(data, list) else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    m = sub.add_parser("merge", help="merge part files into DIR/<UTC date>-<device>-kernels.json")
    m.add_argument("--dir", required=True, type=Path)
    m.add_argument("parts", nargs="*", type=Path)
    c = sub.add_parser("check", help="check results files against the schema")
    c.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    if args.verb == "check":
        failed = 0
        for path in args.files:
            problems = check(_load(path))
            for line in problems:
                print(f"{path}: {line}")
            failed += bool(problems)
        return 1 if failed else 0
    parts = [_load(path) for path in args.parts if path.exists()]
    first = next((r for records in parts for r in records), None)
    if first is not None:
        env = {k: first[k] for k in ("device", "date", "torch", "triton")}
        if first.get("rehearsal"):
            env["rehearsal"] = True
    else:
        env = current_env()
    records = merge(parts, env)
    problems = check(records)
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / results_name(env["date"], env["device"])
    path.write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n")
    measured = sum(r["meshtron"] is not None for r in records)
    met = sum(r["met"] is True for r in records)
    print(f"{path}: {len(records)} records, {measured} with a figure, {met} targets met")
    for line in problems:
        print(f"schema: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
