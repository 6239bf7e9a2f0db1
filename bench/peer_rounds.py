"""Round-robin runner shared by the side-by-side benchmarks (moe_vs_megatron.py,
dense_vs_megatron.py): runs several commands that each print one JSON object with their
step times (bench/throughput.py's or ../shared/peers/common.py's format), one at a time, in
alternating order for a number of rounds, so every system sees the same machine load in every
round; records the host's load (1-minute average, other processes' busy CPUs) beside every
figure and summarises medians and the median of per-round ratios (which cancels slow
drifts of the host load), and quantiles of all steps pooled over the rounds (robust to a host
whose speed flips between two levels within a round: `pooled_quantiles`).

Not a script: the benchmarks import it (`python bench/X.py` puts bench/ on sys.path).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT.parent / "shared" / "peers"
DEFAULT_MCORE_VENV = os.environ.get("MCORE_VENV", str(Path.home() / ".cache/meshtron-peers/mcore"))


def mcore_python(venv: str) -> str:
    """The Megatron-Core venv's python; exits with a one-line reason when it is missing."""
    python = str(Path(venv) / "bin" / "python")
    if not Path(python).exists():
        sys.exit(f"no Megatron-Core venv at {venv}: run ../shared/peers/setup (or set MCORE_VENV)")
    return python


def launch(python: str, nproc: int) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc_per_node=N` (the torchrun of that venv)."""
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def peer_script(name: str) -> list[str]:
    """The arguments that run ../shared/peers/`name` through bench/peer_step_times.py, which
    adds every timed step to its JSON (`step_times_s`, for `pooled_quantiles`)."""
    return [str(ROOT / "bench" / "peer_step_times.py"), str(PEERS / name)]


def run_json(cmd: list[str], threads: int, extra_env: dict | None = None) -> dict:
    """Run `cmd` with OMP_NUM_THREADS=threads; return the last JSON object it printed."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **(extra_env or {}))
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def _busy_cpu_seconds() -> float:
    """CPU seconds all processes of the host spent busy so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measured_run(cmd: list[str], threads: int, extra_env: dict | None = None) -> tuple[dict, float]:
    """`run_json` plus the CPUs other processes kept busy meanwhile (host busy CPU time minus
    this command's own, per second of wall time; near 0 on a quiet host, 2 = both cores taken)."""
    busy0, own0, t0 = _busy_cpu_seconds(), _children_cpu_seconds(), time.perf_counter()
    record = run_json(cmd, threads, extra_env)
    wall = time.perf_counter() - t0
    other = (_busy_cpu_seconds() - busy0) - (_children_cpu_seconds() - own0)
    return record, max(0.0, other / wall)


def step_rates(record: dict) -> tuple[float, float]:
    """(tokens/s of the median step, tokens/s of the fastest step) from either JSON format:
    bench/throughput.py (`step_time_s` median/min, seconds) or ../shared/peers/common.py
    (`ms_per_step_median` / `ms_per_step_min`, whose own `tokens_per_s` is from the mean)."""
    tokens = float(record["tokens_per_step"])
    if "step_time_s" in record:
        return tokens / record["step_time_s"]["median"], tokens / record["step_time_s"]["min"]
    return tokens / (record["ms_per_step_median"] / 1e3), tokens / (record["ms_per_step_min"] / 1e3)


QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)  # multiples of 1/20: cut points of statistics.quantiles(n=20)


def step_times(record: dict) -> list[float] | None:
    """Every timed step of a run in seconds (`step_times_s`: bench/throughput.py, and the peers
    run through bench/peer_step_times.py), or None when the record lacks them."""
    times = record.get("step_times_s")
    return [float(t) for t in times] if times else None


def step_quantiles(values: list[float]) -> dict[str, float]:
    """`values` at each of `QUANTILES` (keys "0.1", ...), linear between order statistics
    (`statistics.quantiles`' inclusive method, numpy's default)."""
    cuts = statistics.quantiles(values, n=20, method="inclusive") if len(values) > 1 else values * 19
    return {str(q): cuts[round(q * 20) - 1] for q in QUANTILES}


def pooled_quantiles(times: dict[str, list[float]], tokens_per_step: float, baseline: str) -> dict:
    """Tokens/s at quantiles of the step times pooled over all rounds, per system, and the
    baseline's over each other system's at every quantile (`QUANTILES`; q = 0.1 is a fast step).

    Why: on a host whose speed switches between two levels every few seconds (bench/README.md),
    a round's median step falls in either level depending on the mix of its steps, so the
    median of per-round ratios swings with that mix. The rounds of all systems interleave over
    the same period, so each system's pooled steps hold a similar share of each level, and a
    quantile well inside one level (0.1/0.25: the fast one, 0.75/0.9: the slow one, when each
    holds at least a third of the steps) compares like with like."""
    rates = {name: {q: tokens_per_step / t for q, t in step_quantiles(ts).items()} for name, ts in times.items()}
    over = {peer: {q: round(rates[baseline][q] / r[q], 3) for q in r} for peer, r in rates.items() if peer != baseline}
    return {
        "steps": {name: len(ts) for name, ts in times.items()},
        "tokens_per_s": {name: {q: round(v, 1) for q, v in r.items()} for name, r in rates.items()},
        f"{baseline}_over": over,
    }


def interleaved_rounds(
    cmds: dict[str, list[str]],
    threads: int,
    rounds: int,
    *,
    baseline: str,
    envs: dict[str, dict] | None = None,
    label: str = "",
) -> dict:
    """Run every command of `cmds` once per round (order reversed every other round) and
    summarise: tokens/s of every run from its median step (`step_rates`: the same statistic
    for both formats), the 1-minute load average (the larger of before/after) and the CPUs
    other processes kept busy (`measured_run`); medians over rounds; `<baseline>_over`: the
    median over rounds of baseline tokens/s divided by each other command's; and the same
    from each run's fastest step (`fastest_step_*`: the least disturbed figure on a busy host);
    `pooled_step_quantiles` when every run reported all its steps (`pooled_quantiles`)."""
    envs = envs or {}
    steps = {name: [] for name in cmds}  # every timed step of every round (None: a run lacked them)
    tokens_per_step = None
    tokens = {name: [] for name in cmds}
    fastest = {name: [] for name in cmds}
    loads = {name: [] for name in cmds}
    others = {name: [] for name in cmds}
    for r in range(rounds):
        order = list(cmds) if r % 2 == 0 else list(reversed(cmds))  # alternate who goes first
        for name in order:
            load_before = os.getloadavg()[0]
            record, other = measured_run(cmds[name], threads, envs.get(name))
            median_rate, fastest_rate = step_rates(record)
            tokens_per_step = float(record["tokens_per_step"])
            times = step_times(record)
            if steps[name] is not None:
                steps[name] = None if times is None else steps[name] + times
            tokens[name].append(round(median_rate, 1))
            fastest[name].append(round(fastest_rate, 1))
            loads[name].append(round(max(load_before, os.getloadavg()[0]), 2))
            others[name].append(round(other, 2))
            print(
                f"{label} round {r} {name}: {median_rate:.0f} tokens/s median step, {fastest_rate:.0f} fastest "
                f"(load {loads[name][-1]}, other busy CPUs {others[name][-1]})",
                file=sys.stderr,
            )

    def over(rates):
        return {peer: [m / c for m, c in zip(rates[baseline], rates[peer])] for peer in rates if peer != baseline}

    ratios, fastest_ratios = over(tokens), over(fastest)
    pooled = {}
    if rounds and all(ts is not None for ts in steps.values()):
        pooled = {"pooled_step_quantiles": pooled_quantiles(steps, tokens_per_step, baseline)}
    return {
        "tokens_per_s": tokens,
        "fastest_step_tokens_per_s": fastest,
        "loadavg_1min": loads,
        "other_busy_cpus": others,
        "median_tokens_per_s": {name: statistics.median(v) for name, v in tokens.items()},
        f"{baseline}_over": {peer: round(statistics.median(r), 3) for peer, r in ratios.items()},
        "per_round_ratio": {peer: [round(x, 3) for x in r] for peer, r in ratios.items()},
        f"fastest_step_{baseline}_over": {peer: round(statistics.median(r), 3) for peer, r in fastest_ratios.items()},
        **pooled,
    }


def layout_rounds(dim: str, sizes, commands_of, rounds: int, *, gloo: bool, variants=None) -> dict:
    """Interleaved rounds (meshtron the baseline) for each layout size in `sizes` (= processes,
    2 // size threads each): `commands_of(size)` gives the commands, `variants(cmds, envs)` may
    add more, `gloo` adds meshtron on gloo collectives at size > 1. Returns {f"{dim}{size}": summary}."""
    out = {}
    for size in sizes:
        cmds, envs = commands_of(size), {}
        if variants is not None:
            variants(cmds, envs)
        if gloo and size > 1:
            add_gloo_variant(cmds, envs)
        summary = interleaved_rounds(cmds, 2 // size, rounds, baseline="meshtron", envs=envs, label=f"{dim}={size}")
        out[f"{dim}{size}"] = {"processes_x_threads": f"{size}x{2 // size}", **summary}
    return out


def add_gloo_variant(cmds: dict, envs: dict) -> None:
    """Add "meshtron_gloo": meshtron's command again with its CPU collectives on gloo instead of
    shared memory (MESHTRON_SHM_COLLECTIVES=0), to measure what the shared-memory path is worth."""
    cmds["meshtron_gloo"] = cmds["meshtron"]
    envs["meshtron_gloo"] = {"MESHTRON_SHM_COLLECTIVES": "0"}
