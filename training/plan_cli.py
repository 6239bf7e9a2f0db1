"""`python -m meshtron.plan`: choose a layout before a run.

    python -m meshtron.plan +model=gpt_1b trainer.global_batch_size=512 trainer.precision=bf16 \\
        --gpus 64 --gpus-per-node 8 --gpu-memory 80GiB --gpu h100 [--top 10] [--json plan.json]

The overrides compose the run config exactly as train.py does (Hydra's compose API over
`meshtron.configs`, then `RunConfig.from_dict`); `parallel.*`, `optim.zero`,
`trainer.recompute` and `trainer.micro_batch_size` given on the command line pin that field of
the search, everything else is searched (`planning.search`). Prints the top layouts as
ready-to-paste overrides with the planned memory per device, modelled tokens/s and MFU;
`--json` writes the fitting candidates, fastest first (memory is priced in order of modelled
speed until --json-max of them fit; 0 prices every valid layout). Bad input (unknown --gpu, --gpus not divisible by
--gpus-per-node, a bad override or memory size, a --json path that cannot be written) exits 2
with one line; no layout fitting exits 1 with one line.

`--json PATH` is checked before the config is composed and the search starts (which can take
a minute): its folder must exist (it is not created: a typo in it would otherwise leave the
plan somewhere unexpected) and take a new file, and PATH must not be a folder. The file is
written whole or not at all (a temporary file beside it, renamed over it).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from meshtron.errors import ConfigError
from meshtron.planning.search import search
from meshtron.planning.step_time import CLUSTER_PRESETS, Cluster, cluster_preset
from meshtron.training.cli import compose_run
from meshtron.training.config import RunConfig

__all__ = ["main", "check_json_path", "compose_run", "parse_bytes", "pinned_fields", "write_json"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# command-line keys that pin a field of planning.step_time.Layout
_PINNED = {
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.dp": "dp",
    "parallel.cp": "cp",
    "parallel.cp_comm": "cp_comm",
    "parallel.ep": "ep",
    "parallel.etp": "etp",
    "parallel.sp": "sp",
    "parallel.vpp": "vpp",
    "optim.zero": "zero",
    "trainer.recompute": "recompute",
    "trainer.micro_batch_size": "micro_batch_size",
}


def parse_bytes(text: str) -> int:
    """Bytes of a size like "80GiB", "80GB", "1.5TiB" or "1024" (binary and decimal units)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"--gpu-memory {text!r} is not a size; use e.g. 80GiB, 80GB or 85899345920")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def pinned_fields(overrides: list[str], run: RunConfig) -> dict[str, Any]:
    """Layout fields the command line sets (`parallel.tp=2` pins tp=2), read from the composed
    `run` so the values are typed; `trainer.micro_batch_size=null` pins nothing."""
    sections = {"parallel": run.parallel, "optim": run.optim, "trainer": run.trainer}
    out = {}
    for arg in overrides:
        key = arg.split("=", 1)[0].lstrip("+")
        if key in _PINNED:
            section, name = key.split(".")
            value = getattr(sections[section], name)
            if value is not None:
                out[_PINNED[key]] = value
    return out


class _ArgumentError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would print the usage first)
        raise _ArgumentError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m meshtron.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("overrides", nargs="*", help="train.py overrides, e.g. +model=gpt_1b trainer.global_batch_size=512")
    p.add_argument("--gpus", type=int, required=True, help="devices in all")
    p.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default: min(gpus, 8))")
    p.add_argument("--gpu-memory", default=None, help="memory per device, e.g. 80GiB (default: the preset's)")
    p.add_argument("--gpu", default="h100", help=f"device preset: {', '.join(CLUSTER_PRESETS)} (default h100)")
    p.add_argument("--efficiency", type=float, default=None, help="achieved fraction of peak (default: the preset's)")
    p.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    p.add_argument("--json", default=None, help="write the ranked candidates (up to --json-max) to this JSON file")
    p.add_argument(
        "--json-max",
        type=int,
        default=200,
        help="fitting candidates to rank for --json (default 200; 0 = every valid layout, slow)",
    )
    p.add_argument(
        "--max-priced",
        type=int,
        default=2000,
        help="price at most this many of the fastest candidates' memory (default 2000; 0 = no cap)",
    )
    return p


def _cluster(args: argparse.Namespace, precision: str) -> Cluster:
    if args.gpu not in CLUSTER_PRESETS:
        raise ConfigError(f"unknown --gpu {args.gpu!r}; use one of {', '.join(CLUSTER_PRESETS)}")
    if args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus} must be a positive integer")
    per_node = args.gpus_per_node if args.gpus_per_node is not None else min(args.gpus, 8)
    if per_node < 1 or args.gpus % per_node:
        raise ConfigError(f"--gpus {args.gpus} is not divisible by --gpus-per-node {per_node}")
    if args.top < 1:
        raise ConfigError(f"--top {args.top} must be >= 1")
    try:
        memory = parse_bytes(args.gpu_memory) if args.gpu_memory is not None else None
        cluster = cluster_preset(args.gpu, args.gpus, per_node, memory, precision=precision)
        if args.efficiency is not None:
            cluster = dataclasses.replace(cluster, efficiency=args.efficiency)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return cluster


def check_json_path(text: str) -> Path:
    """The --json path, refused (ConfigError, one line) unless a file can be written there:
    its folder exists and takes a new file (probed with a temporary file, removed again), and
    the path is not a folder nor an existing file this user cannot write."""
    path = Path(text).expanduser()
    folder = path.parent
    if path.is_dir():
        raise ConfigError(f"--json {text} is a folder; give a file path, e.g. --json {path / 'plan.json'}")
    if not folder.is_dir():
        if folder.exists():
            raise ConfigError(f"--json {text}: {folder} is a file, not a folder; choose another path")
        raise ConfigError(f"--json {text}: its folder {folder} does not exist; create it first or choose another path")
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(f"--json {text} exists and is not writable; choose another path or change its permissions")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(
            f"--json {text}: cannot write into its folder {folder} ({err.strerror}); choose a writable path"
        ) from None
    return path


def write_json(path: Path, data: dict) -> None:
    """Write `data` to `path` whole or not at all: a temporary file in the same folder, renamed
    over `path`; ConfigError naming the path on failure (a full disk, a file-size limit)."""
    text, tmp = json.dumps(data, indent=1) + "\n", None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; the plan is an ordinary file
        os.replace(tmp, path)
        tmp = None
    except OSError as err:
        if err.errno == errno.EFBIG:
            import resource

            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            fix = f"this process may write files of at most {limit} bytes (ulimit -f): raise it, or lower --json-max"
        elif err.errno == errno.ENOSPC:
            fix = f"free space on {path.parent}'s disk or choose another path"
        else:
            fix = "choose another path"
        raise ConfigError(f"--json {path}: could not write the plan ({err.strerror}); {fix}") from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)  # nothing half-written is left beside the plan


def _flops(rate: float) -> str:
    return f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"


def format_table(ranked: list, top: int) -> str:
    """The top `top` candidates: rank, GiB per device, modelled tokens/s, MFU, overrides."""
    lines = [f"{'#':>3} {'GiB/dev':>8} {'tokens/s':>12} {'MFU':>6}  overrides"]
    for i, cand in enumerate(ranked[:top], 1):
        lines.append(
            f"{i:>3} {cand.memory_bytes / 1024**3:8.2f} {cand.tokens_per_s:12,.0f} {cand.time.mfu:6.1%}  "
            f"{cand.layout.overrides()}"
        )
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    """Parse, compose, search, print; the exit code (raises ConfigError for bad input)."""
    try:
        args = _parser().parse_args(argv)
    except _ArgumentError as err:
        raise ConfigError(str(err)) from err
    json_path = check_json_path(args.json) if args.json else None  # before the (long) search
    run_cfg = compose_run(args.overrides)
    # trainer.precision=auto as the planned devices would pick it (every GPU preset has bf16)
    run_cfg, _ = run_cfg.with_precision_for("cpu" if args.gpu == "cpu" else "cuda", bf16_supported=True)
    t, o = run_cfg.trainer, run_cfg.optim
    cluster = _cluster(args, t.precision)
    fixed = pinned_fields(args.overrides, run_cfg)
    try:
        result = search(
            run_cfg.model,
            cluster,
            global_batch_size=t.global_batch_size,
            precision=t.precision,
            param_dtype=o.param_dtype,
            offload=o.offload,
            fused_lm_loss=t.fused_lm_loss,
            fixed=fixed,
            limit=args.top if not args.json else (max(args.top, args.json_max) or None),
            max_priced=args.max_priced or None,
        )
    except ValueError as err:
        raise ConfigError(str(err)) from err
    head = (
        f"{cluster.gpus} x {cluster.name} ({cluster.gpus_per_node} per node, "
        f"{cluster.gpu_memory_bytes / 1024**3:.1f} GiB, {_flops(cluster.peak_flops)} {t.precision} peak "
        f"at {cluster.efficiency:.0%}); global batch {t.global_batch_size} x seq {run_cfg.model.seq_len}; "
        f"{result.enumerated} valid layouts, {result.priced} priced for memory, {result.too_big} too big, "
        f"{result.seconds:.1f} s"
    )
    print(head)
    if json_path is not None:
        write_json(
            json_path,
            {
                "cluster": {k: v for k, v in vars(cluster).items()},
                "global_batch_size": t.global_batch_size,
                "precision": t.precision,
                "enumerated": result.enumerated,
                "priced": result.priced,
                "too_big": result.too_big,
                "candidates": [c.as_dict() for c in result.ranked],
            },
        )
    if not result.ranked:
        capped = (
            f" (of the {result.priced} fastest priced; raise --max-priced to look further)"
            if args.max_priced and result.priced >= args.max_priced
            else ""
        )
        print(
            f"meshtron.plan: no layout fits {cluster.gpu_memory_bytes / 1024**3:.1f} GiB per device{capped}; "
            "lower trainer.global_batch_size, or add devices",
            file=sys.stderr,
        )
        return 1
    print(format_table(result.ranked, args.top))
    if args.json:
        print(f"{len(result.ranked)} fitting candidates written to {args.json}")
    return 0


def main(argv: list[str] | None = None) -> None:
    """Entry of `python -m meshtron.plan`: exit 0, 1 (nothing fits) or 2 (bad input, one line)."""
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        sys.stderr.write(f"meshtron.plan: {err}\n")
        sys.exit(2)
    sys.exit(code)
