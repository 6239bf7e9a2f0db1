"""bench/peer_rounds.py, the round-robin runner of dense_vs_megatron.py and moe_vs_megatron.py:
the same step statistic from both JSON formats, alternating order, per-round ratios, and the
load recorded beside every figure. Fake commands print fixed JSON (no benchmark runs)."""

import json
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
