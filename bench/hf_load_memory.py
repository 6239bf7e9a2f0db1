"""Host memory of one rank loading a big Hugging Face checkpoint into its layout
(`checkpoint.init_from=hf:FOLDER`'s sliced reads), as JSON.

    python bench/hf_load_memory.py --make /tmp/synth2b                       # write a ~2B bf16 Llama
    python bench/hf_load_memory.py --folder /tmp/synth2b --layout 8x1:0 --layout 4x2:5 --json out.json
    meshtron-hf import --src /tmp/synth2b --out /tmp/synth2b_ck --seq-len 4096   # a meshtron checkpoint of it
    python bench/hf_load_memory.py --export /tmp/synth2b_ck --json out.json   # the streamed export's memory

The synthetic checkpoint is a Llama-3-shaped model (vocab 128256, hidden 2048, 24 layers, ffn
8192, 16 heads, 8 KV heads, untied: 1.99B parameters, 3.98 GB in bf16) in 7 safetensors shards
with an index; its values are a constant (what is measured is bytes, not numerics).

`--layout TPxPP:RANK`: rank RANK of tp x pp (world tp * pp) is built alone in a fresh
interpreter, its peers emulated by the rehearsal process group (mpu/rehearsal_groups.py:
nothing is sent, no second process), its weights left zero (`initialize=False`, as a run with a
start checkpoint builds them), then `load_hf_weights` reads its slices from the memory-mapped
folder. Memory is the process's anonymous resident set (RssAnon of /proc/self/status), sampled
every millisecond in a thread and right after every slice is read (when the slice is alive):
the page cache behind the memory-mapped files is reclaimable and not counted. Reported: the
rank's parameter bytes ("shard", fp32), the largest single tensor of the checkpoint in its
stored dtype, the bound shard + largest tensor, the peak RssAnon above the interpreter's before
the model is built and after it is built, the bytes read and the load time.

`--export CKPT` measures `meshtron-hf export` of a meshtron checkpoint (training/hf_cli.py:
one conversion unit at a time read from the checkpoint, converted, cast to bf16 and written):
its peak RssAnon above the interpreter's, beside the largest single parameter in fp32 (the
largest unit it must hold) and the whole model's fp32 bytes (what a gathered export holds).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

SYNTH = dict(vocab=128256, hidden=2048, layers=24, ffn=8192, heads=16, kv_heads=8)
LAYERS_PER_FILE = 4


def rss_anon() -> int:
    """Anonymous resident bytes of this process (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class PeakSampler:
    """The highest `rss_anon()` seen, sampled every millisecond in a thread while active."""

    def __init__(self):
        self.peak, self._stop = rss_anon(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_anon())


def make_checkpoint(folder: Path, spec: dict) -> None:
    """Write a Llama-shaped bf16 checkpoint of `spec` into `folder` (config.json, shards, index)."""
    import safetensors.torch
    import torch

    h, f, kv = spec["hidden"], spec["ffn"], spec["hidden"] // spec["heads"] * spec["kv_heads"]
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": spec["vocab"],
        "hidden_size": h,
        "intermediate_size": f,
        "num_hidden_layers": spec["layers"],
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))

    def tensor(*shape):
        return torch.full(shape, 0.01, dtype=torch.bfloat16)

    groups = [{"model.embed_tokens.weight": (spec["vocab"], h)}]
    for start in range(0, spec["layers"], LAYERS_PER_FILE):
        group = {}
        for i in range(start, min(start + LAYERS_PER_FILE, spec["layers"])):
            p = f"model.layers.{i}."
            group |= {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        groups.append(group)
    groups[-1] |= {"model.norm.weight": (h,), "lm_head.weight": (spec["vocab"], h)}
    weight_map = {}
    for n, group in enumerate(groups):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        safetensors.torch.save_file({k: tensor(*s) for k, s in group.items()}, str(folder / name))
        weight_map |= dict.fromkeys(group, name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def measure(folder: Path, tp: int, pp: int, rank: int) -> dict:
    """Build rank `rank` of tp x pp (world tp * pp) alone and read its slices of `folder`."""
    import torch

    from meshtron.models import hf as mhf
    from meshtron.models.gpt import init_model_chunks
    from meshtron.mpu.mesh import ParallelConfig, build_mesh
    from meshtron.training.rehearse import rehearsal_world

    torch.set_num_threads(1)
    cfg = mhf.config_from_hf(mhf.read_hf_config(folder), seq_len=4096)
    before = rss_anon()
    with rehearsal_world(tp * pp, rank, torch.device("cpu")), PeakSampler() as sampler:
        mesh = build_mesh(ParallelConfig(tp=tp, pp=pp), cfg)
        chunks = init_model_chunks(cfg, mesh, seed=0, initialize=False)
        built = rss_anon()
        start = time.perf_counter()
        with mhf.open_hf_weights(folder, "llama") as source:
            read_slice = source.read

            def read_and_sample(key, index):
                piece = read_slice(key, index)
                sampler.peak = max(sampler.peak, rss_anon())
                return piece

            source.read = read_and_sample
            mhf.load_hf_weights(chunks, source)
            largest = max(torch.Size(source.shape(k)).numel() for k in source.keys()) * 2  # bf16
        seconds = time.perf_counter() - start
    shard = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    peak = sampler.peak - before
    return {
        "layout": f"tp={tp} pp={pp}",
        "rank": rank,
        "shard_bytes": shard,
        "largest_tensor_bytes": largest,
        "bound_bytes": shard + largest,
        "peak_bytes": peak,
        "peak_above_built_bytes": sampler.peak - built,
        "within_bound": peak <= shard + largest,
        "bytes_read": source.bytes_read,
        "load_seconds": round(seconds, 2),
    }


def measure_export(checkpoint: Path, out: Path) -> dict:
    """Peak anonymous memory of the streamed export of `checkpoint` into `out` (bf16)."""
    from meshtron.models.config import GPTConfig
    from meshtron.training.checkpoint import expected_model_shapes
    from meshtron.training.checkpoint_files import read_meta
    from meshtron.training.hf_cli import export_from_checkpoint

    saved = read_meta(sorted(checkpoint.glob("step_*"))[-1])["model"]
    shapes = expected_model_shapes(GPTConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}))
    sizes = [4 * math.prod(s) for s in shapes.values()]
    before = rss_anon()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        export_from_checkpoint(checkpoint, out, dtype="bfloat16")
    return {
        "export": str(checkpoint),
        "model_fp32_bytes": sum(sizes),
        "largest_parameter_fp32_bytes": max(sizes),
        "peak_bytes": sampler.peak - before,
        "written_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--make", type=Path, help="write the synthetic checkpoint into this folder and stop")
    p.add_argument("--small", action="store_true", help="with --make: a tiny model (rehearsing this script)")
    p.add_argument("--folder", type=Path)
    p.add_argument("--layout", action="append", default=[], help="TPxPP:RANK, e.g. 8x1:0 (repeatable)")
    p.add_argument("--measure", help="(internal) measure this TPxPP:RANK in this process")
    p.add_argument("--export", type=Path, help="measure the export of this meshtron checkpoint dir instead")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.make:
        spec = dict(vocab=1000, hidden=128, layers=8, ffn=256, heads=4, kv_heads=2) if args.small else SYNTH
        make_checkpoint(args.make, spec)
        return 0
    if args.measure:
        shape, rank = args.measure.split(":")
        tp, pp = (int(x) for x in shape.split("x"))
        print(json.dumps(measure(args.folder, tp, pp, int(rank))))
        return 0
    if args.export:
        import tempfile

        with tempfile.TemporaryDirectory() as out:
            results = [measure_export(args.export, Path(out))]
    else:
        cmd = [sys.executable, __file__, "--folder", str(args.folder), "--measure"]
        results = [measured_alone([*cmd, layout]) for layout in args.layout or ["8x1:0"]]
    emit(results, args.json)
    return 0


def measured_alone(cmd: list[str]) -> dict:
    """The JSON object the last stdout line of `cmd` prints: one measurement in a fresh interpreter."""
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def emit(results: list, path: Path | None) -> None:
    """Print `results` as JSON, and write them to `path` when given."""
    print(json.dumps(results, indent=2))
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
