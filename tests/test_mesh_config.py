"""Layout validation (before any process group exists) and rank coordinates."""

from __future__ import annotations

import pytest

from meshtron.errors import ConfigError
from meshtron.models.config import GPTConfig
from meshtron.models.fits import check_model_fits
from meshtron.mpu.mesh import (
    Mesh,
    ParallelConfig,
    ParallelConfigError,
    dim_groups,
    placement,
    placement_warnings,
    virtual_mesh,
)
from meshtron.training.distributed import check_nodes


@pytest.mark.parametrize(
    "par,world,message",
    [
        (ParallelConfig(tp=4), 6, r"world size 6 is not divisible by tp\*pp=4"),
        (ParallelConfig(tp=2, pp=2), 6, r"world size 6 is not divisible by tp\*pp=4"),
        (ParallelConfig(tp=2, dp=3), 4, r"tp\*pp\*dp=2\*1\*3=6 does not equal world size 4; set parallel.dp=2"),
        (ParallelConfig(tp=2, ep=4, etp=2), 4, r"ep\*etp=4\*2=8 does not divide the 4 ranks"),
    ],
)
def test_bad_layouts_name_the_numbers(par, world, message):
    with pytest.raises(ParallelConfigError, match=message):
        par.resolved(world)


@pytest.mark.parametrize(
    "par,cfg,message",
    [
        (ParallelConfig(tp=3), GPTConfig(num_heads=4, hidden_size=64), r"tp=3 does not divide num_heads=4"),
        (
            ParallelConfig(tp=4),
            GPTConfig(arch="llama", num_heads=8, num_kv_heads=2, hidden_size=64),
            r"tp=4 does not divide num_kv_heads=2",
        ),
        (ParallelConfig(tp=2, sp=True), GPTConfig(seq_len=33), r"tp=2 to divide seq_len=33"),
        (ParallelConfig(ep=2), GPTConfig(), r"need an MoE model"),
        (ParallelConfig(pp=2), GPTConfig(num_layers=3), r"pp\*vpp=2\*1 does not divide num_layers=3"),
        (
            ParallelConfig(pp=2, stage_layers=[1, 1]),
            GPTConfig(num_layers=3),
            r"stage_layers=\[1, 1\] must list 2 positive layer counts .* summing to num_layers=3",
        ),
        (
            ParallelConfig(vpp=2, schedule="interleaved"),
            GPTConfig(num_layers=4),
            r"parallel.vpp=2 needs pipeline parallelism",
        ),
        (ParallelConfig(ep=3), GPTConfig(num_experts=8), r"ep=3 does not divide num_experts=8"),
        (
            ParallelConfig(ep=2, etp=2),
            GPTConfig(num_experts=4, moe_ffn_hidden_size=33, hidden_size=64),
            r"etp=2 does not divide moe_ffn_hidden_size=33",
        ),
    ],
)
def test_model_shape_checks(par, cfg, message):
    with pytest.raises(ParallelConfigError, match=message):
        check_model_fits(par.resolved(par.tp * par.pp * par.ep * par.etp), cfg)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(tp=0), "parallel.tp=0 must be an integer >= 1"),
        (dict(tp=True), "parallel.tp=True must be an integer >= 1"),  # a bool is not a size
        (dict(pp=2.5), "parallel.pp=2.5 must be an integer >= 1"),
        (dict(sp="yes"), "parallel.sp='yes' must be true or false"),
        (dict(schedule="zigzag"), "parallel.schedule='zigzag' must be one of gpipe, 1f1b, interleaved"),
        (dict(stage_layers=[2, 0]), r"parallel.stage_layers=\[2, 0\]: every element must be >= 1"),
        (dict(vpp=2), "parallel.vpp=2 needs parallel.schedule=interleaved"),
    ],
)
def test_parallel_fields_are_checked_when_built(kwargs, message):
    with pytest.raises(ParallelConfigError, match=message):
        ParallelConfig(**kwargs)


def test_dp_defaults_to_world_over_tp_pp():
    assert ParallelConfig(tp=2, pp=2).resolved(16).dp == 4
    assert ParallelConfig(tp=4).resolved(8).edp == 8 // 1  # experts replicated over all 8 ranks (ep=1)
    assert ParallelConfig(tp=4, ep=8).resolved(8).edp == 1


def test_rank_coordinates_tp_fastest_and_expert_folding():
    par = ParallelConfig(tp=4, ep=8)
    coords = [
        (m.pp_rank, m.dp_rank, m.tp_rank, m.edp_rank, m.ep_rank, m.etp_rank)
        for m in (virtual_mesh(par, 8, r) for r in range(8))
    ]
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


# ------------------------------------------------------------------ placement over nodes


def test_dim_groups_are_the_device_mesh_rank_lists():
    groups = dim_groups(ParallelConfig(tp=2, pp=2, ep=2).resolved(8), 8)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["etp"] == [[r] for r in range(8)]
    groups = dim_groups(ParallelConfig(tp=1, ep=4, etp=2).resolved(8), 8)
    assert groups["ep"] == [[0, 2, 4, 6], [1, 3, 5, 7]] and groups["etp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize(
    "par,world,per_node,expected,warnings",
    [
        # one node: nothing spans
        (ParallelConfig(tp=2), 4, 4, "placement 1 node x 4 ranks (every group intra-node)", []),
        (
            ParallelConfig(tp=2),
            8,
            4,
            "placement 2 nodes x 4 ranks: tp=2 (intra-node) dp=4 (spans 2 nodes) pp=1 | edp=8 (spans 2 nodes) ep=1 etp=1",
            [],
        ),
        (
            ParallelConfig(tp=8),
            8,
            4,
            "placement 2 nodes x 4 ranks: tp=8 (spans 2 nodes) dp=1 pp=1 | edp=8 (spans 2 nodes) ep=1 etp=1",
            ["parallel.tp=8 spans 2 nodes of 4 ranks: TP all-reduces cross the inter-node link; use tp <= 4"],
        ),
        # tp=3 over nodes of 4: groups [0,1,2] and [9,10,11] stay inside, [3,4,5] and [6,7,8] cross
        (
            ParallelConfig(tp=3),
            12,
            4,
            "placement 3 nodes x 4 ranks: tp=3 (2 of 4 groups span 2 nodes) dp=4 (spans 3 nodes) pp=1 | "
            "edp=12 (spans 3 nodes) ep=1 etp=1",
            [
                "parallel.tp=3 has 2 of 4 groups spanning 2 nodes of 4 ranks: TP all-reduces cross the inter-node link; "
                "use a tp that divides 4"
            ],
        ),
        (
            ParallelConfig(tp=2, pp=2),
            8,
            2,
            "placement 4 nodes x 2 ranks: tp=2 (intra-node) dp=2 (spans 2 nodes) pp=2 (spans 2 nodes) | "
            "edp=4 (spans 2 nodes) ep=1 etp=1",
            [],
        ),
        # the card's layout on two 4-GPU nodes: tp inside a node, ep=8 across both (warned, allowed)
        (
            ParallelConfig(tp=4, ep=8),
            8,
            4,
            "placement 2 nodes x 4 ranks: tp=4 (intra-node) dp=2 (spans 2 nodes) pp=1 | edp=1 ep=8 (spans 2 nodes) etp=1",
            [
                "parallel.ep=8 spans 2 nodes of 4 ranks: expert all-to-alls cross the inter-node link "
                "(allowed; common when experts need many ranks)"
            ],
        ),
        (
            ParallelConfig(tp=2, ep=2),
            8,
            4,
            "placement 2 nodes x 4 ranks: tp=2 (intra-node) dp=4 (spans 2 nodes) pp=1 | "
            "edp=4 (spans 2 nodes) ep=2 (intra-node) etp=1",
            [],
        ),
        (
            ParallelConfig(ep=2, etp=4),
            8,
            2,
            "placement 4 nodes x 2 ranks: tp=1 dp=8 (spans 4 nodes) pp=1 | edp=1 ep=2 (spans 2 nodes) etp=4 (spans 2 nodes)",
            [
                "parallel.ep=2 spans 2 nodes of 2 ranks: expert all-to-alls cross the inter-node link "
                "(allowed; common when experts need many ranks)",
                "parallel.etp=4 spans 2 nodes of 2 ranks: expert TP all-reduces cross the inter-node link; use etp <= 2",
            ],
        ),
        # the multi-node test's layout: 2 agents x 1 rank, tp=2
        (
            ParallelConfig(tp=2),
            2,
            1,
            "placement 2 nodes x 1 rank: tp=2 (spans 2 nodes) dp=1 pp=1 | edp=2 (spans 2 nodes) ep=1 etp=1",
            ["parallel.tp=2 spans 2 nodes of 1 rank: TP all-reduces cross the inter-node link; use tp <= 1"],
        ),
    ],
)
def test_placement_over_nodes(par, world, per_node, expected, warnings):
    resolved = par.resolved(world)
    for rank in (0, world - 1):  # the same on every rank
        mesh = Mesh(resolved, world, rank, create_groups=False, ranks_per_node=per_node)
        assert mesh.describe_placement() == expected
        assert mesh.describe().endswith("; " + expected)
        assert mesh.placement_warnings() == warnings
        assert (mesh.num_nodes, mesh.node) == (world // per_node, rank // per_node)
    assert placement_warnings(resolved, world, per_node) == warnings


def test_placement_counts_spanning_groups_exactly():
    where = placement(ParallelConfig(tp=3).resolved(12), 12, 4)
    assert (where["tp"].groups, where["tp"].spanning, where["tp"].max_nodes) == (4, 2, 2)
    assert (where["dp"].groups, where["dp"].spanning, where["dp"].max_nodes) == (3, 3, 3)
    assert where["pp"].intra_node and where["etp"].intra_node
    with pytest.raises(ParallelConfigError, match="3 ranks per node do not divide world size 8"):
        placement(ParallelConfig().resolved(8), 8, 3)


def test_single_node_mesh_is_unchanged_by_placement():
    mesh = virtual_mesh(ParallelConfig(tp=2), 4, 3)
    assert (mesh.ranks_per_node, mesh.num_nodes, mesh.node) == (4, 1, 0)
    assert (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank) == (0, 1, 1)
    assert mesh.placement_warnings() == []


def test_check_nodes_accepts_torchrun_assignment_and_names_bad_ones():
    assert check_nodes([("0", 0, 2), ("0", 1, 2), ("1", 0, 2), ("1", 1, 2)]) == 2
    assert check_nodes([("host", r, 4) for r in range(4)]) == 1
    # --nproc_per_node=2 on one agent and 1 on the other
    with pytest.raises(
        ConfigError,
        match=r"nodes run different numbers of ranks \(node 0: 2, node 1: 1\); .*"
        "start every node with the same --nproc_per_node",
    ):
        check_nodes([("0", 0, 2), ("0", 1, 2), ("1", 0, 1)])
    # interleaved ranks (not torchrun's assignment): node != rank // LOCAL_WORLD_SIZE
    with pytest.raises(ConfigError, match="rank 1 is local rank 0 of node b, not local rank 1 of node a"):
        check_nodes([("a", 0, 2), ("b", 0, 2), ("a", 1, 2), ("b", 1, 2)])
    # two blocks of consecutive ranks on each node: 4 ranks on a node of LOCAL_WORLD_SIZE=2
    with pytest.raises(ConfigError, match=r"ranks per node \(node a: 4, node b: 4\) differ from LOCAL_WORLD_SIZE=2"):
        check_nodes([("a", 0, 2), ("a", 1, 2), ("b", 0, 2), ("b", 1, 2)] * 2)
