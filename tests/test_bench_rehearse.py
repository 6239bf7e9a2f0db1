"""bench/rehearse_gpu.py (issue 38's GPU run of `meshtron.rehearse`): the CPU rehearsal writes a
records file the checker passes, the checker refuses a bad one (the two-sided "within" rule of
the memory target included), the busiest expert rank is picked from the ep all-to-alls' received
bytes, a part without room in the budget is recorded as skipped, and bench/results_table.py
turns a GPU file into docs/planning.md's table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import rehearse_gpu as rg
from bench.kernel_records import RECORD_KEYS, met_of

ROOT = Path(__file__).resolve().parents[1]
ENV = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-28", "torch": "2.11.0", "triton": "3.6.0"}
GIB = 1024**3

pytestmark = pytest.mark.timeout(120)


def _row(group: str, op: str, recv: int, count: int = 1) -> dict:
    return {"group": group, "op": op, "send_bytes": recv, "recv_bytes": recv, "ranks": 8, "inter_node": False} | {
        "count": count,
        "seconds": 1e-4,
    }


def _report(rank: int, recv: int = 1000, measured: float = 20.0, planned: float = 20.0, world: int = 8) -> dict:
    """A rehearse() report with the keys bench/rehearse_gpu.py reads."""
    return {
        "rank": rank,
        "world": world,
        "layout": f"rank {rank}/{world}: dense pp=1 dp=2 tp=4",
        "coords": {"pp": 0, "dp": rank // 4, "cp": 0, "tp": rank % 4, "edp": 0, "ep": rank, "etp": 0},
        "device": "cuda:0 (NVIDIA H100 80GB HBM3)",
        "precision": "bf16",
        "memory_bytes": {"weights": 1, "grads": 1, "optimizer": 2, "activations": 3, "total": int(measured * GIB)},
        "planned_memory_bytes": {"total": int(planned * GIB)},
        "memory_ratio": measured / planned,
        "step_s": 0.5,
        "phases_s": {"forward": 0.2, "optimizer": 0.05, "backward_and_reduce": 0.25},
        "rank_mfu": 0.35,
        "peak_flops": {"per_device": 989e12, "source": "datasheet"},
        "planner_efficiency": 0.5,
        "interconnect": "h100",
        "traffic": [
            _row("ep", "all_to_all", recv, count=2),
            _row("ep", "all_to_all", 64),  # the counts exchange
            _row("tp", "all_to_all", 10**9),  # not an expert all-to-all
            _row("ep", "all_reduce", 10**9),  # not an all-to-all
        ],
        "job": {"step_s": 0.6, "tokens_per_s": 50000.0},
        "planned_job": {"step_s": 0.5, "tokens_per_s": 60000.0},
        "losses": [10.9, 10.8, 10.7],
    }


def test_busiest_expert_rank_is_the_one_receiving_most_expert_all_to_all_bytes():
    reports = {r: _report(r, recv) for r, recv in {0: 500, 3: 900, 5: 900, 7: 100}.items()}
    received = {r: rg.ep_recv_bytes(rep) for r, rep in reports.items()}
    assert received == {0: 1064, 3: 1864, 5: 1864, 7: 264}  # 2 x data + 64 of counts; tp / all_reduce rows left out
    assert rg.busiest_rank(received) == 3  # the lowest rank of a tie
    assert rg.busiest_rank({0: 5}) == 0 and rg.busiest_rank({}) is None
    assert rg.card_order(8) == ([0, 7], [1, 2, 3, 4, 5, 6])
    assert rg.card_order(8, [3, 0]) == ([0], [3])
    assert [rg.stage_rank(s, 4, 64) for s in range(4)] == [0, 16, 32, 48]


def test_memory_target_is_two_sided_within_five_percent():
    assert met_of(1.0, 1.04, 0.05, "within") and met_of(1.0, 0.951, 0.05, "within")
    assert not met_of(1.0, 1.06, 0.05, "within") and not met_of(1.0, 0.94, 0.05, "within")
    assert met_of(1.0, 0.95, 0.05, "within") and met_of(1.0, 1.05, 0.05, "within")  # the bounds, despite rounding
    assert met_of(1.0, None, 0.05, "within") is False
    recs = rg.rank_records(f"{rg.CARD} rank 0", _report(0, measured=21.5, planned=20.0), ENV)
    mem, mfu, job = recs
    assert (mem["meshtron"], mem["baseline"], mem["ratio"], mem["target"], mem["met"]) == (
        21.5,
        20.0,
        1.075,
        0.05,
        False,
    )
    assert mem["better"] == "within" and mem["unit"] == "GiB"
    assert (mfu["meshtron"], mfu["baseline"], mfu["ratio"], mfu["met"]) == (0.35, 0.5, 0.7, None)
    assert (job["meshtron"], job["baseline"], job["ratio"], job["met"]) == (50000.0, 60000.0, 0.8333, None)
    assert rg.check(recs) == []
    ok = rg.rank_records(f"{rg.CARD} rank 0", _report(0, measured=19.2, planned=20.0), ENV)[0]
    assert ok["met"] is True  # 4% under


def test_checker_refuses_a_bad_file():
    good = rg.rank_records(f"{rg.CARD} rank 0", _report(0), ENV)
    assert rg.check(good) == [] and all(set(RECORD_KEYS) <= set(r) for r in good)
    problems = rg.check(
        [
            dict(good[0], met=False),  # |1 - 1| <= 0.05: met is True
            dict(good[1], name=f"{rg.CARD} rank 0 speed"),
            dict(good[2], target=1.1),
        ]
    )
    assert any("met False but within / ratio / target say True" in p for p in problems), problems
    assert any("not a target of issue 38" in p for p in problems), problems
    assert any("target 1.1 but TARGETS says None" in p for p in problems), problems
    assert rg.check([]) == ["not a non-empty JSON list of records"]
    missing = rg.rank_records(f"{rg.PLAN} stage 3", None, ENV, "not measured: skipped")
    assert rg.check(missing) == [] and all(r["met"] in (False, None) for r in missing)
    assert rg.check([dict(missing[0], note=None)]) == [
        f"record 0 ({missing[0]['name']!r}): no figure and no note saying why"
    ]


def test_a_part_without_room_in_the_budget_is_skipped_and_said_so():
    run = rg.Run(rg.CPU, dict(ENV, rehearsal=True), budget=0.0, out_dir=None, reports_dir=None)
    run.card_part(0)  # no room: nothing is built
    assert run.card == {} and "skipped, 0 s of the 0 s budget left" in run.card_why[0]
    assert run.plan_part() == [] and "skipped" in run.plan_why
    records = run.records()
    assert rg.check(records) == [] and len(records) == 9
    assert all(r["meshtron"] is None and "not measured" in r["note"] for r in records)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out = tmp_path_factory.mktemp("rehearse")
    proc = subprocess.run(
        [sys.executable, "bench/rehearse_gpu.py", "--cpu-rehearsal", "--card-ranks", "0,1,7"]
        + ["--out-dir", str(out / "gpu"), "--reports-dir", str(out / "reports")],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1"),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = (out / "gpu").glob("*.json")
    return out, path, json.loads(path.read_text()), proc.stderr


def test_cpu_rehearsal_writes_records_the_checker_passes(rehearsal):
    out, path, records, log = rehearsal
    assert path.name.endswith("-cpu-rehearse.json")
    assert rg.check(records) == []
    # card rank 0, the busiest card rank, the tiny plan's two pipeline stages; three records each
    assert [r["name"] for r in records] == [t.name for label in rg.labels(2) for t in rg.targets_of(label)]
    assert all(r["rehearsal"] and r["device"] == "cpu" for r in records)
    assert all(r["meshtron"] is not None and r["meshtron"] > 0 for r in records), records
    summary = json.loads((out / "reports" / "summary.json").read_text())
    received = {int(r): s["ep_all_to_all_recv_bytes"] for r, s in summary["card_ranks"].items()}
    assert sorted(received) == [0, 1, 7]
    busy = rg.busiest_rank(received)
    by = {r["name"]: r for r in records}
    chosen = by[f"{rg.CARD} busiest expert rank memory vs planner"]
    assert chosen["rank"] == busy == summary["busiest_expert_rank"] and chosen["ranks_compared"] == [0, 1, 7]
    assert "ranks [2, 3, 4, 5, 6] not rehearsed" in chosen["selection"]
    assert [by[f"{rg.PLAN} stage {s} memory vs planner"]["rank"] for s in (0, 1)] == [0, 8]  # world 16, pp 2
    names = {p.name for p in (out / "reports").glob("*.json")}
    assert names == {"summary.json", "card_rank0.json", f"card_rank{busy}.json", "plan_stage0.json", "plan_stage1.json"}
    full = json.loads((out / "reports" / "card_rank0.json").read_text())
    assert full["world"] == 8 and full["traffic"] and full["memory_bytes"]["total"] > 0
    assert "busiest expert rank" in log


def test_results_table_checks_rehearse_files_and_refuses_cpu_ones(rehearsal, tmp_path):
    from bench import results_table

    _out, path, records, _log = rehearsal
    (tmp_path / path.name).write_text(json.dumps(records))
    found = results_table.problems(tmp_path)
    assert found == [f"{path.name}: a CPU rehearsal's records (measure nothing), not a GPU run"], found
    (tmp_path / path.name).unlink()
    good = rg.rank_records(f"{rg.CARD} rank 0", _report(0), ENV)
    (tmp_path / rg.results_name("2026-11-28", ENV["device"])).write_text(json.dumps(good))
    assert results_table.problems(tmp_path) == []
    (tmp_path / rg.results_name("2026-11-28", ENV["device"])).write_text(json.dumps([dict(good[0], met=False)]))
    assert any("met False" in line for line in results_table.problems(tmp_path))


def test_results_table_generates_the_rehearse_table(tmp_path):
    from bench import results_table

    res = tmp_path / "gpu"
    res.mkdir()
    kernels, perf, plan = tmp_path / "kernels.md", tmp_path / "performance.md", tmp_path / "planning.md"
    measured = tmp_path / "measured.json"
    kernels.write_text(f"{results_table.BEGIN}\n{results_table.END}\n")
    perf.write_text(f"{results_table.PEERS_BEGIN}\n{results_table.PEERS_END}\n")
    plan.write_text(f"# P\n\n{results_table.REHEARSE_BEGIN}\n{results_table.REHEARSE_END}\n\ntail\n")
    measured.write_text(results_table.MEASURED.read_text())
    args = ["--results", str(res), "--doc", str(kernels), "--peers-doc", str(perf), "--rehearse-doc", str(plan)]
    args += ["--measured", str(measured)]
    assert results_table.main(args) == 0 and "No GPU run has rehearsed a rank yet" in plan.read_text()
    records = rg.rank_records(f"{rg.CARD} rank 0", _report(0, measured=19.0, planned=20.0), ENV)
    records += rg.rank_records(f"{rg.CARD} busiest expert rank", _report(5, measured=23.0, planned=20.0), ENV)
    records += rg.rank_records(f"{rg.PLAN} stage 0", None, ENV, "not measured: skipped, 3 s of the 400 s budget left")
    (res / rg.results_name("2026-11-28", ENV["device"])).write_text(json.dumps(records))
    assert rg.check(records) == []
    assert results_table.main(["--check", *args]) == 1  # the block is stale
    assert results_table.main(args) == 0 and results_table.main(["--check", *args]) == 0
    text = plan.read_text()
    assert (
        "**NVIDIA H100 80GB HBM3, 2026-11-28**" in text
        and "3 ranks, memory within 0.05 of the planner's for 1." in text
    )
    assert f"| {rg.CARD} rank 0 | 0 / 8 | 19 | 20 | 0.95 | yes | 0.5 | 0.35 | 50,000 | 60,000 |" in text
    assert f"| {rg.CARD} busiest expert rank | 5 / 8 | 23 | 20 | 1.15 | no |" in text
    assert f"| {rg.PLAN} stage 0 | - | - | - | - | no | - | - | - | - | not measured: skipped" in text
    assert text.startswith("# P\n") and text.endswith("tail\n")


def test_gpu_session_rehearse_verb_runs_the_cpu_rehearsal(tmp_path):
    """`bash bench/gpu_session.sh rehearse` without CUDA: installs, rehearses at tiny shapes,
    checks the records file; at most 8 files come back from $OUT (the device tool's limit)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a GPU `rehearse` is the real session (minutes)")
    out = tmp_path / "out"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONDONTWRITEBYTECODE="1",
        OUT=str(out),
        GPU_SESSION_SITE=str(tmp_path / "site"),
        GPU_SESSION_REHEARSE_ARGS="--card-ranks 0,7",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        ["bash", "bench/gpu_session.sh", "rehearse"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110
    )
    log = (out / "log.txt").read_text()
    assert proc.returncode == 0, proc.stdout + log
    assert "no CUDA: bench/rehearse_gpu.py's CPU rehearsal" in log and "passes" in log
    (path,) = (out / "results" / "gpu").glob("*-cpu-rehearse.json")
    records = json.loads(path.read_text())
    assert rg.check(records) == [] and records[0]["meshtron"] is not None
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
