"""mpu.mappings over a virtual mesh's groups (mpu.mesh.VirtualGroup): shape-only collectives for
tensors without data (meta), the trivial group for tensors with data."""

from __future__ import annotations

import torch

from meshtron.mpu import mappings
from meshtron.mpu.mesh import ParallelConfig, VirtualGroup, group_rank, group_size, virtual_mesh


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta", requires_grad=True)


def test_virtual_mesh_groups_carry_sizes_and_read_as_trivial():
    mesh = virtual_mesh(ParallelConfig(tp=2, pp=2, ep=4), 8, 7)
    assert (mesh.tp.size, mesh.tp.rank) == (2, 1)
    assert (mesh.dp.size, mesh.dp.rank) == (2, 1)
    assert (mesh.ep.size, mesh.ep.rank) == (4, 3)
    assert (mesh.tp_dp.size, mesh.tp_dp.rank) == (4, 3)
    assert mesh.etp is None and mesh.edp is None  # etp = 1, edp = dp * tp / ep = 1
    assert (mesh.embedding.size, mesh.embedding.rank) == (2, 1)  # the last stage's copy
    assert all(group_size(g) == 1 and group_rank(g) == 0 for g in (mesh.tp, mesh.dp, mesh.ep))


def test_shape_only_collectives_on_meta():
    group = VirtualGroup(4, 1)
    x = _meta(8, 2, 3)
    assert mappings.gather_from_sequence(x, group).shape == (32, 2, 3)
    assert mappings.reduce_scatter_to_sequence(x, group).shape == (2, 2, 3)
    assert mappings.scatter_to_sequence(x, group).shape == (2, 2, 3)
    assert mappings.gather_from_region(x, -1, group).shape == (8, 2, 12)
    assert mappings.reduce_from_region(x, group).shape == x.shape
    assert mappings.copy_to_region(x, group).shape == x.shape
    assert mappings.sequence_gathered(x[:2], x, group).shape == x.shape
    assert mappings.all_to_all(x, [3, 3, 3, 3], [2, 2, 2, 2], group).shape == (12, 2, 3)
    assert mappings.gather_rows(x, [8, 5, 8, 1], group).shape == (22, 2, 3)
    assert mappings.reduce_scatter_rows(x, [2, 3, 1, 2], group).shape == (3, 2, 3)
    received, handle = mappings.all_to_all_start([x], [1, 1, 1, 1], [2, 2, 2, 2], group)
    assert mappings.all_to_all_wait(received, handle)[0].shape == (4, 2, 3)
    assert mappings.all_gather_stats(_meta(5).detach(), group).shape == (4, 5)
    out = mappings.gather_from_sequence(x, group)
    assert out.requires_grad and out.is_meta  # part of the autograd graph, like the real collective


def test_tensors_with_data_pass_a_virtual_group_unchanged():
    group = VirtualGroup(4, 1)
    x = torch.randn(8, 2, 3)
    for y in (
        mappings.gather_from_sequence(x, group),
        mappings.reduce_scatter_to_sequence(x, group),
        mappings.scatter_to_sequence(x, group),
        mappings.gather_from_region(x, -1, group),
        mappings.reduce_from_region(x, group),
        mappings.all_to_all(x, [1], [1], group),
    ):
        assert y is x
    assert torch.equal(mappings.all_gather_stats(x, group), x.unsqueeze(0))
