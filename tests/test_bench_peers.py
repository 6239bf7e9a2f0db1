"""bench/peers.py (issue 37: meshtron beside torchtitan and Megatron-Core on one device): the
one FLOP formula against hand-computed figures, the records' schema and `met` rule, the
"not measured" records of a part that did not run, the CPU rehearsal (meshtron always; each
peer when it imports here: `.peers-cpu/`, see docs/performance.md; CI has none) and
bench/gpu_session.sh's `peers` part on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import peers  # noqa: E402

from bench.kernel_records import RECORD_KEYS  # noqa: E402
from meshtron.planning.flops import param_count  # noqa: E402

pytestmark = pytest.mark.timeout(240)
REHEARSED = ("dense_1b", "moe_fine")
ENV = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-28", "torch": "2.11.0", "triton": "3.6.0"}


def _env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", **extra)


def test_flop_formula_on_known_shapes():
    # dense_1b: h 2048, 16 layers, 32 heads of 64, 8 kv heads, ffn 8192, vocab 128256, seq 4096.
    # Forward per token and layer: QKV 2*2048*(32+16)*64 = 12,582,912; scores + values
    # 4*4096*2048 = 33,554,432; out proj 2*2048^2 = 8,388,608; SwiGLU 2*3*2048*8192 = 100,663,296
    # -> 155,189,248 x 16 = 2,483,027,968; LM head 2*2048*128256 = 525,336,576;
    # x 3 (forward + backward) = 9,025,093,632.
    assert peers.flops_per_token(peers.MODELS["dense_1b"]) == 9_025_093_632
    # moe_mixtral: the same attention (54,525,952 a layer), router 2*2048*8 = 32,768, two experts
    # 2*2*3*2048*8192 = 201,326,592 -> 255,885,312 x 6 layers + 525,336,576, x 3 = 6,181,945,344.
    assert peers.flops_per_token(peers.MODELS["moe_mixtral"]) == 6_181_945_344
    # the same as 6 * N + 12 * L * h * s with N the matmul weights, LM head once
    s = peers.MODELS["dense_1b"]
    n = s.layers * (s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.hidden**2 + 3 * s.hidden * s.ffn)
    n += s.hidden * s.vocab
    assert peers.flops_per_token(s) == 6 * n + 12 * s.layers * s.hidden * s.seq


def test_records_of_parts_that_did_not_run_say_not_measured():
    records = peers.merge({}, ENV)
    names = [name for model in peers.MODELS for name, _ in peers.target_names(model)]
    assert [r["name"] for r in records] == names and len(names) == 14
    assert all(set(RECORD_KEYS) <= set(r) for r in records)
    assert all(r["meshtron"] is None and "not measured" in r["note"] for r in records)
    assert {r["met"] for r in records} == {False, None}  # None: the informative figures
    assert peers.check(records) == []
    assert peers.results_name("2026-11-28", ENV["device"]) == "2026-11-28-h100-peers.json"


def _raw(meshtron: float, torchtitan: float | None, megatron: float | None) -> dict:
    def side(tps, mem):
        if tps is None:
            return {"ok": False, "error": "OutOfMemoryError: CUDA out of memory", "oom": True}
        return {"ok": True, "system": "x", "tokens_per_s": tps, "mfu": tps / 1e5, "peak_bytes": mem}

    return {
        "model": "dense_1b",
        "shape": {"layers": 16},
        "device_type": "cuda",
        "precision": "bf16 autocast, fp32 weights",
        "peak_source": "datasheet: NVIDIA H100 SXM bf16 dense",
        "rounds": "alternating",
        "sides": {
            "meshtron": side(meshtron, 30e9),
            "torchtitan": side(torchtitan, 40e9),
            "megatron": side(megatron, 60e9),
        },
    }


def test_records_compare_with_the_right_peer_and_set_met():
    by = {r["name"]: r for r in peers.model_records("dense_1b", _raw(60000.0, 50000.0, 40000.0), ENV)}
    tt = by["dense_1b tokens/s vs torchtitan (compiled)"]
    assert (tt["meshtron"], tt["baseline"], tt["ratio"], tt["met"]) == (60000.0, 50000.0, 1.2, True)
    mfu = by["dense_1b MFU"]
    assert (mfu["ratio"], mfu["target"], mfu["met"]) == (0.6, 0.5, True)
    assert by["dense_1b tokens/s vs Megatron-Core"]["met"] is None  # informative
    mem = by["dense_1b peak memory vs the peers"]
    assert (mem["baseline"], mem["peer"], mem["ratio"], mem["met"]) == (40e9, "torchtitan", 1.3333, True)
    # a peer out of memory: the memory record compares with the one that ran and says so
    by = {r["name"]: r for r in peers.model_records("dense_1b", _raw(40000.0, 50000.0, None), ENV)}
    assert by["dense_1b tokens/s vs torchtitan (compiled)"]["met"] is False
    assert by["dense_1b peak memory vs the peers"]["peers_oom"] == ["megatron"]
    assert "out of memory" in by["dense_1b tokens/s vs Megatron-Core"]["note"]
    bad = [dict(by["dense_1b MFU"], met=True)]
    assert any("met True but higher / ratio / target say False" in line for line in peers.check(bad))


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers")
    proc = subprocess.run(
        [sys.executable, "bench/peers.py", "--cpu-rehearsal", "--models", *REHEARSED, "--out-dir", str(out / "gpu")]
        + ["--raw-dir", str(out / "raw")],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = (out / "gpu").glob("*.json")
    raws = {p.stem: json.loads(p.read_text()) for p in (out / "raw").glob("*.json")}
    return path, json.loads(path.read_text()), raws


def test_cpu_rehearsal_measures_meshtron_and_writes_every_record(rehearsal):
    path, records, raws = rehearsal
    assert path.name.endswith("-cpu-peers.json")
    assert peers.check(records) == [] and len(records) == 14
    assert all(r["rehearsal"] and r["device"] == "cpu" and r["torch"] == torch.__version__ for r in records)
    by = {r["name"]: r for r in records}
    for model in REHEARSED:
        for name, _ in peers.target_names(model):
            if "memory" in name:
                assert by[name]["meshtron"] is None and "CPU" in by[name]["note"]
            else:
                assert by[name]["meshtron"] > 0, by[name]
        me = raws[model]["sides"]["meshtron"]
        assert me["ok"] and len(me["times_s"]) == 1 and len(me["losses"]) == 2
        assert me["params"] == param_count(peers.gpt_config(peers.TINY[model]))["total"]
    for model in ("dense_3b", "moe_mixtral"):  # not asked for: not measured
        assert all("not measured" in by[n]["note"] for n, _ in peers.target_names(model))


@pytest.mark.parametrize("side", ["torchtitan", "megatron"])
def test_cpu_rehearsal_runs_each_importable_peer_on_the_same_model(rehearsal, side):
    _path, records, raws = rehearsal
    why = raws[REHEARSED[0]]["sides"][side].get("error") or ""
    if "not importable" in why:  # what the rehearsal found (importing it here again costs seconds)
        pytest.skip(f"{why}: pip install --target .peers-cpu, see docs/performance.md")
    for model in REHEARSED:
        got, me = raws[model]["sides"][side], raws[model]["sides"]["meshtron"]
        assert got["ok"], got.get("error")
        assert got["params"] == me["params"]  # the same model, parameter for parameter
        assert got["tokens_per_s"] > 0 and abs(got["losses"][0] - me["losses"][0]) < 0.2  # ~ln(vocab) both
    dense = {r["name"]: r for r in records}["dense_1b tokens/s vs torchtitan (compiled)"]
    assert dense["systems"][side]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU `peers` is the real session (minutes)")
def test_gpu_session_peers_part_rehearses_on_the_cpu(tmp_path):
    env = _env(
        OUT=str(tmp_path / "out"),
        GPU_SESSION_SITE=str(tmp_path / "site"),
        GPU_SESSION_PARTS="dense_1b",
        GPU_SESSION_PEERS_ARGS="--sides meshtron",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        ["bash", "bench/gpu_session.sh", "peers"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=200
    )
    out = tmp_path / "out"
    log = (out / "log.txt").read_text()
    assert proc.returncode == 0, proc.stdout + log
    assert "no CUDA: bench/peers.py's CPU rehearsal" in log and "== dense_1b: exit 0" in log
    assert "dense_3b" not in log.split("== merge")[0]  # not asked for
    (path,) = (out / "results" / "gpu").glob("*-cpu-peers.json")
    records = json.loads(path.read_text())
    assert peers.check(records) == []
    by = {r["name"]: r for r in records}
    assert by["dense_1b MFU"]["meshtron"] > 0
    assert "not measured" in by["moe_fine MFU"]["note"]
    raw = json.loads((out / "peers_raw.json").read_text())
    assert list(raw) == ["dense_1b"] and list(raw["dense_1b"]["sides"]) == ["meshtron"]
    assert not (out / "parts").exists()  # folded into peers_raw.json (the tool returns at most 8 files)


def test_results_table_checks_peers_files_against_their_targets(tmp_path):
    """bench/results_table.py --check reads issue 37's -peers.json files with bench/peers.py's
    target list: a good file passes, a wrong name or an inconsistent `met` is reported."""
    from bench import results_table

    good = peers.merge({}, ENV)  # every target "not measured"
    (tmp_path / "2026-11-28-h100-peers.json").write_text(json.dumps(good))
    assert results_table.problems(tmp_path) == []
    bad = [dict(good[0], name="dense_1b speed"), *good[1:]]
    (tmp_path / "2026-11-28-h100-peers.json").write_text(json.dumps(bad))
    (tmp_path / "2026-11-28-h100-other.json").write_text("[]")
    found = results_table.problems(tmp_path)
    assert any("'dense_1b speed'): not a target of issue 37" in line for line in found), found
    assert any(line.startswith("2026-11-28-h100-other.json: not named") for line in found), found


def test_results_table_generates_the_peers_table_from_the_newest_gpu_file(tmp_path):
    """docs/performance.md's peers block comes from the newest -peers.json per device (a CPU
    rehearsal's file never shows), and --check catches a stale block."""
    from bench import results_table

    res = tmp_path / "gpu"
    res.mkdir()
    doc, perf, measured = tmp_path / "kernels.md", tmp_path / "performance.md", tmp_path / "measured.json"
    doc.write_text(f"{results_table.BEGIN}\n{results_table.END}\n")
    perf.write_text(f"# P\n\n{results_table.PEERS_BEGIN}\n{results_table.PEERS_END}\n\ntail\n")
    measured.write_text(results_table.MEASURED.read_text())
    args = ["--results", str(res), "--doc", str(doc), "--peers-doc", str(perf), "--measured", str(measured)]
    assert results_table.main(args) == 0 and "No GPU run has compared meshtron" in perf.read_text()
    (res / peers.results_name("2026-11-28", ENV["device"])).write_text(json.dumps(peers.merge({}, ENV)))
    cpu = dict(ENV, device="cpu", date="2026-11-29", rehearsal=True)
    (res / peers.results_name("2026-11-29", "cpu")).write_text(json.dumps(peers.merge({}, cpu)))
    assert results_table.main(["--check", *args]) == 1  # stale block (and a rehearsal file)
    results_table.main(args)
    text = perf.read_text()
    assert "**NVIDIA H100 80GB HBM3, 2026-11-28**" in text and "| dense_1b MFU |" in text and text.endswith("tail\n")
    assert "2026-11-29" not in text
