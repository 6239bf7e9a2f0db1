"""The layout planner (issue 19): `planning.step_time` terms worked by hand, `planning.search`'s
enumeration listed by hand for world 4, memory exclusion by the dry-run planner, and
`python -m meshtron.plan` (exit 2 on bad input, overrides that compose into a runnable config)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron.models.config import GPTConfig
from meshtron.planning.search import enumerate_layouts, layout_memory, search
from meshtron.planning.step_time import Cluster, Layout, bubble_fraction, cluster_preset, step_time

ROOT = Path(__file__).resolve().parents[1]

# h 64, 4 heads (head dim 16), ffn 256, seq 32, vocab 256 (padded 256 at tp=1), 2 layers, gelu
TINY = dict(arch="gpt2", num_layers=2, hidden_size=64, num_heads=4, vocab_size=256, seq_len=32, dropout=0.0)


def tiny(**kw) -> GPTConfig:
    return GPTConfig(**{**TINY, **kw})


def cluster(gpus=4, per_node=4, memory=2**40, peak=1e9, eff=0.5, bw=1e6, overlap=False, **kw) -> Cluster:
    return Cluster(gpus, per_node, memory, peak, bw, bw, eff, overlap=overlap, **kw)


# --------------------------------------------------------------------------- step-time terms


def test_compute_term_by_hand():
    # Per token, per layer, forward: QKV 2*64*192 = 24576, scores and x V 4*32*64 = 8192,
    # out proj 2*64*64 = 8192, MLP 2*2*64*256 = 65536 -> 106496; 2 layers 212992; LM head
    # 2*64*256 = 32768; forward 245760, training 3x = 737280 FLOPs per token.
    # One rank, global batch 4 x seq 32 = 128 tokens: 94371840 FLOPs at 1e9 * 0.5 FLOP/s.
    t = step_time(
        tiny(), Layout(micro_batch_size=4), cluster(gpus=1, per_node=1), global_batch_size=4, grad_elements={"dp": 1000}
    )
    assert t.microbatches == 1
    assert t.compute_per_microbatch == pytest.approx(94371840 / 0.5e9, rel=1e-12)
    assert t.total == pytest.approx(94371840 / 0.5e9, rel=1e-12)  # nothing else on one rank
    assert t.tokens_per_s == pytest.approx(128 / t.total)
    assert t.mfu == pytest.approx(737280 * t.tokens_per_s / 1e9)  # = efficiency here
    assert t.mfu == pytest.approx(0.5)


def test_recompute_adds_forward_flops_by_hand():
    base = step_time(
        tiny(), Layout(micro_batch_size=4), cluster(gpus=1, per_node=1), global_batch_size=4, grad_elements={"dp": 1}
    )
    sel = step_time(
        tiny(),
        Layout(micro_batch_size=4, recompute="selective"),
        cluster(gpus=1, per_node=1),
        global_batch_size=4,
        grad_elements={"dp": 1},
    )
    full = step_time(
        tiny(),
        Layout(micro_batch_size=4, recompute="full"),
        cluster(gpus=1, per_node=1),
        global_batch_size=4,
        grad_elements={"dp": 1},
    )
    # selective: the attention core forward again, 4*s*h = 8192 per token per layer
    assert sel.compute_per_microbatch - base.compute_per_microbatch == pytest.approx(2 * 8192 * 128 / 0.5e9)
    # full: each layer's forward again, 106496 per token per layer
    assert full.compute_per_microbatch - base.compute_per_microbatch == pytest.approx(2 * 106496 * 128 / 0.5e9)


def test_tp_all_reduce_term_by_hand():
    # One all-reduce moves the [mbs=4, s=32, h=64] fp32 activation, 32768 bytes; over tp=2 a ring
    # all-reduce sends 2*(2-1)/2 * 32768 bytes at 1e6 B/s = 32.768 ms. Per microbatch: 2 forward
    # + 2 backward per layer (2 layers) + embedding + LM head input gradient = 10.
    ar = 2 * (2 - 1) / 2 * 4 * 32 * 64 * 4 / 1e6
    t = step_time(
        tiny(), Layout(tp=2, dp=2, micro_batch_size=4), cluster(), global_batch_size=8, grad_elements={"dp": 0}
    )
    assert t.tp_per_microbatch == pytest.approx(10 * ar)
    # With overlap the backward pair hides behind the weight-gradient GEMMs, a third of a layer's
    # training FLOPs on this rank: 106496*3 * 128 tokens / tp 2 / 3 at 0.5e9 FLOP/s = 13.6 ms, less
    # than the pair's 65.5 ms, so 2*ar - wgrad stays exposed.
    wgrad = 106496 * 3 * 4 * 32 / 2 / 0.5e9 / 3
    t2 = step_time(
        tiny(),
        Layout(tp=2, dp=2, micro_batch_size=4),
        cluster(overlap=True),
        global_batch_size=8,
        grad_elements={"dp": 0},
    )
    assert t2.tp_per_microbatch == pytest.approx(2 * (2 * ar + (2 * ar - wgrad)) + 2 * ar)
    # With sequence parallelism the all-gather / reduce-scatter pairs move the same bytes (and,
    # at latency 0, cost the same; tests/test_step_time_shared_cores.py counts their latencies)
    t3 = step_time(
        tiny(), Layout(tp=2, dp=2, sp=True, micro_batch_size=4), cluster(), global_batch_size=8, grad_elements={"dp": 0}
    )
    assert t3.tp_per_microbatch == pytest.approx(t.tp_per_microbatch)


def test_dp_all_reduce_and_latency_by_hand():
    # 1000 fp32 gradients over dp=4: 2*3/4 * 4000 bytes / 1e6 B/s + 2*3 ring steps of 1 ms, no overlap
    t = step_time(
        tiny(),
        Layout(dp=4, micro_batch_size=1),
        cluster(latency_s=1e-3),
        global_batch_size=4,
        grad_elements={"dp": 1000},
    )
    assert t.dp_exposed == pytest.approx(2 * 3 / 4 * 4000 / 1e6 + 6e-3)
    assert t.zero_exposed == 0
    z1 = step_time(
        tiny(),
        Layout(dp=4, zero=1, micro_batch_size=1),
        cluster(latency_s=1e-3),
        global_batch_size=4,
        grad_elements={"dp": 1000},
    )
    assert z1.zero_exposed == pytest.approx(3 / 4 * 4000 / 1e6 + 3e-3)  # the updated weights' all-gather


def test_bubble_fraction_by_hand():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)  # (pp-1)/(m+pp-1)
    assert bubble_fraction(4, 8, vpp=2) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 5) == 0
    c = cluster(bw=1e30)  # communication free: the pipeline term is (m + pp - 1) microbatch times
    t = step_time(tiny(), Layout(pp=2, dp=2, micro_batch_size=1), c, global_batch_size=8, grad_elements={"dp": 0})
    assert t.microbatches == 4 and t.bubble_fraction == pytest.approx(1 / 5)
    assert t.pipeline == pytest.approx((4 + 1) * t.compute_per_microbatch, rel=1e-9)


def test_shared_cores_bound_by_hand():
    """4 processes on 2 cores: the step is the node's CPU work over its cores, and when each
    pipeline stage has as many processes as there are cores, the bubble costs nothing there
    (the idle stage's cores run the other stage; tests/test_step_time_shared_cores.py works
    the processor-sharing simulation by hand where it does cost)."""
    free = dict(bw=1e30)
    dedicated = step_time(
        tiny(), Layout(dp=4, micro_batch_size=1), cluster(**free), global_batch_size=4, grad_elements={"dp": 0}
    )
    shared = step_time(
        tiny(),
        Layout(dp=4, micro_batch_size=1),
        cluster(cores_per_node=2, **free),
        global_batch_size=4,
        grad_elements={"dp": 0},
    )
    assert shared.total == pytest.approx(2 * dedicated.total)
    assert shared.mfu == pytest.approx(dedicated.mfu)  # over the 2 cores, not the 4 processes
    # pp=2 x dp=2, 2 microbatches of 32 tokens: the last stage's microbatch is 1 layer + head,
    # (106496 + 32768) * 3 * 32 FLOPs; the bubble (one microbatch time) is not work, and the head's
    # work averages over the 2 stages: busy = 2 * (106496 + 32768/2) * 3 * 32 / 0.5e9
    pipe = step_time(
        tiny(),
        Layout(pp=2, dp=2, micro_batch_size=1),
        cluster(cores_per_node=2, **free),
        global_batch_size=4,
        grad_elements={"dp": 0},
    )
    per_mb = (106496 + 32768) * 3 * 32 / 0.5e9
    busy = 2 * (106496 + 32768 / 2) * 3 * 32 / 0.5e9
    assert pipe.pipeline == pytest.approx(3 * per_mb, rel=1e-9)
    assert pipe.total == pytest.approx(max(3 * per_mb, 2 * busy), rel=1e-9)


def test_presets_and_bad_cluster():
    h100 = cluster_preset("h100", 64, 8, precision="bf16")
    assert h100.peak_flops == pytest.approx(989.4e12) and h100.gpu_memory_bytes == 80 * 2**30
    assert cluster_preset("a100", 8, 8, precision="bf16").peak_flops == pytest.approx(312e12)
    assert cluster_preset("cpu", 4, 4).device == "cpu"
    with pytest.raises(ValueError, match="unknown --gpu 'tpu'"):
        cluster_preset("tpu", 8, 8)
    with pytest.raises(ValueError, match="not divisible by --gpus-per-node"):
        cluster_preset("h100", 12, 8)


# --------------------------------------------------------------------------- enumeration


def test_enumeration_world4_by_hand():
    """Tiny model with 2 heads and 2 layers at world 4, zero/recompute/micro batch pinned: tp in
    {1, 2} (heads), pp in {1, 2} (layers), cp with seq 32 divisible by 2*cp (*tp under SP); a2a
    needs the heads of a tp rank divisible by cp; sp on and off at tp=2."""
    cfg = tiny(num_heads=2)
    got = enumerate_layouts(
        cfg, 4, global_batch_size=4, gpus_per_node=4, fixed={"zero": 0, "recompute": "none", "micro_batch_size": 1}
    )
    key = {(lay.tp, lay.cp, lay.pp, lay.dp, lay.cp_comm, lay.sp, lay.vpp) for lay in got}
    expected = {
        (1, 1, 1, 4, "ring", False, 1),
        (1, 1, 2, 2, "ring", False, 1),
        (1, 2, 1, 2, "ring", False, 1),
        (1, 2, 1, 2, "a2a", False, 1),
        (1, 2, 2, 1, "ring", False, 1),
        (1, 2, 2, 1, "a2a", False, 1),
        (1, 4, 1, 1, "ring", False, 1),
        (2, 1, 1, 2, "ring", True, 1),
        (2, 1, 2, 1, "ring", True, 1),
        (2, 2, 1, 1, "ring", True, 1),
        (2, 1, 1, 2, "ring", False, 1),
        (2, 1, 2, 1, "ring", False, 1),
        (2, 2, 1, 1, "ring", False, 1),
    }
    assert key == expected and len(got) == len(expected)


def test_enumeration_zero_recompute_micro_batches():
    cfg = tiny()
    got = enumerate_layouts(cfg, 2, global_batch_size=4, gpus_per_node=2, fixed={"tp": 1, "cp": 1, "pp": 1})
    # dp=2: micro batch 1 or 2 of the per-rank 2, zero 0..3, recompute none|selective|full
    assert len(got) == 2 * 4 * 3
    single = enumerate_layouts(cfg, 1, global_batch_size=4, gpus_per_node=1)
    assert {lay.zero for lay in single} == {0}  # ZeRO shards nothing on one rank
    assert {lay.micro_batch_size for lay in single} == {1, 2, 4}


def test_a_pinned_size_that_does_not_divide_the_world_yields_no_layout():
    cfg = tiny()
    assert enumerate_layouts(cfg, 4, global_batch_size=4, gpus_per_node=4, fixed={"pp": 3}) == []
    assert enumerate_layouts(cfg, 4, global_batch_size=4, gpus_per_node=4, fixed={"tp": 2, "cp": 4}) == []


def test_sp_on_and_off_ranked_by_their_cost():
    """tp=2 x dp=2 with and without SP are both candidates, ranked by their own cost. On both
    presets (GPU ring; CPU, where SP's collectives go through shared memory like TP's
    all-reduces) the TP terms are equal; SP holds fewer activation bytes but adds a tp x dp
    gradient bucket for the norm weights, one more all-reduce latency, which at this tiny
    size decides for plain TP."""
    cfg = tiny(num_heads=2)
    fixed = {"tp": 2, "pp": 1, "cp": 1, "zero": 0, "recompute": "none", "micro_batch_size": 2}
    for preset in ("cpu", "h100"):
        got = search(cfg, cluster_preset(preset, 4, 4, precision="fp32"), global_batch_size=4, fixed=fixed)
        assert [c.layout.sp for c in got.ranked] == [False, True], preset
        plain, sp = got.ranked
        assert sp.time.tp_per_microbatch == pytest.approx(plain.time.tp_per_microbatch, rel=1e-12), preset
        assert sp.memory_bytes < plain.memory_bytes
        assert sp.time.dp_exposed > plain.time.dp_exposed
        assert plain.tokens_per_s > sp.tokens_per_s


# --------------------------------------------------------------------------- memory


def test_layouts_that_do_not_fit_are_excluded():
    cfg = tiny(num_heads=2)
    fixed = {"recompute": "none", "micro_batch_size": 1, "cp": 1}
    every = search(cfg, cluster(), global_batch_size=4, fixed=fixed, limit=None)
    sizes = sorted(c.memory_bytes for c in every.ranked)
    assert every.too_big == 0 and len(sizes) == every.priced
    for cand in every.ranked:  # the planner's own figure
        assert cand.memory_bytes == layout_memory(cfg, cand.layout, global_batch_size=4, device="cuda")["bytes"]
    limit = sizes[len(sizes) // 2]
    some = search(cfg, cluster(memory=limit), global_batch_size=4, fixed=fixed, limit=None)
    assert some.ranked and all(c.memory_bytes <= limit for c in some.ranked)
    assert some.too_big == sum(s > limit for s in sizes) > 0
    assert len(some.ranked) + some.too_big == len(every.ranked)
    speeds = [c.tokens_per_s for c in some.ranked]
    assert speeds == sorted(speeds, reverse=True)


def test_search_prices_the_lm_loss_the_run_uses():
    """trainer.fused_lm_loss reaches the memory figure: whole logits of a large vocabulary cost
    more than the fused chunks, and each search's figures are the planner's for that mode."""
    # 8,192 tokens x 32,000: 1 GiB of fp32 logits unfused; fused, chunks of 4,194 rows on CUDA.
    cfg = tiny(num_heads=2, vocab_size=32000, seq_len=8192)
    fixed = {"recompute": "none", "micro_batch_size": 1, "cp": 1, "tp": 1, "pp": 1}
    by_mode = {}
    for fused in (True, False):
        result = search(cfg, cluster(), global_batch_size=4, fixed=fixed, limit=None, fused_lm_loss=fused)
        by_mode[fused] = {c.layout: c.memory_bytes for c in result.ranked}
        for cand in result.ranked:
            assert (
                cand.memory_bytes
                == layout_memory(cfg, cand.layout, global_batch_size=4, device="cuda", fused_lm_loss=fused)["bytes"]
            )
    assert by_mode[True] and by_mode[True].keys() == by_mode[False].keys()
    assert all(by_mode[True][lay] < by_mode[False][lay] for lay in by_mode[True])


# --------------------------------------------------------------------------- CLI


def _cli(argv, capsys):
    from meshtron.training.plan_cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gpus", "8", "--gpu", "tpu"], "unknown --gpu 'tpu'"),
        (["--gpus", "12", "--gpus-per-node", "8"], "--gpus 12 is not divisible by --gpus-per-node 8"),
        (["--gpus", "8", "--gpu-memory", "lots"], "--gpu-memory 'lots' is not a size"),
        (["--gpus", "8", "parallel.tpp=2"], "unknown key parallel.tpp"),
        (["--gpus", "8", "+model=gpt_9b"], "unknown model option 'gpt_9b'"),
        (["--gpus", "eight"], "invalid int value"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, message, capsys):
    code, out, err = _cli(argv, capsys)
    assert code == 2 and message in err and err.count("\n") == 1 and err.startswith("meshtron.plan: ")


TINY_OVERRIDES = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=2",
    "model.seq_len=32",
    "trainer.global_batch_size=8",
]


def test_cli_overrides_compose_into_a_runnable_config(capsys, tmp_path):
    """Every printed line's overrides, pasted after the same command-line overrides, compose
    (Hydra, as train.py) into a config the run's checks accept at that world size."""
    from meshtron.training.plan_cli import compose_run
    from meshtron.training.run_checks import check_run_config

    out_json = tmp_path / "plan.json"
    code, out, _ = _cli(
        [
            "--gpus",
            "4",
            "--gpus-per-node",
            "4",
            "--gpu",
            "cpu",
            "--json",
            str(out_json),
            "--json-max",
            "12",
            *TINY_OVERRIDES,
        ],
        capsys,
    )
    assert code == 0
    rows = [line for line in out.splitlines() if "parallel.tp=" in line]
    assert len(rows) == 10
    data = json.loads(out_json.read_text())
    assert len(data["candidates"]) == 12
    assert [c["overrides"] for c in data["candidates"][:10]] == [r.split("  ")[-1].strip() for r in rows]
    speeds = [c["tokens_per_s"] for c in data["candidates"]]
    assert speeds == sorted(speeds, reverse=True)
    for cand in data["candidates"][:10]:
        run = compose_run(TINY_OVERRIDES + cand["overrides"].split())
        lay = cand["layout"]
        assert (run.parallel.tp, run.parallel.pp, run.parallel.cp, run.optim.zero, run.trainer.micro_batch_size) == (
            lay["tp"],
            lay["pp"],
            lay["cp"],
            lay["zero"],
            lay["micro_batch_size"],
        )
        par, micro, _ = check_run_config(run, 4)
        assert (par.dp, par.cp_comm, par.sp, micro) == (lay["dp"], lay["cp_comm"], lay["sp"], lay["micro_batch_size"])


def test_cli_pins_fields_given_on_the_command_line(capsys):
    code, out, _ = _cli(
        [
            "--gpus",
            "4",
            "--gpus-per-node",
            "4",
            "--gpu",
            "cpu",
            "--top",
            "3",
            *TINY_OVERRIDES,
            "parallel.tp=2",
            "optim.zero=1",
        ],
        capsys,
    )
    rows = [line for line in out.splitlines() if "parallel.tp=" in line]
    assert code == 0 and len(rows) == 3
    assert all("parallel.tp=2 " in r and "optim.zero=1 " in r for r in rows)


def test_python_dash_m_meshtron_plan(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtron.plan",
            "--gpus",
            "2",
            "--gpus-per-node",
            "2",
            "--gpu",
            "cpu",
            "--top",
            "2",
            *TINY_OVERRIDES,
            "parallel.pp=1",
            "parallel.cp=1",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if "parallel.tp=" in line]
    assert len(rows) == 2 and "tokens/s" in out.stdout
