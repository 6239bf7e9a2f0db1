"""Issue 38's GPU run: ranks of big layouts rehearsed on one device (`meshtron.training.rehearse`),
their measured memory, compute time and predicted job speed beside the planner's, one record each.

    python bench/rehearse_gpu.py --cpu-rehearsal                       # tiny shapes, fp32, CPU: proves the paths
    python bench/rehearse_gpu.py --budget 400 --out-dir D --reports-dir R   # the GPU run (bench/gpu_session.sh rehearse)
    python bench/rehearse_gpu.py --check FILE.json ...                 # a records file against the targets

What is rehearsed, in this order, in ONE process (each `rehearse(...)` call makes and destroys
its own default process group), each rehearsal a part that starts only while the `--budget`
has room for it (the longest part so far); a part skipped, failed or cut off leaves its
records "not measured", saying why:

1. the card command `+model=gpt_1b parallel.tp=4 parallel.ep=8` (world 8: full depth, 16
   layers, seq 2,048, trainer.precision auto = bf16 on CUDA, the default micro batch) at rank 0;
2. the same at its last rank (7);
3. the planner's top layout for 64 H100s: `python -m meshtron.plan +model=gpt_1b
   trainer.global_batch_size=512 trainer.precision=bf16 --gpus 64 --gpus-per-node 8
   --gpu-memory 80GiB --gpu h100 --json F` (docs/planning.md's command, run here through
   `training.plan_cli.run`; ~30 s of one CPU core: 200 layouts priced, which decides the order
   of layouts tied on modelled speed, so fewer would change the top line), its first
   candidate's overrides after the same ones, world 64, one rank per pipeline stage (stage s:
   global rank s * 64 / pp, the first rank of that stage: pp is the outermost mesh dim);
   `--plan-top "OVERRIDES"` gives that line instead (found beforehand), saving the search;
4. the card's other ranks (1 ... 6), while time is left.

The busiest expert rank of the card is the rehearsed card rank whose expert all-to-alls (the
report's traffic rows with op `all_to_all` over group `ep`) receive the most bytes per step
(lowest rank on a tie). Received bytes count rows: every data row of a dispatch or combine is
hidden x the activation's element size, and the count exchanges are the same size on every
rank. Under the rehearsal's assumption (every peer routes what this rank does,
mpu/rehearsal_groups.py) a rank receives what its own routing sends to its own experts, times
ep, so the ranks differ and only rehearsing them all finds the busiest. Decision: every rank of
the card is rehearsed when the budget allows (the GPU run's default; 8 ranks, guessed ~10-30 s each);
otherwise the busiest of those that ran, rank 0 and the last rank first; the records say which
ranks were compared (`ranks_compared`).

Records (`<out-dir>/<UTC date>-<device>-rehearse.json`, the DESIGN.md output contract, the fields
and `met` rule of bench/kernel_records.py), three per rehearsed rank (card rank 0, card busiest
expert rank, each stage of the top layout):

* `... memory vs planner`: the step's peak in GiB (`meshtron`) beside `planning.plan.plan_rank`'s
  for the same rank (`baseline`); ratio measured / planned; target: within 5% (better
  "within": met = |ratio - 1| <= 0.05);
* `... rank MFU`: the rank's model FLOPs / its measured step time / the device's bf16 dense peak;
  `baseline` the planner preset's compute efficiency (the fraction of peak its model assumes),
  ratio MFU / efficiency; informative (no target);
* `... job tokens/s vs planner`: the whole job's predicted tokens/s (compute measured,
  communication modelled on the h100 preset) beside `planning.step_time.step_time`'s; ratio
  predicted / planned; informative (the issue sets no target).

Full reports (`<reports-dir>/<name>.json`, `meshtron.rehearse --json`'s dict): card_rank0, the
busiest card rank's `card_rank<R>`, plan_stage0 and the last stage's `plan_stage<S>`; every
rehearsal's key figures, the planner's top candidate and the busiest-rank comparison in
`summary.json` (at most 5 files there: the device tool returns 8 files from $OUT).

`--cpu-rehearsal`: the same parts at tiny shapes (moe_tiny narrowed to 2 layers, h 64, seq 32,
fp32, CPU; the plan a 16-GPU search with tp=2 cp=1 pp=2 pinned, so the stage loop runs twice):
every code path in well under a minute, nothing measured (records flagged `rehearsal`).
No torch import at module level (bench/results_table.py imports this module).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from bench.kernel_records import Target, current_env, device_slug, record_of  # noqa: E402
from bench.kernel_records import check as check_records  # noqa: E402

CARD = "card gpt_1b tp4 ep8"
PLAN = "gpt_1b 64xH100 top layout"
MAX_STAGES = 64  # the checker's bound on stage names (pp <= world = 64)
MEMORY_TOLERANCE = 0.05
GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one run rehearses: the card's overrides and world, the planner's overrides and
    `python -m meshtron.plan` options, ranks per node, steps (warm-up included)."""

    card: tuple[str, ...]
    card_world: int
    plan: tuple[str, ...]
    plan_options: tuple[str, ...]
    gpus_per_node: int = 8
    steps: int = 3
    warmup: int = 1


GPU = Setup(
    card=("+model=gpt_1b", "parallel.tp=4", "parallel.ep=8"),
    card_world=8,
    plan=("+model=gpt_1b", "trainer.global_batch_size=512", "trainer.precision=bf16"),
    plan_options=("--gpus", "64", "--gpus-per-node", "8", "--gpu-memory", "80GiB", "--gpu", "h100"),
)
TINY_MODEL = (
    "+model=moe_tiny",
    "model.num_layers=2",
    "model.seq_len=32",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.moe_ffn_hidden_size=64",
    "model.num_kv_heads=4",
    "trainer.precision=fp32",
    "data.max_bytes=100000",
)
CPU = Setup(
    card=(*TINY_MODEL, "parallel.tp=4", "parallel.ep=8", "trainer.global_batch_size=16"),
    card_world=8,
    # tp, cp and pp pinned: pp > 1 runs the stage loop twice (and pinning pp alone trips
    # planning/search.py's enumerate_layouts on pp not dividing world // (tp * cp))
    plan=(*TINY_MODEL, "trainer.global_batch_size=32", "parallel.tp=2", "parallel.cp=1", "parallel.pp=2"),
    plan_options=("--gpus", "16", "--gpus-per-node", "8", "--gpu", "h100"),
    steps=2,
)

# (metric suffix, metric text, unit, target, better)
WHATS = (
    (
        "memory vs planner",
        "peak memory of the rank's step (CUDA caching allocator; CPU profiler) vs planning.plan.plan_rank's, GiB",
        "GiB",
        MEMORY_TOLERANCE,
        "within",
    ),
    (
        "rank MFU",
        "the rank's model FLOPs / its measured step time / the device's dense peak, vs the planner preset's efficiency",
        "fraction",
        None,
        "higher",
    ),
    (
        "job tokens/s vs planner",
        "the job's predicted tokens/s (compute measured, communication modelled) vs planning.step_time.step_time's",
        "tokens/s",
        None,
        "higher",
    ),
)


def labels(stages: int) -> list[str]:
    """The rehearsed ranks' labels in record order: card rank 0, its busiest expert rank, each stage."""
    return [f"{CARD} rank 0", f"{CARD} busiest expert rank", *(f"{PLAN} stage {s}" for s in range(max(stages, 1)))]


def targets_of(label: str) -> list[Target]:
    return [
        Target(f"{label} {what}", metric, unit, target, better, part=label)
        for what, metric, unit, target, better in WHATS
    ]


def known_targets() -> dict[str, Target]:
    """Every target name a results file may hold (stages up to MAX_STAGES)."""
    return {t.name: t for label in labels(MAX_STAGES) for t in targets_of(label)}


def check(records) -> list[str]:
    """Problems of a rehearse results file (bench/kernel_records.py `check` against `known_targets`)."""
    return check_records(records, known_targets(), "issue 38 (bench/rehearse_gpu.py labels)")


def results_name(date: str, device: str) -> str:
    return f"{date}-{device_slug(device)}-rehearse.json"


# --------------------------------------------------------------------------- reports -> records


def ep_recv_bytes(report: dict) -> int:
    """Bytes one step's expert all-to-alls (op all_to_all over group ep) deliver to this rank."""
    return sum(
        r["recv_bytes"] * r["count"] for r in report["traffic"] if r["op"] == "all_to_all" and r["group"] == "ep"
    )


def busiest_rank(received: dict[int, int]) -> int | None:
    """The rank receiving the most expert all-to-all bytes ({rank: bytes}); the lowest on a tie."""
    if not received:
        return None
    return min(received, key=lambda r: (-received[r], r))


def _round(x, digits=4):
    return None if x is None else round(x, digits)


def rank_records(label: str, report: dict | None, env: dict, why: str = "", **extra) -> list[dict]:
    """The three records of one rehearsed rank (`report`: rehearse()'s dict; None: `why`)."""
    mem_t, mfu_t, job_t = targets_of(label)
    if report is None:
        return [record_of(t, env=env, note=why or "not measured", **extra) for t in (mem_t, mfu_t, job_t)]
    common = dict(
        rank=report["rank"],
        world=report["world"],
        layout=report["layout"],
        coords=report["coords"],
        precision=report["precision"],
        rehearsed_on=report["device"],
        **extra,
    )
    measured, planned = report["memory_bytes"]["total"], report["planned_memory_bytes"]["total"]
    ratio = measured / planned if planned else None
    memory = record_of(
        mem_t,
        _round(measured / GIB),
        _round(planned / GIB),
        _round(ratio),
        env=env,
        memory_bytes=report["memory_bytes"],
        planned_memory_bytes=report["planned_memory_bytes"],
        **common,
    )
    efficiency = report.get("planner_efficiency")
    mfu = report["rank_mfu"]
    rank_mfu = record_of(
        mfu_t,
        _round(mfu),
        efficiency,
        _round(mfu / efficiency) if mfu is not None and efficiency else None,
        env=env,
        step_s=report["step_s"],
        phases_s=report["phases_s"],
        peak_flops=report["peak_flops"],
        **common,
    )
    job, plan = report["job"], report["planned_job"]
    job_rec = record_of(
        job_t,
        _round(job["tokens_per_s"], 1),
        _round(plan["tokens_per_s"], 1),
        _round(job["tokens_per_s"] / plan["tokens_per_s"]) if plan["tokens_per_s"] else None,
        env=env,
        job=job,
        planned_job=plan,
        interconnect=report["interconnect"],
        **common,
    )
    return [memory, rank_mfu, job_rec]


def summarize(report: dict) -> dict:
    """A rehearsal's key figures (summary.json)."""
    m = report["memory_bytes"]
    return {
        "rank": report["rank"],
        "world": report["world"],
        "coords": report["coords"],
        "memory_gib": m["total"] / GIB,
        "planned_gib": report["planned_memory_bytes"]["total"] / GIB,
        "memory_ratio": report["memory_ratio"],
        "step_s": report["step_s"],
        "rank_mfu": report["rank_mfu"],
        "job_tokens_per_s": report["job"]["tokens_per_s"],
        "planned_tokens_per_s": report["planned_job"]["tokens_per_s"],
        "implied_efficiency": report.get("implied_efficiency"),  # planning/step_time.py's GPU_EFFICIENCY, measured
        "allocator_reserved_gib": m.get("allocator_reserved", 0) / GIB,
        "other_held_gib": m.get("other_held", 0) / GIB,
        "ep_all_to_all_recv_bytes": ep_recv_bytes(report),
        "losses": report["losses"],
    }


# --------------------------------------------------------------------------- the run


class Run:
    """The parts of one run and what they left: reports, notes, the records file."""

    def __init__(
        self,
        setup: Setup,
        env: dict,
        budget: float,
        out_dir: Path | None,
        reports_dir: Path | None,
        plan_top: str | None = None,
    ):
        self.setup, self.env, self.budget, self.plan_top = setup, env, budget, plan_top
        self.out_dir, self.reports_dir = out_dir, reports_dir
        self.start = time.perf_counter()
        self.card: dict[int, dict] = {}  # rank -> report
        self.card_why: dict[int, str] = {}
        self.stages: dict[int, dict] = {}
        self.stage_why: dict[int, str] = {}
        self.plan: dict | None = None  # the top candidate, its world and overrides
        self.plan_why = "not measured: the planner's search did not run"
        self.longest = 0.0  # the longest rehearsal so far, seconds
        self.timings: dict[str, float] = {}
        self.written_reports: set[str] = set()

    # ---- time

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def room_for(self, what: str) -> str | None:
        """None if a part of the longest length so far fits the budget, else why it does not run."""
        left = self.budget - self.elapsed()
        if left <= 0 or left < self.longest:
            return (
                f"not measured: skipped, {max(left, 0):.0f} s of the {self.budget:.0f} s budget left and a "
                f"rehearsal took up to {self.longest:.0f} s ({what})"
            )
        return None

    # ---- parts

    def rehearse(self, overrides: list[str], world: int, rank: int) -> dict:
        from meshtron.planning.step_time import cluster_preset
        from meshtron.training.cli import compose_run
        from meshtron.training.rehearse import format_report, rehearse

        s = self.setup
        _free()  # what a failed part's traceback held
        t0 = time.perf_counter()
        try:
            report = rehearse(
                compose_run(list(overrides)), world, rank, steps=s.steps, warmup=s.warmup, gpus_per_node=s.gpus_per_node
            )
        finally:
            _free()
            self.longest = max(self.longest, time.perf_counter() - t0)
        per_node = min(world, s.gpus_per_node)
        report["planner_efficiency"] = cluster_preset(
            report["interconnect"], world, per_node, precision=report["precision"]
        ).efficiency
        report["overrides"] = list(overrides)
        report["rehearsal_s"] = time.perf_counter() - t0
        for line in format_report(report):
            print(line, flush=True)
        return report

    def card_part(self, rank: int) -> None:
        why = self.room_for(f"card rank {rank}")
        if why:
            self.card_why[rank] = why
            return
        self.card_why[rank] = f"not measured: card rank {rank} started at {self.elapsed():.0f} s and did not finish"
        self.write()
        print(f"== card rank {rank} ({self.elapsed():.0f} s)", file=sys.stderr, flush=True)
        try:
            self.card[rank] = self.rehearse(list(self.setup.card), self.setup.card_world, rank)
            del self.card_why[rank]
        except Exception as exc:  # noqa: BLE001 - an OOM or a bug in one part leaves the others measured
            self.card_why[rank] = _error(exc)
        self.write()

    def plan_part(self) -> list[int]:
        """The planner's top layout (`python -m meshtron.plan` as docs/planning.md runs it): its stages."""
        why = self.room_for("the planner's search")
        if why:
            self.plan_why = why
            return []
        print(f"== plan search ({self.elapsed():.0f} s)", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            from meshtron.training.plan_cli import run as plan_run

            s = self.setup
            printed = io.StringIO()
            if self.plan_top is not None:  # found beforehand: the search's top line
                pp = [int(o.split("=", 1)[1]) for o in self.plan_top.split() if o.startswith("parallel.pp=")]
                top = {"overrides": self.plan_top, "layout": {"pp": pp[-1] if pp else 1}, "source": "--plan-top"}
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "plan.json"
                    with contextlib.redirect_stdout(printed):
                        code = plan_run([*s.plan, *s.plan_options, "--json", str(path)])
                    if code != 0 or not path.exists():
                        raise RuntimeError(f"python -m meshtron.plan exited {code}: {printed.getvalue()[-400:]}")
                    top = json.loads(path.read_text())["candidates"][0]
            world = int(s.plan_options[s.plan_options.index("--gpus") + 1])
            self.plan = {
                "command": "python -m meshtron.plan " + " ".join([*s.plan, *s.plan_options]),
                "printed": printed.getvalue(),
                "candidate": top,
                "world": world,
                "overrides": [*s.plan, *top["overrides"].split()],
                "search_s": time.perf_counter() - t0,
            }
            print(printed.getvalue(), file=sys.stderr, flush=True)
            pp = int(top["layout"]["pp"])
            self.plan_why = ""
            self.stage_why = {st: f"not measured: stage {st} was not reached" for st in range(pp)}
            return list(range(pp))
        except Exception as exc:  # noqa: BLE001
            self.plan_why = _error(exc)
            return []
        finally:
            self.timings["plan_search_s"] = time.perf_counter() - t0
            self.write()

    def stage_part(self, stage: int) -> None:
        pp, world = int(self.plan["candidate"]["layout"]["pp"]), self.plan["world"]
        rank = stage_rank(stage, pp, world)
        why = self.room_for(f"stage {stage}")
        if why:
            self.stage_why[stage] = why
            return
        self.stage_why[stage] = (
            f"not measured: stage {stage} (rank {rank}) started at {self.elapsed():.0f} s, did not finish"
        )
        self.write()
        print(
            f"== top layout stage {stage}: rank {rank} of {world} ({self.elapsed():.0f} s)", file=sys.stderr, flush=True
        )
        try:
            report = self.rehearse(self.plan["overrides"], world, rank)
            if report["coords"]["pp"] != stage:
                raise RuntimeError(f"rank {rank} is on stage {report['coords']['pp']}, not {stage}")
            self.stages[stage] = report
            del self.stage_why[stage]
        except Exception as exc:  # noqa: BLE001
            self.stage_why[stage] = _error(exc)
        self.write()

    # ---- output

    def busiest(self) -> tuple[int | None, dict[int, int]]:
        received = {r: ep_recv_bytes(rep) for r, rep in self.card.items()}
        return busiest_rank(received), received

    def records(self) -> list[dict]:
        env = self.env
        out = rank_records(
            labels(1)[0], self.card.get(0), env, self.card_why.get(0, "not measured: card rank 0 did not run")
        )
        busy, received = self.busiest()
        compared = sorted(received)
        missing = [r for r in range(self.setup.card_world) if r not in received]
        selection = dict(
            ranks_compared=compared,
            ep_all_to_all_recv_bytes={str(r): b for r, b in sorted(received.items())},
            selection="the rehearsed card rank whose ep all-to-alls receive the most bytes per step"
            + (f"; ranks {missing} not rehearsed" if missing else "; every rank rehearsed"),
        )
        why = "not measured: no card rank was rehearsed" + (f" ({self.card_why.get(0)})" if 0 in self.card_why else "")
        out += rank_records(labels(1)[1], self.card.get(busy), env, why, **selection)
        if self.plan is None:
            out += rank_records(labels(1)[2], None, env, self.plan_why)
            return out
        pp = int(self.plan["candidate"]["layout"]["pp"])
        extra = dict(
            plan_overrides=self.plan["candidate"]["overrides"],
            plan_command=self.plan["command"],
            planned_gib_search=self.plan["candidate"].get("memory_gib"),
        )
        for stage, label in enumerate(labels(pp)[2:]):
            why = self.stage_why.get(stage, "not measured: did not run")
            out += rank_records(label, self.stages.get(stage), env, why, **extra)
        return out

    def write(self) -> list[dict]:
        """The records file and the reports, as they stand (a run killed later keeps them)."""
        records = self.records()
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            _write_json(self.out_dir / results_name(self.env["date"], self.env["device"]), records)
        if self.reports_dir is not None:
            self.reports_dir.mkdir(parents=True, exist_ok=True)
            busy, received = self.busiest()
            want = {}
            if 0 in self.card:
                want["card_rank0"] = self.card[0]
            if busy is not None:
                want[f"card_rank{busy}"] = self.card[busy]
            if self.stages:
                for stage in (min(self.stages), max(self.stages)):
                    want[f"plan_stage{stage}"] = self.stages[stage]
            for name in self.written_reports - set(want):  # a busier rank replaced it
                (self.reports_dir / f"{name}.json").unlink(missing_ok=True)
            for name, report in want.items():
                if name not in self.written_reports:
                    _write_json(self.reports_dir / f"{name}.json", report)
            self.written_reports = set(want)
            summary = {
                "env": self.env,
                "budget_s": self.budget,
                "elapsed_s": self.elapsed(),
                "timings": self.timings,
                "card": {"overrides": list(self.setup.card), "world": self.setup.card_world},
                "card_ranks": {str(r): summarize(rep) for r, rep in sorted(self.card.items())},
                "card_not_measured": {str(r): w for r, w in sorted(self.card_why.items())},
                "busiest_expert_rank": busy,
                "plan": self.plan and {k: v for k, v in self.plan.items()},
                "plan_not_measured": self.plan_why or None,
                "stages": {str(s): summarize(rep) for s, rep in sorted(self.stages.items())},
                "stages_not_measured": {str(s): w for s, w in sorted(self.stage_why.items())},
            }
            _write_json(self.reports_dir / "summary.json", summary)
        return records


def stage_rank(stage: int, pp: int, world: int) -> int:
    """The first global rank of pipeline stage `stage` (pp is the outermost mesh dim)."""
    return stage * (world // pp)


def card_order(world: int, wanted: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(ranks before the plan part, ranks after it): rank 0 and the last rank first, the rest later."""
    ranks = list(range(world)) if wanted is None else [r for r in wanted if 0 <= r < world]
    first = [r for r in (0, world - 1) if r in ranks]
    return list(dict.fromkeys(first)), [r for r in ranks if r not in first]


def _error(exc: BaseException) -> str:
    print(traceback.format_exc(), file=sys.stderr, flush=True)
    return f"failed: {type(exc).__name__}: {str(exc)[:400]}"


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _write_json(path: Path, data) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-rehearsal", action="store_true", help="tiny shapes, fp32, on the CPU (measures nothing)")
    p.add_argument(
        "--budget", type=float, default=420.0, help="seconds: no part starts without room for the longest so far"
    )
    p.add_argument("--parts", default="card,plan", help="comma list of card, plan (default both)")
    p.add_argument("--card-ranks", default=None, help="comma list of card ranks (default: all, 0 and the last first)")
    p.add_argument("--plan-top", default=None, help="the planner's top line (overrides) instead of its search")
    p.add_argument("--out-dir", type=Path, default=None, help="write DIR/<UTC date>-<device>-rehearse.json")
    p.add_argument("--reports-dir", type=Path, default=None, help="write the full reports and summary.json here")
    p.add_argument("--check", nargs="+", type=Path, default=None, help="check these records files; run nothing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check:
        bad = 0
        for path in args.check:
            try:
                problems = check(json.loads(path.read_text()))
            except (OSError, ValueError) as err:
                problems = [f"unreadable: {err}"]
            for line in problems:
                print(f"{path}: {line}")
            bad += bool(problems)
        return 1 if bad else 0
    import torch

    cpu = args.cpu_rehearsal or not torch.cuda.is_available()
    setup = CPU if cpu else GPU
    env = current_env(rehearsal=cpu or None)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    wanted = None if args.card_ranks is None else [int(r) for r in args.card_ranks.split(",") if r.strip()]
    run = Run(setup, env, args.budget, args.out_dir, args.reports_dir, args.plan_top)
    first, later = card_order(setup.card_world, wanted) if "card" in parts else ([], [])
    for rank in [*first, *later]:
        run.card_why[rank] = f"not measured: card rank {rank} was not reached"
    if "plan" not in parts:
        run.plan_why = "not measured: the plan part was not asked for (--parts)"
    run.write()
    for rank in first:
        run.card_part(rank)
    if "plan" in parts:
        for stage in run.plan_part():
            run.stage_part(stage)
    for rank in later:
        run.card_part(rank)
    records = run.write()
    problems = check(records)
    measured = sum(r["meshtron"] is not None for r in records)
    met = sum(r["met"] is True for r in records)
    busy, _ = run.busiest()
    print(
        f"{len(records)} records, {measured} with a figure, {met} targets met; busiest expert rank {busy}; "
        f"{run.elapsed():.1f} s of {args.budget:.0f} s",
        file=sys.stderr,
    )
    if args.out_dir is None:
        print(json.dumps(records, indent=1, ensure_ascii=False))
    for line in problems:
        print(f"schema: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
