"""bench/peer_rounds.py, the round-robin runner of dense_vs_megatron.py and moe_vs_megatron.py:
the same step statistic from both JSON formats, alternating order, per-round ratios, and the
load recorded beside every figure. Fake commands print fixed JSON (no benchmark runs)."""

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import peer_rounds  # noqa: E402


def _cmd(record: dict, log: Path, name: str) -> list[str]:
    code = f"open({str(log)!r}, 'a').write({name!r} + '\\n'); print('noise'); print({json.dumps(record)!r})"
    return [sys.executable, "-c", code]


def test_step_rates_use_the_same_statistic_for_both_formats():
    ours = {"tokens_per_step": 1000, "tokens_per_s": 999.0, "step_time_s": {"median": 0.5, "min": 0.25}}
    peer = {"tokens_per_step": 1000, "tokens_per_s": 1.0, "ms_per_step_median": 400.0, "ms_per_step_min": 200.0}
    assert peer_rounds.step_rates(ours) == (2000.0, 4000.0)
    assert peer_rounds.step_rates(peer) == (2500.0, 5000.0)  # not the peer's mean-based tokens_per_s


def test_interleaved_rounds_alternate_and_summarise(tmp_path):
    log = tmp_path / "order.txt"
    ours = {"tokens_per_step": 1000, "step_time_s": {"median": 0.5, "min": 0.4}}
    peer = {"tokens_per_step": 1000, "ms_per_step_median": 1000.0, "ms_per_step_min": 500.0}
    cmds = {"meshtron": _cmd(ours, log, "meshtron"), "peer": _cmd(peer, log, "peer")}
    out = peer_rounds.interleaved_rounds(cmds, 1, 3, baseline="meshtron")
    assert log.read_text().split() == ["meshtron", "peer", "peer", "meshtron", "meshtron", "peer"]
    assert out["tokens_per_s"] == {"meshtron": [2000.0] * 3, "peer": [1000.0] * 3}
    assert out["meshtron_over"] == {"peer": 2.0} and out["per_round_ratio"] == {"peer": [2.0] * 3}
    assert out["fastest_step_meshtron_over"] == {"peer": 1.25}
    assert all(len(v) == 3 and min(v) >= 0 for v in out["other_busy_cpus"].values())
    assert all(len(v) == 3 for v in out["loadavg_1min"].values())


def test_layout_rounds_add_variants_and_gloo_only_above_one_process(tmp_path):
    """layout_rounds runs each size's commands with the extra variants; the gloo variant (meshtron
    with MESHTRON_SHM_COLLECTIVES=0) is added only at size > 1; keys and threads follow the size."""
    log = tmp_path / "order.txt"
    ours = {"tokens_per_step": 1000, "step_time_s": {"median": 0.5, "min": 0.4}}
    peer = {"tokens_per_step": 1000, "ms_per_step_median": 1000.0, "ms_per_step_min": 500.0}

    def commands_of(size):
        return {"meshtron": _cmd(ours, log, f"meshtron{size}"), "peer": _cmd(peer, log, f"peer{size}")}

    def twice(cmds, envs):
        cmds["peer_again"] = cmds["peer"]

    out = peer_rounds.layout_rounds("ep", [1, 2], commands_of, 1, gloo=True, variants=twice)
    assert list(out) == ["ep1", "ep2"]
    assert out["ep1"]["processes_x_threads"] == "1x2" and out["ep2"]["processes_x_threads"] == "2x1"
    assert sorted(out["ep1"]["tokens_per_s"]) == ["meshtron", "peer", "peer_again"]
    assert sorted(out["ep2"]["tokens_per_s"]) == ["meshtron", "meshtron_gloo", "peer", "peer_again"]
    assert log.read_text().split().count("meshtron2") == 2  # once as itself, once on gloo


def test_failing_command_raises_with_its_stderr():
    with pytest.raises(RuntimeError, match="boom"):
        peer_rounds.run_json([sys.executable, "-c", "import sys; sys.exit('boom')"], 1)


def test_step_quantiles_interpolate_between_order_statistics():
    got = peer_rounds.step_quantiles([4.0, 1.0, 3.0, 2.0, 5.0])
    assert got == {"0.1": 1.4, "0.25": 2.0, "0.5": 3.0, "0.75": 4.0, "0.9": 4.6}
    assert peer_rounds.step_quantiles([7.0]) == {"0.1": 7.0, "0.25": 7.0, "0.5": 7.0, "0.75": 7.0, "0.9": 7.0}


def test_pooled_step_quantiles_compare_each_speed_level_with_its_own(tmp_path):
    """A bimodal host: every run mixes fast and slow steps in another proportion, so the median
    of per-round median ratios depends on the mix; the pooled quantiles inside each level give
    the true ratio (meshtron 1.25x the peer at both levels)."""
    log = tmp_path / "order.txt"
    fast, slow = 0.100, 0.130  # meshtron's step at the host's two speeds; the peer's is 1.25x longer
    mixes = [(7, 3), (3, 7), (6, 4)]  # (fast, slow) steps of meshtron's runs; the peer's are reversed
    cmds, records = {}, {"meshtron": [], "peer": []}
    for n_fast, n_slow in mixes:
        records["meshtron"].append([fast] * n_fast + [slow] * n_slow)
        records["peer"].append([fast * 1.25] * n_slow + [slow * 1.25] * n_fast)
    for name in ("meshtron", "peer"):
        runs = [
            {
                "tokens_per_step": 1000,
                "step_times_s": ts,
                "step_time_s": {"median": statistics.median(ts), "min": min(ts)},
            }
            for ts in records[name]
        ]
        # each call prints the next round's record (a counter file per system)
        counter = tmp_path / f"{name}.n"
        code = (
            f"import json, pathlib; c = pathlib.Path({str(counter)!r}); i = int(c.read_text()) if c.exists() else 0;"
            f" c.write_text(str(i + 1)); open({str(log)!r}, 'a').write({name!r} + '\\n');"
            f" print(json.dumps(json.loads({json.dumps(runs)!r})[i]))"
        )
        cmds[name] = [sys.executable, "-c", code]
    out = peer_rounds.interleaved_rounds(cmds, 1, 3, baseline="meshtron")
    assert out["per_round_ratio"]["peer"] != [1.25] * 3  # the per-round medians mix the levels
    pooled = out["pooled_step_quantiles"]
    assert pooled["steps"] == {"meshtron": 30, "peer": 30}
    assert pooled["meshtron_over"]["peer"]["0.25"] == 1.25 and pooled["meshtron_over"]["peer"]["0.75"] == 1.25
    assert pooled["tokens_per_s"]["meshtron"]["0.1"] == 10000.0


def test_no_pooled_quantiles_when_a_run_lacks_its_steps(tmp_path):
    log = tmp_path / "order.txt"
    ours = {"tokens_per_step": 1000, "step_time_s": {"median": 0.5, "min": 0.4}, "step_times_s": [0.5, 0.4]}
    peer = {"tokens_per_step": 1000, "ms_per_step_median": 1000.0, "ms_per_step_min": 500.0}
    out = peer_rounds.interleaved_rounds(
        {"meshtron": _cmd(ours, log, "m"), "peer": _cmd(peer, log, "p")}, 1, 2, baseline="meshtron"
    )
    assert "pooled_step_quantiles" not in out


def test_peer_step_times_adds_every_step_to_an_unchanged_peer(tmp_path):
    """bench/peer_step_times.py runs a peer script (with its own common.py beside it, as in
    ../shared/peers) and its JSON gains step_times_s; the peer's arguments pass through."""
    (tmp_path / "common.py").write_text(
        "def summarize(times, tokens_per_step):\n"
        "    return {'tokens_per_step': tokens_per_step, 'ms_per_step_median': sorted(times)[len(times) // 2] * 1e3}\n"
    )
    (tmp_path / "peer.py").write_text(
        "import json, os, sys\n"
        "sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\n"
        "from common import summarize\n"
        "print(json.dumps({**summarize([0.3, 0.1, 0.2], 512), 'argv': sys.argv[1:]}))\n"
    )
    import subprocess

    shim = Path(__file__).resolve().parents[1] / "bench" / "peer_step_times.py"
    out = subprocess.run(
        [sys.executable, str(shim), str(tmp_path / "peer.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    record = json.loads(out.stdout)
    assert record == {
        "tokens_per_step": 512,
        "ms_per_step_median": 200.0,
        "step_times_s": [0.3, 0.1, 0.2],
        "argv": ["--steps", "3"],
    }


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_vs_megatron_runs_both_systems_at_one_shape(ep):
    """bench/moe_vs_megatron.py: the Megatron-Core and meshtron commands of a layout name the
    same model, batch, expert and step settings (SHAPE), processes and threads."""
    import moe_vs_megatron

    def options(cmd: list[str]) -> dict[str, str]:
        flags = [i for i, a in enumerate(cmd) if a.startswith("--") and "=" not in a]
        return {cmd[i].lstrip("-").replace("-", "_"): cmd[i + 1] for i in flags}

    cmds = moe_vs_megatron.commands(ep, steps=7, warmup=2, mcore_python="peer-python")
    mcore, mine = options(cmds["megatron_core"]), options(cmds["meshtron"])
    mcore["top_k"] = mcore.pop("topk")  # Megatron-Core's script spells it --topk
    shape = {("top_k" if k == "topk" else k): str(v) for k, v in moe_vs_megatron.SHAPE.items()}
    for name, opts in (("megatron_core", mcore), ("meshtron", mine)):
        assert {k: opts[k] for k in shape} == shape, name
        assert (opts["steps"], opts["warmup"], opts["threads"], opts["ep"]) == ("7", "2", str(2 // ep), str(ep)), name
    assert cmds["megatron_core"][0] == "peer-python" and f"--nproc_per_node={ep}" in cmds["meshtron"]
    from meshtron.models.config import GPTConfig

    # throughput.py trains meshtron's default aux-loss coefficient
    assert mine["arch"] == "llama" and float(mcore["aux_loss_coeff"]) == GPTConfig().aux_loss_coef == 0.01
