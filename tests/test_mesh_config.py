"""Layout validation (before any process group exists) and rank coordinates."""

from __future__ import annotations

import pytest

from meshtron.models.config import GPTConfig
from meshtron.mpu.mesh import ParallelConfig, ParallelConfigError, check_model_fits, virtual_mesh


@pytest.mark.parametrize("par,world,message", [
    (ParallelConfig(tp=4), 6, r"world size 6 is not divisible by tp\*pp=4"),
    (ParallelConfig(tp=2, pp=2), 6, r"world size 6 is not divisible by tp\*pp=4"),
    (ParallelConfig(tp=2, dp=3), 4, r"tp\*pp\*dp=2\*1\*3=6 does not equal world size 4; set parallel.dp=2"),
    (ParallelConfig(tp=2, ep=4, etp=2), 4, r"ep\*etp=4\*2=8 does not divide the 4 ranks"),
])
def test_bad_layouts_name_the_numbers(par, world, message):
    with pytest.raises(ParallelConfigError, match=message):
        par.resolved(world)


@pytest.mark.parametrize("par,cfg,message", [
    (ParallelConfig(tp=3), GPTConfig(num_heads=4, hidden_size=64), r"tp=3 does not divide num_heads=4"),
    (ParallelConfig(tp=4), GPTConfig(arch="llama", num_heads=8, num_kv_heads=2, hidden_size=64),
     r"tp=4 does not divide num_kv_heads=2"),
    (ParallelConfig(tp=2, sp=True), GPTConfig(seq_len=33), r"tp=2 to divide seq_len=33"),
    (ParallelConfig(ep=2), GPTConfig(), r"need an MoE model"),
    (ParallelConfig(pp=2), GPTConfig(num_layers=3), r"pp\*vpp=2\*1 does not divide num_layers=3"),
    (ParallelConfig(pp=2, stage_layers=[1, 1]), GPTConfig(num_layers=3),
     r"stage_layers=\[1, 1\] must list 2 positive layer counts .* summing to num_layers=3"),
    (ParallelConfig(vpp=2, schedule="interleaved"), GPTConfig(num_layers=4), r"parallel.vpp=2 needs pipeline parallelism"),
    (ParallelConfig(ep=3), GPTConfig(num_experts=8), r"ep=3 does not divide num_experts=8"),
    (ParallelConfig(ep=2, etp=2), GPTConfig(num_experts=4, moe_ffn_hidden_size=33, hidden_size=64),
     r"etp=2 does not divide moe_ffn_hidden_size=33"),
])
def test_model_shape_checks(par, cfg, message):
    with pytest.raises(ParallelConfigError, match=message):
        check_model_fits(par.resolved(par.tp * par.pp * par.ep * par.etp), cfg)


@pytest.mark.parametrize("kwargs,message", [
    (dict(tp=0), "parallel.tp=0 must be an integer >= 1"),
    (dict(tp=True), "parallel.tp=True must be an integer >= 1"),   # a bool is not a size
    (dict(pp=2.5), "parallel.pp=2.5 must be an integer >= 1"),
    (dict(sp="yes"), "parallel.sp='yes' must be true or false"),
    (dict(schedule="zigzag"), "parallel.schedule='zigzag' must be one of gpipe, 1f1b, interleaved"),
    (dict(stage_layers=[2, 0]), r"parallel.stage_layers=\[2, 0\]: every element must be >= 1"),
    (dict(vpp=2), "parallel.vpp=2 needs parallel.schedule=interleaved"),
])
def test_parallel_fields_are_checked_when_built(kwargs, message):
    with pytest.raises(ParallelConfigError, match=message):
        ParallelConfig(**kwargs)


def test_dp_defaults_to_world_over_tp_pp():
    assert ParallelConfig(tp=2, pp=2).resolved(16).dp == 4
    assert ParallelConfig(tp=4).resolved(8).edp == 8 // 1  # experts replicated over all 8 ranks (ep=1)
    assert ParallelConfig(tp=4, ep=8).resolved(8).edp == 1


def test_rank_coordinates_tp_fastest_and_expert_folding():
    par = ParallelConfig(tp=4, ep=8)
    coords = [(m.pp_rank, m.dp_rank, m.tp_rank, m.edp_rank, m.ep_rank, m.etp_rank)
              for m in (virtual_mesh(par, 8, r) for r in range(8))]
    assert [c[2] for c in coords] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [c[1] for c in coords] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [c[4] for c in coords] == list(range(8))
    assert all(c[3] == 0 and c[5] == 0 for c in coords)
    par = ParallelConfig(tp=2, pp=2, ep=2, etp=1)
    m = virtual_mesh(par, 8, 7)
    assert (m.pp_rank, m.dp_rank, m.tp_rank) == (1, 1, 1)
    assert (m.edp_rank, m.ep_rank, m.etp_rank) == (1, 1, 0)


def test_model_config_errors():
    with pytest.raises(ValueError, match="hidden_size=65 is not divisible by model.num_heads=4"):
        GPTConfig(hidden_size=65, num_heads=4)
    with pytest.raises(ValueError, match="model.top_k=3 must be between 1 and model.num_experts=2"):
        GPTConfig(num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="model.router_score='relu' must be softmax or sigmoid"):
        GPTConfig(num_experts=2, router_score="relu")
    with pytest.raises(ValueError, match="model.arch='bert' must be one of gpt2, llama"):
        GPTConfig(arch="bert")
    # Issue 14's values that used to reach arithmetic or torch: one message naming key and range.
    with pytest.raises(ValueError, match="model.num_heads=0 must be an integer >= 1"):
        GPTConfig(num_heads=0)
    with pytest.raises(ValueError, match="model.hidden_size=-128 must be an integer >= 1"):
        GPTConfig(hidden_size=-128)
    with pytest.raises(ValueError, match=r"model.num_layers=2.5 must be an integer >= 1"):
        GPTConfig(num_layers=2.5)
    with pytest.raises(ValueError, match=r"model.dropout=1.0 must be a finite number in \[0, 1\)"):
        GPTConfig(dropout=1.0)
    with pytest.raises(ValueError, match="model.init_std=nan must be a finite number > 0"):
        GPTConfig(init_std=float("nan"))
    assert GPTConfig(vocab_size=50257).padded_vocab_size(4) == 50688
    assert GPTConfig(vocab_size=256).padded_vocab_size(1) == 256
