"""Time and host memory of one rank initializing its weights, as JSON: tile-by-tile draws of
the rank's shard (mpu/init.py) beside the previous method, which drew every parameter's full
tensor on every rank and kept its shard.

    python bench/init_cost.py                                   # gpt_1b, rank 0 of tp=8 (ep=8)
    python bench/init_cost.py --tp 8 --ep 8 --rank 5 --json out.json
    python bench/init_cost.py --model gpt_tiny --tp 2 --rank 1  # rehearse the script (seconds)

Rank R of the layout (world tp x ep's data-parallel need: tp * pp ranks, the expert mesh
folded onto them) is built alone in a fresh interpreter, its peers emulated by the rehearsal
process group (mpu/rehearsal_groups.py: nothing is sent), its weights left zero; then
`initialize_parameters` runs (the "tiles" way) or, for comparison, the previous method:
per parameter, a generator seeded by (seed, name), the full tensor drawn as
`zeros(full)[:rows] = randn(rows, ...) * std` and this rank's shard copied out (the
"full_tensors" way, reproduced here since the library no longer has it). Memory: the peak of
the process's anonymous resident set (RssAnon) above its value once the model is built,
sampled every millisecond. Both ways draw N(0, std) values (not the same ones: tiles are
seeded per tile).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_load_memory import PeakSampler, emit, measured_alone, rss_anon  # noqa: E402  (the bench folder's own helper)


def _full_tensor_way(chunks, seed: int, mesh) -> None:
    """The previous initialization: every full tensor drawn on every rank, its shard kept."""
    import torch

    from meshtron.mpu.init import local_shard, stable_seed

    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                init = param.init_fn
                gen = torch.Generator().manual_seed(stable_seed(seed, name))
                if hasattr(init, "std"):
                    rows = init.shape[0] if init.valid_rows is None else init.valid_rows
                    full = torch.zeros(init.shape)
                    full[:rows] = torch.randn((rows,) + init.shape[1:], generator=gen) * init.std
                else:
                    full = torch.full(init.shape, init.value)
                param.copy_(local_shard(full, param.shards, mesh))


def measure(model: str, tp: int, pp: int, ep: int, rank: int, way: str) -> dict:
    import torch
    from omegaconf import OmegaConf

    from meshtron.models.config import GPTConfig
    from meshtron.models.gpt import init_model_chunks
    from meshtron.mpu.init import initialize_parameters
    from meshtron.mpu.mesh import ParallelConfig, build_mesh
    from meshtron.training.rehearse import rehearsal_world

    torch.set_num_threads(1)
    preset = Path(__file__).resolve().parents[1] / "configs" / "model" / f"{model}.yaml"
    cfg = GPTConfig(**OmegaConf.to_container(OmegaConf.load(preset)))
    world = tp * pp * max(1, ep // tp)
    with rehearsal_world(world, rank, torch.device("cpu")):
        mesh = build_mesh(ParallelConfig(tp=tp, pp=pp, ep=ep), cfg)
        chunks = init_model_chunks(cfg, mesh, seed=0, initialize=False)
        built = rss_anon()
        start = time.perf_counter()
        with PeakSampler() as sampler:
            if way == "tiles":
                for chunk in chunks:
                    initialize_parameters(chunk, 1234, mesh)
            else:
                _full_tensor_way(chunks, 1234, mesh)
        seconds = time.perf_counter() - start
    shard = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    return {
        "way": way,
        "model": model,
        "layout": f"tp={tp} pp={pp} ep={ep} (world {world})",
        "rank": rank,
        "shard_bytes": shard,
        "seconds": round(seconds, 2),
        "peak_above_built_bytes": sampler.peak - built,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt_1b", help="a preset of configs/model/")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--way", choices=("tiles", "full_tensors"), help="(internal) measure one way here")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.way:
        print(json.dumps(measure(args.model, args.tp, args.pp, args.ep, args.rank, args.way)))
        return 0
    results = []
    for way in ("tiles", "full_tensors"):
        cmd = [sys.executable, __file__, "--model", args.model, "--way", way, "--rank", str(args.rank)]
        cmd += ["--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep)]
        results.append(measured_alone(cmd))
    tiles, full = results
    results.append(
        {
            "way": "ratio tiles / full_tensors",
            "seconds": round(tiles["seconds"] / max(full["seconds"], 0.01), 3),
            "peak_above_built_bytes": round(
                tiles["peak_above_built_bytes"] / max(full["peak_above_built_bytes"], 1), 3
            ),
        }
    )
    emit(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
