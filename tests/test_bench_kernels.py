"""bench/kernel_speed.py's measurement machinery, bench/kernel_records.py's targets, schema and merge,
and bench/results_table.py's generated table in docs/kernels.md, all on the CPU. The whole
prepared GPU run (`bench/gpu_session.sh kernels`) is rehearsed in tests/test_gpu_session.py."""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F

from bench import kernel_records as kr
from bench import kernel_speed as bk
from bench import results_table as rt

ENV = {"device": "NVIDIA H200", "date": "2026-11-28", "torch": "2.11.0+cu130", "triton": "3.6.0"}


# --------------------------------------------------------------------------- targets and schema


def test_targets_are_the_issues_names_once_each():
    names = [t.name for t in kr.TARGETS]
    assert len(names) == len(set(names))
    for shape in kr.SHAPES:  # every kernel family at both shapes
        for stem in ("gemm x·Wᵀ", "gemm dX", "gemm dW", "linear+GeLU", "linear+SwiGLU", "cross-entropy vs F.cross_entropy",
                     "grouped GEMM grouped_mm vs dense", "grouped GEMM Triton vs grouped_mm"):  # fmt: skip
            assert f"{stem} {shape}" in names
    for name in ("residual+RMSNorm h2048 device", "residual+RMSNorm h2048 wall", "residual+LayerNorm h2048 host",
                 "RMSNorm h8192 device", "fused LM head + loss peak memory vs Liger", "FP8 GEMM vs bf16 8b",
                 "end to end llama 8L h1024 auto vs torch", "end to end gpt_1b 4L auto vs torch"):  # fmt: skip
        assert name in names
    t = kr.BY_NAME
    assert (t["linear+SwiGLU gpt_1b_tp4"].target, t["grouped GEMM grouped_mm vs dense 8b"].target) == (1.05, 0.60)
    assert (t["residual+RMSNorm h2048 host"].target, t["residual+RMSNorm h2048 host"].better) == (10, "lower")
    assert set(kr.PARTS) == {"gpt_1b_tp4", "8b", "e2e_llama", "e2e_gpt_1b", "e2e_fp8"}
    assert set(bk.CASES) == set(kr.SHAPES)


def test_met_follows_ratio_or_figure_and_target():
    assert kr.met_of(1.0, 0.95, 0.90, "higher") is True
    assert kr.met_of(1.0, 0.85, 0.90, "higher") is False
    assert kr.met_of(None, None, 0.90, "higher") is False
    assert kr.met_of(9.5, 1.2, 10, "lower") is True and kr.met_of(12.0, 3.0, 10, "lower") is False
    assert kr.met_of(1.0, 2.0, None, "higher") is None
    rec = kr.make_record("linear+GeLU 8b", 2.0, 2.2, 1.1, env=ENV, shape={"tokens": 8192})
    assert set(kr.RECORD_KEYS) <= set(rec) and rec["met"] is True and rec["shape"] == {"tokens": 8192}
    assert kr.make_record("linear+GeLU 8b", float("nan"), 1.0, float("inf"), env=ENV, note="x")["ratio"] is None


def test_check_catches_each_kind_of_bad_record():
    good = kr.merge([[kr.make_record("gemm dX 8b", 1.0, 0.95, 0.95, env=ENV)]], ENV)
    assert kr.check(good) == []
    assert kr.check([]) and kr.check({"name": "x"})
    cases = {
        "missing keys": lambda r: r.pop("triton"),
        "met True but": lambda r: r.update(met=True),
        "not a target": lambda r: r.update(name="gemm dX 9b"),
        "target 0.5 but": lambda r: r.update(target=0.5),
        "no note": lambda r: r.update(note=None),
        "is not a number": lambda r: r.update(baseline="fast"),
        "not YYYY-MM-DD": lambda r: r.update(date="28/11/2026"),
    }
    for want, breaks in cases.items():
        bad = json.loads(json.dumps(good))
        breaks(next(r for r in bad if r["meshtron"] is None))
        assert any(want in line for line in kr.check(bad)), (want, kr.check(bad))
    repeated = good + good[:1]
    assert any("repeated" in line for line in kr.check(repeated))


def test_merge_gives_every_target_one_record_in_order():
    part = [kr.make_record("gemm dX 8b", 1.0, 0.95, 0.95, env=ENV), kr.make_record("gemm dX 8b", 9, 9, 1, env=ENV)]
    merged = kr.merge([part], ENV)
    assert [r["name"] for r in merged] == [t.name for t in kr.TARGETS] and kr.check(merged) == []
    by = {r["name"]: r for r in merged}
    assert by["gemm dX 8b"]["meshtron"] == 1.0  # the first of a name wins
    assert "part '8b' did not run" in by["FP8 expert GEMM vs bf16 8b"]["note"]  # built: measured with 8b
    assert "part 'e2e_llama' did not run" in by["end to end llama 8L h1024 auto vs torch"]["note"]
    assert by["gemm dW gpt_1b_tp4"]["meshtron"] is None and by["gemm dW gpt_1b_tp4"]["met"] is False


def test_merge_cli_names_the_file_by_date_and_device(tmp_path):
    part = tmp_path / "part.json"
    part.write_text(json.dumps([kr.make_record("gemm dX 8b", 1.0, 0.95, 0.95, env=ENV)]))
    assert kr.main(["merge", "--dir", str(tmp_path / "gpu"), str(part), str(tmp_path / "absent.json")]) == 0
    out = tmp_path / "gpu" / "2026-11-28-h200-kernels.json"
    assert kr.check(json.loads(out.read_text())) == [] and kr.main(["check", str(out)]) == 0
    assert kr.device_slug("NVIDIA H100 80GB HBM3") == "h100" and kr.device_slug("cpu") == "cpu"


# --------------------------------------------------------------------------- measuring


class FakeGraph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_measure_prefers_graph_replays_then_the_profiler_and_records_which(monkeypatch):
    """On a (pretended) CUDA device: a side that captures is timed by graph replays, one whose
    capture raises by the profiler's kernel time, one whose call raises keeps its error; the
    rounds alternate the sides."""
    calls = []
    monkeypatch.setattr(bk, "sync", lambda device: None)
    monkeypatch.setattr(bk, "_replay_ms", lambda graph, replays: (graph.replay(), 0.5)[1])

    def capture(step, device):
        if step is sides[1].step:
            raise RuntimeError("operation not permitted when stream is capturing")
        return FakeGraph(), 7

    sides = [
        bk.Side("meshtron", "m", lambda: calls.append("m"), lambda: None),
        bk.Side("baseline", "b", lambda: calls.append("b")),
        bk.Side("broken", "x", lambda: 1 / 0),
    ]
    plan = bk.Plan(warmup=1, rounds=2, wall_iters=1, host_bursts=1, host_burst=1, profile_calls=1)
    figs = bk.measure(sides, torch.device("cuda"), plan, capture_fn=capture, profile_fn=lambda s, d, n: 2.0)
    m, b, x = figs["meshtron"], figs["baseline"], figs["broken"]
    assert (m.method, m.device_ms, b.method, b.device_ms) == ("cuda_graph", 0.5, "profiler", 2.0)
    assert "capturing" in b.capture_error and m.capture_error is None
    assert x.error == "ZeroDivisionError: division by zero" and x.device_ms is None
    assert m.host_fwd_us is not None and b.host_fwd_us is None and m.wall_ms is not None
    # warm-up m, b; round 1: m (host, wall), b (host, wall); round 2 the other way round
    assert calls == ["m", "b", "m", "m", "b", "b", "b", "b", "m", "m"]
    rec = bk.time_record(
        bk.Ctx(torch.device("cuda"), torch.bfloat16, plan, ENV, "8b", {}), "gemm dW 8b", figs, {}, shape={}
    )
    assert (
        rec["ratio"] == 4.0
        and rec["met"] is True
        and rec["method"] == {"meshtron": "cuda_graph", "baseline": "profiler"}
    )
    assert "not capturable in a CUDA graph" in rec["note"] and rec["host_us"]["meshtron"] is not None


def test_on_the_cpu_the_wall_time_stands_in_for_the_device_time():
    figs = bk.measure([bk.Side("meshtron", "m", lambda: torch.ones(8).sum())], torch.device("cpu"), bk.Plan(rounds=1))
    assert figs["meshtron"].method == "cpu_wall" and figs["meshtron"].device_ms == figs["meshtron"].wall_ms > 0


def test_profiler_kernel_time_sums_device_work_but_not_annotations():
    def ev(kind, start, end, annotation=False):
        return types.SimpleNamespace(
            device_type=types.SimpleNamespace(name=kind),
            time_range=types.SimpleNamespace(start=start, end=end),
            is_user_annotation=annotation,
        )

    events = [ev("CUDA", 0, 300), ev("CUDA", 400, 500), ev("CPU", 0, 9000), ev("CUDA", 0, 5000, annotation=True)]
    assert bk.kernel_ms_of_events(events) == pytest.approx(0.4)
    assert bk.kernel_ms_of_events([ev("CPU", 0, 10)]) is None


def test_saved_activations_count_what_autograd_keeps_beyond_the_inputs():
    x, w, b = torch.randn(16, 8), torch.randn(12, 8), torch.randn(12)
    unit = 16 * 12 * 4
    assert bk.saved_bytes(lambda x, w, b: F.gelu(F.linear(x, w, b), approximate="tanh"), [x, w, b]) == unit
    swiglu = bk.saved_bytes(lambda x, g, u: F.silu(F.linear(x, g)) * F.linear(x, u), [x, w, w.clone()])
    assert swiglu == 3 * unit


def test_fwd_bwd_backs_every_output_with_a_fixed_gradient():
    x = torch.randn(4, 6)
    seen = []

    def op(a):
        a.register_hook(lambda g: seen.append(g.clone()))
        return a * 2, a.sum()

    step, fwd = bk.fwd_bwd(op, [x])
    step()
    step()
    assert len(seen) == 2 and torch.equal(seen[0], seen[1]) and len(fwd()) == 2


# --------------------------------------------------------------------------- the docs table


def test_docs_kernel_table_matches_the_committed_results():
    assert rt.main(["--check"]) == 0


def _table_dirs(tmp_path):
    """A results folder, a doc with the markers and a copy of kernels/measured.json, in tmp_path;
    `rt_main(*args)` runs bench/results_table.py on them."""
    res, doc, measured = tmp_path / "gpu", tmp_path / "kernels.md", tmp_path / "measured.json"
    res.mkdir()
    doc.write_text(f"# K\n\n{rt.BEGIN}\n{rt.END}\n\ntail\n")
    (tmp_path / "performance.md").write_text(f"# P\n\n{rt.PEERS_BEGIN}\n{rt.PEERS_END}\n")
    measured.write_text(rt.MEASURED.read_text())
    return res, doc, measured


def test_results_table_uses_the_newest_gpu_file_per_device_and_check_catches_staleness(tmp_path):
    res, doc, measured = _table_dirs(tmp_path)

    def rt_main(*args):
        return rt.main([*args, "--measured", str(measured), "--peers-doc", str(tmp_path / "performance.md")])

    assert rt_main(*["--results", str(res), "--doc", str(doc)]) == 0
    assert "No GPU run has recorded figures in this format yet" in doc.read_text()
    assert rt_main(*["--check", "--results", str(res), "--doc", str(doc)]) == 0
    for date, ratio in (("2026-11-28", 0.95), ("2026-11-30", 0.5)):
        env = dict(ENV, date=date)
        records = kr.merge([[kr.make_record("gemm dX 8b", 1.0, ratio, ratio, env=env)]], env)
        (res / kr.results_name(date, env["device"])).write_text(json.dumps(records))
    cpu = dict(ENV, device="cpu", rehearsal=True)
    (res / kr.results_name("2026-12-01", "cpu")).write_text(json.dumps(kr.merge([], cpu)))
    assert rt_main(*["--check", "--results", str(res), "--doc", str(doc)]) == 1  # stale, and a rehearsal file
    (res / "2026-12-01-cpu-kernels.json").unlink()
    assert rt_main(*["--results", str(res), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "**NVIDIA H200, 2026-11-30**" in text and "2026-11-28" not in text and text.endswith("\ntail\n")
    assert "| gemm dX 8b | 1 | 0.5 | ms | 0.5 | ≥ 0.9 | no |" in text
    assert rt_main(*["--check", "--results", str(res), "--doc", str(doc)]) == 0
    bad = json.loads((res / "2026-11-30-h200-kernels.json").read_text())
    bad[0]["met"] = not bad[0]["met"]
    (res / "2026-11-30-h200-kernels.json").write_text(json.dumps(bad))
    assert rt_main(*["--check", "--results", str(res), "--doc", str(doc)]) == 1


def test_measured_table_takes_each_kernels_speedup_from_a_gpu_results_file(tmp_path):
    """kernels/measured.json gains one entry per kernel of a GPU results file (device time,
    baseline / meshtron; the GEMM engine's slowest of its three GEMMs; the cross-entropy over
    meshtron's torch path), keeps its hand-kept entries, and --check sees it stale before."""
    from meshtron.kernels import backend

    res, doc, measured = _table_dirs(tmp_path)
    env = dict(ENV, date="2026-12-02")
    part = [
        kr.make_record("linear+GeLU gpt_1b_tp4", 1.0, 1.25, 1.25, env=env, dtype="bfloat16"),
        kr.make_record("RMSNorm h2048 device", 0.1, 0.05, 0.5, env=env, dtype="bfloat16"),
        kr.make_record("gemm x·Wᵀ gpt_1b_tp4", 1.0, 1.1, 1.1, env=env),
        kr.make_record("gemm dX gpt_1b_tp4", 1.0, 0.92, 0.92, env=env),
        kr.make_record("gemm dW gpt_1b_tp4", 1.0, 1.3, 1.3, env=env),
        kr.make_record("cross-entropy vs F.cross_entropy gpt_1b_tp4", 0.2, 0.5, 2.5, env=env),
        kr.make_record("cross-entropy torch path vs F.cross_entropy gpt_1b_tp4", 1.0, 0.5, 0.5, env=env),
    ]
    (res / kr.results_name(env["date"], env["device"])).write_text(json.dumps(kr.merge([part], env)))
    args = ["--results", str(res), "--doc", str(doc), "--measured", str(measured)]
    assert rt.main(["--check", *args]) == 1  # the table and measured.json are stale
    assert rt.main(args) == 0 and rt.main(["--check", *args]) == 0 and rt.main(args) == 0  # idempotent
    table = json.loads(measured.read_text())["measurements"]
    new = {m["kernel"]: m for m in table if m["date"] == "2026-12-02"}
    assert set(new) == {"linear_gelu", "rms_norm", "gemm", "cross_entropy"}
    assert (new["linear_gelu"]["speedup"], new["linear_gelu"]["dtype"]) == (1.25, "bf16")
    assert new["gemm"]["speedup"] == 0.92 and new["cross_entropy"]["speedup"] == 5.0
    assert all(m["source"].endswith("2026-12-02-h200-kernels.json") for m in new.values())
    assert len(table) == len(json.loads(rt.MEASURED.read_text())["measurements"]) + 4  # the hand-kept ones stay
    # What auto would run on that GPU with this table: GeLU and the cross-entropy Triton, RMSNorm
    # and the GEMM engine torch (newest figure below 1).
    cached = backend._measurements
    try:
        backend._measurements = lambda: tuple(table)
        backend.prefers_torch_on_cuda.cache_clear()
        prefers = {k: backend.prefers_torch_on_cuda(k) for k in ("linear_gelu", "cross_entropy", "rms_norm", "gemm")}
    finally:
        backend._measurements = cached
        backend.prefers_torch_on_cuda.cache_clear()
    assert prefers == {"linear_gelu": False, "cross_entropy": False, "rms_norm": True, "gemm": True}
