"""Each fused kernel against its torch reference (and torch.compile of it), as JSON.

    python bench/kernels.py                 # CPU: says the Triton kernels need a GPU; times the torch path
    python bench/kernels.py --device cuda   # GPU: Triton vs torch vs torch.compile, TFLOP/s or GB/s
    python bench/kernels.py --device cuda --dtype fp32   # default dtype: bf16 on GPU, fp32 on CPU

Shapes are gpt_1b's (configs/model/gpt_1b.yaml) at tp=4 with a 4096-token microbatch
(micro_batch 2 x seq 2048), or smaller with --tokens. Each entry reports forward+backward
time (median of --iters), the throughput (TFLOP/s for matmul kernels, GB/s for the
memory-bound ones) and, on known GPUs, the fraction of the device's peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch  # noqa: E402

from meshtron.kernels import cross_entropy, grouped_gemm, linear_act, norms, swiglu  # noqa: E402
from meshtron.planning.peak import peak_flops  # noqa: E402

# gpt_1b at tp=4: hidden 2048, ffn 5632/4, vocab 50257 padded to 50688 -> 12672 per rank,
# 8 experts top-2 with moe_ffn 2816 (ep=8: one local expert receiving ~2 x tokens / 8 x 8).
H, FFN_LOCAL, VOCAB_LOCAL, EXPERTS, MOE_FFN = 2048, 5632 // 4, 50688 // 4, 8, 2816


def _time(fn, iters: int, device: torch.device) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _fwd_bwd(op, *tensors):
    def run():
        inputs = [t.detach().requires_grad_(t.is_floating_point()) if torch.is_tensor(t) else t for t in tensors]
        out = op(*inputs)
        out.backward(torch.ones_like(out))

    return run


def cases(tokens: int, device: torch.device, dtype: torch.dtype):
    """(name, {backend: callable}, flops or None, bytes or None) for each kernel."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, H, device=device, dtype=dtype, generator=g)
    w = torch.randn(FFN_LOCAL, H, device=device, dtype=dtype, generator=g) * 0.02
    b = torch.zeros(FFN_LOCAL, device=device, dtype=dtype)
    ln_w = torch.ones(H, device=device, dtype=dtype)
    logits = torch.randn(tokens, VOCAB_LOCAL, device=device, dtype=dtype, generator=g)
    target = torch.randint(0, VOCAB_LOCAL, (tokens,), device=device, generator=g)
    per_expert = [tokens * 2 // EXPERTS] * EXPERTS
    sizes = torch.tensor(per_expert, device=device)
    gx = torch.randn(sum(per_expert), H, device=device, dtype=dtype, generator=g)
    gw = torch.randn(EXPERTS, H, MOE_FFN, device=device, dtype=dtype, generator=g) * 0.02
    gx_ffn = torch.randn(sum(per_expert), MOE_FFN, device=device, dtype=dtype, generator=g)
    elt = x.element_size()
    return [
        (
            "linear_gelu",
            lambda be: _fwd_bwd(lambda a, c, d: linear_act.linear_gelu(a, c, d, backend=be), x, w, b),
            3 * 2 * tokens * H * FFN_LOCAL,
            None,
        ),
        (
            "linear_swiglu",
            lambda be: _fwd_bwd(
                lambda a, c, d: linear_act.linear_swiglu(a, c, None, d, None, backend=be), x, w, w.clone()
            ),
            3 * 2 * 2 * tokens * H * FFN_LOCAL,
            None,
        ),
        (
            "rms_norm",
            lambda be: _fwd_bwd(lambda a, c: norms.rms_norm(a, c, 1e-5, backend=be), x, ln_w),
            None,
            5 * tokens * H * elt,
        ),
        (
            "layer_norm",
            lambda be: _fwd_bwd(lambda a, c: norms.layer_norm(a, c, None, 1e-5, backend=be), x, ln_w),
            None,
            5 * tokens * H * elt,
        ),
        (
            "cross_entropy",
            lambda be: _fwd_bwd(lambda a: cross_entropy.fused_cross_entropy(a, target, backend=be), logits),
            None,
            3 * tokens * VOCAB_LOCAL * elt,
        ),
        (
            "grouped_gemm",
            lambda be: _fwd_bwd(lambda a, c: grouped_gemm.grouped_gemm(a, c, sizes, backend=be), gx, gw),
            3 * 2 * sum(per_expert) * H * MOE_FFN,
            None,
        ),
        # the experts' activation on the grouped GEMM's rows: 3 [rows, ffn] tensors forward, 5 backward
        (
            "swiglu",
            lambda be: _fwd_bwd(lambda a, c: swiglu.swiglu(a, c, backend=be), gx_ffn, gx_ffn.clone()),
            None,
            8 * sum(per_expert) * MOE_FFN * elt,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="input dtype (auto: bf16 on GPU, fp32 on CPU)",
    )
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the reference")
    args = parser.parse_args()
    device = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    gpu = device.type == "cuda"
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    dtype = dtypes[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if gpu else torch.float32)
    tokens = args.tokens or (4096 if gpu else 256)
    peak, peak_source = peak_flops(device, dtype)
    report = {
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "dtype": str(dtype),
        "tokens": tokens,
        "peak_flops": peak,
        "peak_source": peak_source,
        "kernels": {},
    }
    if not gpu:
        report["note"] = (
            "the Triton kernels need a GPU (on CPU they run only in the numpy interpreter, which "
            "measures nothing useful); only the torch reference path is timed"
        )
    for name, make, flops, nbytes in cases(tokens, device, dtype):
        entry = {}
        backends = ["torch"] + (["triton"] if gpu else [])
        for backend in backends:
            seconds = _time(make(backend), args.iters, device)
            entry[backend] = {"ms": seconds * 1e3}
            if flops:
                entry[backend]["tflops"] = flops / seconds / 1e12
                entry[backend]["fraction_of_peak"] = flops / seconds / peak
            if nbytes:
                entry[backend]["gb_per_s"] = nbytes / seconds / 1e9
        if args.compile:
            compiled = torch.compile(make("torch"))
            seconds = _time(compiled, args.iters, device)
            entry["torch_compile"] = {"ms": seconds * 1e3}
        if "triton" in entry:
            entry["speedup_vs_torch"] = entry["torch"]["ms"] / entry["triton"]["ms"]
        report["kernels"][name] = entry
    print(json.dumps(report))


if __name__ == "__main__":
    main()
