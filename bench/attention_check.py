"""Packed documents' attention backends beside the dense mask (mpu/document_attention.py), as records.

    python bench/attention_check.py                      # CUDA: s 4096 and 8192, bf16, JSON list on stdout
    python bench/attention_check.py --out r.json         # also written to a file
    python bench/attention_check.py --cpu-rehearsal      # no GPU: tiny sizes, what the CPU runs (flex forward)

For each sequence length (batch 2, 16 query heads, 4 kv heads, head dim 128; documents of
log-normal lengths around 600 tokens, as packed web text) varlen and flex run forward + backward
in bf16 beside the dense path (the boolean [b, 1, s, s] mask and SDPA, bf16), and each gives
three records (the schema of bench/kernel_records.py: name, metric, meshtron, baseline, ratio,
target, met, device, date, torch, triton, plus better, unit, shape):

* "<backend> error vs dense fp32 s<s>": the largest of max |x - ref| / max |ref| over the output
  and the q, k, v gradients, ref the dense path in fp32 on the same inputs; baseline: the dense
  path in bf16, the same figure. Met at <= ERROR_TARGET (bf16 rounding of long sums).
* "<backend> peak memory vs dense s<s>": peak bytes one forward + backward allocates above its
  inputs; ratio dense / backend, met at >= 1.
* "<backend> device time vs dense s<s>": forward + backward device time (bench/kernel_speed.py
  `measure`: CUDA-graph replays, else the profiler); ratio dense / backend, met at >= 1.

The CPU rehearsal proves the code paths at b 2, s 67 and 130, 4/2 heads, head dim 16 in fp32:
flex forward only (FlexAttention has no backward on the CPU), varlen not at all (flash is
CUDA only): those records carry `meshtron` null and a note saying why; nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after the installed meshtron: `bench.*` only

import torch  # noqa: E402

from bench.kernel_records import current_env, met_of  # noqa: E402
from bench.kernel_speed import Plan, Side, fwd_bwd, measure, peak_bytes  # noqa: E402
from meshtron.mpu.document_attention import dense_document_attention, document_attention  # noqa: E402

BACKENDS = ("varlen", "flex")
ERROR_TARGET = 0.02
MEAN_DOC_TOKENS = 600


def realistic_docs(batch: int, seq: int, seed: int = 0, mean: int = MEAN_DOC_TOKENS) -> torch.Tensor:
    """doc_ids [batch, seq]: each row packed with documents of log-normal lengths (median
    `mean`, sigma 1: many short documents, a few long ones), the last one cut at the row's end."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths, total = [], 0
        while total < seq:
            n = max(1, int(math.exp(math.log(mean) + torch.randn((), generator=g).item())))
            lengths.append(min(n, seq - total))
            total += lengths[-1]
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(rows)


def record(name, metric, unit, meshtron, baseline, ratio, target, better, env, **extra) -> dict:
    """One record in bench/kernel_records.py's schema (met by `met_of`)."""
    rec = {
        "name": name,
        "metric": metric,
        "meshtron": meshtron,
        "baseline": baseline,
        "ratio": ratio,
        "target": target,
        "met": met_of(meshtron, ratio, target, better),
        "device": env["device"],
        "date": env["date"],
        "torch": env["torch"],
        "triton": env["triton"],
        "better": better,
        "unit": unit,
    }
    if env.get("rehearsal"):
        rec["rehearsal"] = True
    rec.update({k: v for k, v in extra.items() if v is not None})
    return rec


def _call(backend: str, docs: torch.Tensor):
    if backend == "dense":
        return lambda q, k, v: dense_document_attention(q, k, v, docs)
    return lambda q, k, v: document_attention(q, k, v, docs, backend=backend)


def relative_error(fn, inputs: list[torch.Tensor], grad_out: torch.Tensor | None, ref: list[torch.Tensor]) -> float:
    """max over (out, dq, dk, dv) of max |x - ref| / max |ref| (forward only without `grad_out`)."""
    leaves = [t.detach().requires_grad_(grad_out is not None) for t in inputs]
    out = fn(*leaves)
    got = [out]
    if grad_out is not None:
        out.backward(grad_out)
        got += [t.grad for t in leaves]
    return max(((a.float() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))


def reference(inputs: list[torch.Tensor], grad_out: torch.Tensor | None, docs: torch.Tensor) -> list[torch.Tensor]:
    """The dense path in fp32 on `inputs`: [out] (+ [dq, dk, dv] with `grad_out`)."""
    leaves = [t.detach().float().requires_grad_(grad_out is not None) for t in inputs]
    out = dense_document_attention(*leaves, docs)
    if grad_out is None:
        return [out.detach()]
    out.backward(grad_out.float())
    return [out.detach()] + [t.grad for t in leaves]


def check_length(args, seq: int, device: torch.device, dtype: torch.dtype, env: dict) -> list[dict]:
    """The three records of each backend at sequence length `seq`."""
    g = torch.Generator(device=device).manual_seed(seq)
    b, h, hkv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    inputs = [torch.randn(b, n, seq, d, generator=g, device=device).to(dtype) for n in (h, hkv, hkv)]
    docs = realistic_docs(b, seq, mean=args.mean_doc).to(device)
    cuda = device.type == "cuda"
    grad_out = torch.randn(b, h, seq, d, generator=g, device=device).to(dtype) if cuda else None
    ref = reference(inputs, grad_out, docs)
    shape = dict(batch=b, seq=seq, heads=h, kv_heads=hkv, head_dim=d, documents=int(docs.max()) + 1)
    dense_err = relative_error(_call("dense", docs), inputs, grad_out, ref)
    figs = {}
    if cuda:
        steps = {k: fwd_bwd(_call(k, docs), inputs) for k in ("dense", *BACKENDS)}
        figs = measure([Side(k, k, step, fwd) for k, (step, fwd) in steps.items()], device, Plan(rounds=args.rounds))
        peaks = {k: peak_bytes(step, device) for k, (step, _) in steps.items()}
    out = []
    for backend in BACKENDS:
        out += _backend_records(backend, seq, inputs, grad_out, ref, docs, dense_err, figs, env, shape, cuda)
        if cuda:
            out += _cost_records(backend, seq, figs, peaks, env, shape)
    return out


def _backend_records(backend, seq, inputs, grad_out, ref, docs, dense_err, figs, env, shape, cuda) -> list[dict]:
    what = "out and q/k/v grads" if cuda else "out, forward only (CPU: FlexAttention has no backward)"
    metric = f"max |x - ref| / max |ref| vs the dense path in fp32 over {what}"
    name = f"{backend} error vs dense fp32 s{seq}"
    dtype = str(inputs[0].dtype).removeprefix("torch.")
    if backend == "varlen" and not cuda:
        note = "not run: torch's varlen_attn is a CUDA flash kernel (its segments are tested on the CPU)"
        return [record(name, metric, "fraction", None, dense_err, None, ERROR_TARGET, "lower", env, note=note)]
    try:
        err = relative_error(_call(backend, docs), inputs, grad_out, ref)
    except Exception as exc:  # noqa: BLE001 - recorded, the other backend goes on
        note = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        return [record(name, metric, "fraction", None, dense_err, None, ERROR_TARGET, "lower", env, note=note)]
    ratio = dense_err / err if err > 0 and dense_err > 0 else None
    return [
        record(name, metric, "fraction", err, dense_err, ratio, ERROR_TARGET, "lower", env, shape=shape, dtype=dtype)
    ]


def _cost_records(backend, seq, figs, peaks, env, shape) -> list[dict]:
    mine, dense = figs[backend], figs["dense"]
    time_ratio = dense.device_ms / mine.device_ms if mine.device_ms and dense.device_ms else None
    mem_ratio = peaks["dense"] / peaks[backend] if peaks.get(backend) and peaks.get("dense") else None
    note = mine.error or dense.error
    return [
        record(
            f"{backend} peak memory vs dense s{seq}", "peak memory of forward + backward above the inputs", "bytes",
            peaks.get(backend), peaks.get("dense"), mem_ratio, 1.0, "higher", env, shape=shape, note=note,
        ),
        record(
            f"{backend} device time vs dense s{seq}", "device time, forward + backward", "ms",
            mine.device_ms, dense.device_ms, time_ratio, 1.0, "higher", env, shape=shape, note=note,
            method=mine.method, wall_ms=mine.wall_ms, host_us=mine.host_us,
        ),
    ]  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-rehearsal", action="store_true", help="tiny sizes on the CPU: proves the code paths")
    p.add_argument("--seq", type=int, nargs="+", default=None, help="sequence lengths (4096 8192; rehearsal 67 130)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=None, help="query heads (16; rehearsal 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="kv heads (4; rehearsal 2)")
    p.add_argument("--head-dim", type=int, default=None, help="head dim (128; rehearsal 16)")
    p.add_argument(
        "--mean-doc", type=int, default=None, help=f"median document tokens ({MEAN_DOC_TOKENS}; rehearsal 9)"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON list here")
    args = p.parse_args(argv)
    tiny = args.cpu_rehearsal
    defaults = dict(seq=[67, 130] if tiny else [4096, 8192], heads=4 if tiny else 16, kv_heads=2 if tiny else 4)
    defaults.update(head_dim=16 if tiny else 128, mean_doc=9 if tiny else MEAN_DOC_TOKENS)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.cpu_rehearsal and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-rehearsal (tiny sizes, proves the code paths)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.cpu_rehearsal else torch.device("cuda", 0)
    dtype = torch.float32 if args.cpu_rehearsal else torch.bfloat16
    env = current_env(rehearsal=args.cpu_rehearsal)
    records = [rec for seq in args.seq for rec in check_length(args, seq, device, dtype, env)]
    text = json.dumps(records, ensure_ascii=False)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    for rec in records:
        print(f"{rec['name']:<40} {rec['meshtron']!s:>24} vs {rec['baseline']!s:>24} met={rec['met']}", file=sys.stderr)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
