"""The step-time model on shared CPU cores (issue 19): `planning.step_time.shared_core_makespan`,
the processor-sharing simulation of the 1F1B schedule, worked by hand; pp = 1 reducing to
work x processes / cores; sequence parallelism's all-gathers and reduce-scatters counted as
such; the GPU path (no shared cores) untouched. Pure arithmetic, no process group."""

from __future__ import annotations

import pytest

from meshtron.models.config import GPTConfig
from meshtron.planning.step_time import Cluster, Layout, cluster_preset, shared_core_makespan, step_time

# h 64, 4 heads, ffn 256, seq 32, vocab 256, 2 layers, gelu: per token per layer forward 106496
# FLOPs, LM head forward 32768 (tests/test_plan_search.py works them out)
TINY = dict(arch="gpt2", num_layers=2, hidden_size=64, num_heads=4, vocab_size=256, seq_len=32, dropout=0.0)
LAYER_FWD, HEAD_FWD = 106496, 32768


def cluster(gpus=4, per_node=4, peak=1e9, eff=0.5, bw=1e30, **kw) -> Cluster:
    return Cluster(gpus, per_node, 2**40, peak, bw, bw, eff, overlap=False, **kw)


ONE_EACH = (((0, 1),), ((0, 1),))  # two stages of one process each, on node 0


# --------------------------------------------------------------------------- the simulation by hand


def test_pp2_m2_dedicated_cores_by_hand():
    """Stage 0 [F0 F1 B0 B1] (forward 1 s, backward 2 s), stage 1 [F0 B0 F1 B1] (2 s, 4 s), two
    processes on two cores: F0@0 0-1; F1@0 1-2 and F0@1 1-3; B0@1 3-7; B0@0 7-9 and F1@1 7-9;
    B1@1 9-13; B1@0 13-15."""
    t = shared_core_makespan("1f1b", 2, 2, 1, (1.0, 2.0), (2.0, 4.0), 0.0, ONE_EACH, 2)
    assert t == pytest.approx(15.0, rel=1e-12)
    # the dedicated-core bound of the old model, (m + pp - 1) x the bottleneck stage: 3 x 6 s
    assert t < 18.0


def test_pp2_m2_one_shared_core_by_hand():
    """The same tasks on one core: whenever both stages can run each gets half of it (F1@0 and
    F0@1 from 1 to 3, B0@0 and F1@1 from 8 to 12), else the runnable one all of it; the core
    never idles, so the step is the whole work, 18 s."""
    t = shared_core_makespan("1f1b", 2, 2, 1, (1.0, 2.0), (2.0, 4.0), 0.0, ONE_EACH, 1)
    assert t == pytest.approx(18.0, rel=1e-12)


def test_waiting_rank_takes_its_share_by_hand():
    """wait_cpu_share 0.5 on one core: a blocked process counts half, so a lone runnable one gets
    1/1.5 of the core. F0@0 0-1.5; F1@0 and F0@1 at 1/2 until 3.5 (F0@1 1 s short); F0@1 at 2/3
    until 5; B0@1 until 11; B0@0 and F1@1 at 1/2 until 15; B1@1 at 2/3 until 21; B1@0 (stage 1
    done, waiting) at 2/3 until 24."""
    t = shared_core_makespan("1f1b", 2, 2, 1, (1.0, 2.0), (2.0, 4.0), 0.0, ONE_EACH, 1, 0.5)
    assert t == pytest.approx(24.0, rel=1e-12)


def test_tail_and_processes_per_stage():
    # two processes per stage on two cores: always >= 2 runnable, the cores never idle: total
    # work of the 4 processes (2 x 18 s + 4 x 1 s tail) over 2 cores
    two_each = (((0, 2),), ((0, 2),))
    t = shared_core_makespan("1f1b", 2, 2, 1, (1.0, 2.0), (2.0, 4.0), 1.0, two_each, 2)
    assert t == pytest.approx((2 * 18 + 4 * 1) / 2, rel=1e-12)


def test_uniform_stages_on_dedicated_cores_give_the_textbook_1f1b():
    # equal stages, forward f, backward 2f, one core each: (m + pp - 1) (f + b)
    nodes = tuple(((0, 1),) for _ in range(4))
    t = shared_core_makespan("1f1b", 4, 8, 1, (1.0,) * 4, (2.0,) * 4, 0.0, nodes, 4)
    assert t == pytest.approx((8 + 3) * 3.0, rel=1e-12)
    # interleaved, 2 chunks per rank: no worse than plain 1F1B of the same work (chunks half size)
    ti = shared_core_makespan("interleaved", 4, 8, 2, (0.5,) * 8, (1.0,) * 8, 0.0, nodes, 4)
    assert 8 * 3.0 <= ti <= t


def test_pp1_is_work_times_processes_over_cores():
    # one stage: forward 1 s + backward 2 s per microbatch, 3 microbatches, tail 0.5 s;
    # 4 processes on 2 cores each run at half speed
    t = shared_core_makespan("1f1b", 1, 3, 1, (1.0,), (2.0,), 0.5, (((0, 4),),), 2)
    assert t == pytest.approx((3 * 3.0 + 0.5) * 4 / 2, rel=1e-12)


# --------------------------------------------------------------------------- through step_time


def test_step_time_pp2_on_dedicated_and_shared_cores_by_hand():
    """pp=2, one process per stage, 2 microbatches of one sequence (32 tokens) at 0.5e9 FLOP/s:
    stage 0 forward f0 = 106496 u, stage 1 (layer + LM head) f1 = 139264 u, u = 32 / 0.5e9 s,
    backward twice the forward. Two cores: 3 f0 + 6 f1 (the timeline of the first test); one
    core: all the work, 3 (2 f0 + 2 f1)."""
    u = 32 / 0.5e9
    f0, f1 = LAYER_FWD * u, (LAYER_FWD + HEAD_FWD) * u
    lay = Layout(pp=2, dp=1, micro_batch_size=1)
    two = step_time(
        GPTConfig(**TINY),
        lay,
        cluster(gpus=2, per_node=2, cores_per_node=2),
        global_batch_size=2,
        grad_elements={"dp": 0},
    )
    assert two.microbatches == 2
    assert two.total == pytest.approx(3 * f0 + 6 * f1, rel=1e-9)
    assert two.pipeline == pytest.approx(3 * 3 * f1, rel=1e-9)  # the dedicated-core bound, reported as before
    one = step_time(
        GPTConfig(**TINY),
        lay,
        cluster(gpus=2, per_node=2, cores_per_node=1),
        global_batch_size=2,
        grad_elements={"dp": 0},
    )
    assert one.total == pytest.approx(3 * (2 * f0 + 2 * f1), rel=1e-9)


def test_step_time_pp1_shared_is_processes_over_cores_times_gpu_path():
    cfg = GPTConfig(**TINY)
    lay = Layout(dp=4, micro_batch_size=1)
    kw = dict(global_batch_size=8, grad_elements={"dp": 1000})
    gpu = step_time(cfg, lay, cluster(bw=1e6, latency_s=1e-3), **kw)
    assert gpu.total == pytest.approx(gpu.pipeline + gpu.dp_exposed + gpu.zero_exposed + gpu.optimizer)
    shared = step_time(cfg, lay, cluster(bw=1e6, latency_s=1e-3, cores_per_node=2), **kw)
    assert shared.total == pytest.approx(2 * gpu.total, rel=1e-9)
    dedicated = step_time(cfg, lay, cluster(bw=1e6, latency_s=1e-3, cores_per_node=4), **kw)
    assert dedicated.total == pytest.approx(gpu.total, rel=1e-9)


# --------------------------------------------------------------------------- sequence parallelism


def test_sp_collectives_by_hand():
    """tp=2 with SP: per layer 2 all-gathers + 2 reduce-scatters forward and the same backward,
    plus the edges (embedding: reduce-scatter forward, all-gather backward; LM head input:
    all-gather forward, reduce-scatter backward): 2 layers x 4 + 2 = 10 of each. Each moves
    (n-1)/n of the [4, 32, 64] fp32 activation (32768 bytes) and pays one latency step (the
    reduce-scatter too: shared memory on a CPU host, never gloo_latency_s). Without SP: 10
    all-reduces of 2 steps and 2 (n-1)/n of the bytes."""
    cfg = GPTConfig(**TINY)
    bytes_ = 4 * 32 * 64 * 4
    kw = dict(global_batch_size=8, grad_elements={"dp": 0})
    c = cluster(bw=1e6, latency_s=1e-3, gloo_latency_s=5e-3)
    sp = step_time(cfg, Layout(tp=2, dp=2, sp=True, micro_batch_size=4), c, **kw)
    ag = 1e-3 + 0.5 * bytes_ / 1e6
    assert sp.tp_per_microbatch == pytest.approx(20 * ag, rel=1e-12)
    tp = step_time(cfg, Layout(tp=2, dp=2, micro_batch_size=4), c, **kw)
    assert tp.tp_per_microbatch == pytest.approx(10 * (2 * 1e-3 + bytes_ / 1e6), rel=1e-12)
    # one latency for every collective's steps: the ring all-gather + reduce-scatter pair costs
    # what the all-reduce it replaces costs (GPUs: NCCL carries both)
    same = cluster(bw=1e6, latency_s=1e-3)
    assert step_time(
        cfg, Layout(tp=2, dp=2, sp=True, micro_batch_size=4), same, **kw
    ).tp_per_microbatch == pytest.approx(
        step_time(cfg, Layout(tp=2, dp=2, micro_batch_size=4), same, **kw).tp_per_microbatch
    )


def test_cpu_preset_carries_the_shared_core_constants():
    c = cluster_preset("cpu", 4, 4)
    assert c.cores_per_node > 0 and c.gloo_latency_s is not None and 0 <= c.wait_cpu_share <= 1
    assert cluster_preset("h100", 8, 8).torch_latency_s == cluster_preset("h100", 8, 8).latency_s
    with pytest.raises(ValueError, match="wait_cpu_share"):
        cluster(wait_cpu_share=1.5)
