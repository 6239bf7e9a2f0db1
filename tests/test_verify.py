"""The numerics verifier (`python -m meshtron.verify`, training/verify.py): PASS on correct
layouts of shrunk dense and MoE models, FAIL naming an injected fault's parameter (exit 1),
one configuration-error line (exit 2); and, in process, the shrink rules and the check order."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtron.models.config import GPTConfig
from meshtron.models.fits import check_model_fits
from meshtron.mpu.mesh import ParallelConfig
from meshtron.training.verify import compare, layout_world, main, shrink_model

ROOT = Path(__file__).resolve().parents[1]


def verify(*args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "meshtron.verify", *args, "--timeout", str(timeout - 30)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def loss_rows(stdout: str) -> list[list[str]]:
    """The per-step rows of the loss table: step, serial loss, parallel loss, |diff|, tensors, worst rel."""
    return [line.split() for line in stdout.splitlines() if line.strip()[:1].isdigit()]


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "overrides, world",
    [
        (["parallel.tp=2"], 2),  # GPT-2, TP with a padded vocabulary
        (["parallel.pp=2", "parallel.schedule=1f1b"], 2),  # GPT-2, two pipeline stages
        (["+model=moe_tiny", "parallel.ep=2"], 2),  # Llama MoE (GQA, shared expert): dp=2, ep=2
        (
            [
                "parallel.cp=2",
                "model.arch=llama",
                "model.num_kv_heads=2",  # ring attention over packed documents
                "data.reset_at_eos=true",
                "data.eos_id=3",
                "+model.mtp_depths=2",  # the depths' shifted ids and labels cut from full sequences
            ],
            2,
        ),
    ],
)
def test_correct_layouts_pass(overrides, world):
    out = verify(*overrides, "--steps", "2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"on {world} gloo processes vs 1 serial process" in out.stdout
    rows = loss_rows(out.stdout)
    assert [r[0] for r in rows] == ["1", "2"], out.stdout
    for row in rows:
        assert abs(float(row[1]) - float(row[2])) < 1e-5 and int(row[4]) > 0 and float(row[5]) < 1e-5
    assert "PASS:" in out.stdout.splitlines()[-1]


# DeepSeek-V3's features on moe_tiny by overrides: latent attention (q latent, v wider than
# nope), 64 experts top-8 in 4 of 8 groups (shrunk to 16), sigmoid scores scaled by 2.5, the
# aux-free bias, a shared expert, the first layer dense, two MTP depths.
DEEPSEEK_OVERRIDES = [
    "+model=moe_tiny",
    "model.num_kv_heads=4",
    "+model.attention=mla",
    "+model.q_lora_rank=24",
    "+model.kv_lora_rank=16",
    "+model.qk_nope_head_dim=8",
    "+model.qk_rope_head_dim=4",
    "+model.v_head_dim=12",
    "model.num_experts=64",
    "model.top_k=8",
    "model.moe_every=1",
    "+model.moe_first_dense=1",
    "model.router_score=sigmoid",
    "model.router_groups=8",
    "model.router_topk_groups=4",
    "+model.router_scaling_factor=2.5",
    "model.router_bias_update_rate=0.001",
    "model.aux_loss_scope=sequence",
    "+model.mtp_depths=2",
]


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "overrides, kept",
    [
        (
            [*DEEPSEEK_OVERRIDES, "parallel.tp=2", "parallel.ep=2"],
            ["mla (q_lora_rank=8", "v=12", "experts=16 top_k=8", "layers DE", "groups=8 topk_groups=4", "mtp_depths=2"],
        ),
        (
            [
                "+model=qwen3_tiny",
                "+model.rope_scaling={rope_type:yarn,factor:4.0,original_max_position_embeddings:32}",
                "parallel.tp=2",
                "parallel.sp=true",
            ],
            ["kv_channels=16 (hidden/heads=8) qk_norm", "(bands: kept, mixed, scaled)"],
        ),
    ],
    ids=["mla-deepseek-routing-mtp-tp2-ep2", "qwen3-yarn-tp2-sp"],
)
def test_model_families_pass(overrides, kept):
    """The shrunk model keeps the family's features (printed) and the layout equals one process,
    MTP losses and depths' activations included (one step: the features, not the trajectory)."""
    out = verify(*overrides, "--steps", "1", timeout=100)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    shrunk = next(line for line in out.stdout.splitlines() if line.startswith("shrunk model: "))
    for feature in kept:
        assert feature in shrunk, shrunk
    assert "PASS:" in out.stdout.splitlines()[-1]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_injected_fault_is_named():
    """Norm weights' gradients summed over the wrong group (tp instead of their data replicas):
    the forward and the loss of step 1 still match, the first departure is the last norm weight's
    gradient (gradients are checked in reverse order, as backward produces them), exit 1."""
    out = verify("parallel.tp=2", "--steps", "1", "--inject-fault", "grad-group")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    fail = next(line for line in out.stdout.splitlines() if line.startswith("FAIL:"))
    assert fail.startswith("FAIL: first departure at step 1: gradient of final_norm.weight on rank 0: "), fail
    assert "relative diff 1.000e+00" in fail  # doubled: summed over two tp ranks holding the same value
    (row,) = loss_rows(out.stdout)
    assert float(row[3]) == 0.0  # the loss itself is untouched in the step the fault happens


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.tp=3"], "tp=3 does not divide num_heads=4"),
        (["parallel.tpp=2"], "unknown key parallel.tpp; did you mean parallel.tp?"),
        (["parallel.tp=2", "--bogus"], "unknown option --bogus"),
    ],
)
def test_bad_config_is_one_line(overrides, message, capsys):
    """In process (the CLI's `main`): nothing starts, one line on stderr, exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(overrides)
    out = capsys.readouterr()
    assert exit_info.value.code == 2, out.out + out.err
    assert out.out == ""
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshtron verify: configuration error: ") and message in lines[0]


def test_shrink_keeps_structure():
    """gpt_1b-like MoE at tp=4, pp=2 with uneven stages, and a2a context parallelism."""
    big = GPTConfig(
        arch="llama",
        num_layers=16,
        hidden_size=2048,
        num_heads=16,
        num_kv_heads=8,
        ffn_hidden_size=5632,
        vocab_size=50257,
        seq_len=2048,
        num_experts=8,
        top_k=2,
        moe_every=2,
        moe_ffn_hidden_size=2816,
        shared_experts=1,
        tie_embeddings=False,
    )
    par = ParallelConfig(tp=4, pp=2, ep=2, sp=True, stage_layers=[4, 12]).resolved(8)
    small, small_par = shrink_model(big, par)
    check_model_fits(small_par, small)
    assert small_par.stage_layers == [1, 3] and small.num_layers == 4
    assert small.num_heads // small.num_kv_heads == 2 and small.num_kv_heads % 4 == 0
    assert (small.arch, small.norm, small.activation, small.position, small.bias) == (
        "llama",
        "rmsnorm",
        "swiglu",
        "rope",
        False,
    )
    assert (small.num_experts, small.top_k, small.moe_every, small.shared_experts) == (8, 2, 2, 1)
    assert small.vocab_size % (128 * 4) and small.padded_vocab_size(4) > small.vocab_size
    assert small.seq_len % 4 == 0 and small.hidden_size <= 128 and small.dropout == 0.0
    a2a = ParallelConfig(tp=2, cp=4, cp_comm="a2a").resolved(8)
    small, small_par = shrink_model(GPTConfig(num_heads=4, hidden_size=128), a2a)
    check_model_fits(small_par, small)
    assert (small.num_heads // 2) % 4 == 0 and small.seq_len % 8 == 0
    assert layout_world(ParallelConfig(tp=1, ep=4)) == 4 and layout_world(ParallelConfig(tp=2, pp=2, dp=2)) == 8


def test_compare_orders_checks():
    """Forward activations before the loss, gradients in reverse parameter order, a missing
    tensor reported, rows of a global-scope microbatch compared against the serial slice."""
    t = torch.ones(4, 2, 3)
    serial = [
        (("act", 0, "embed", 0), None, t),
        (("act", 0, "layers.0", 0), None, t),
        (("loss", 0, "loss"), None, torch.ones(1)),
        (("grad", 0, "a"), None, t),
        (("grad", 0, "b"), None, t),
        (("weight", 0, "a"), None, t),
    ]
    good = {0: [(key, None, tensor.clone()) for key, _, tensor in serial]}
    assert compare(serial, good, 1e-5, 0.0)[0] == []
    bad = {0: [(key, None, tensor * (1.5 if key[2] in ("a", "b", "layers.0") else 1.0)) for key, _, tensor in serial]}
    departures, _ = compare(serial, bad, 1e-5, 0.0)
    assert [(d.what, d.name) for d in departures] == [
        ("act", "layers.0 (microbatch 0)"),
        ("grad", "b"),
        ("grad", "a"),
        ("weight", "a"),
    ]
    assert math.isclose(departures[0].rel, 0.5)
    departures, _ = compare(serial, {0: good[0][1:]}, 1e-5, 0.0)
    assert departures[0].note == "produced by no rank of the layout"
    rows = {0: [(("act", 0, "embed", 0), (0, 1), t[:, :1]), (("act", 0, "embed", 0), (1, 2), t[:, 1:] * 2)]}
    departures, _ = compare(serial[:1], rows, 1e-5, 0.0)
    assert [(d.rank, d.what) for d in departures] == [(0, "act")] and math.isclose(departures[0].max_abs, 1.0)
