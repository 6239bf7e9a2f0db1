"""Initialization in proportion to the shard (mpu/init.py): a parameter's full value is drawn
tile by tile, so any block of it can be produced alone, equal to the same block of the full
value, at the cost of the tiles it overlaps."""

from __future__ import annotations

import torch

from meshtron.mpu.init import TILE_2D, constant_init, normal_init, tile_shape


def _block(init, seed, name, offsets, shape):
    out = torch.empty(shape)
    init.fill_block(out, seed, name, offsets)
    return out


def test_any_split_of_a_matrix_reassembles_the_full_value():
    init = normal_init((600, 520), 0.02)
    full = init(7, "layers.0.mlp.up.weight")
    assert abs(full.std().item() - 0.02) < 0.001
    rows = torch.cat([_block(init, 7, "layers.0.mlp.up.weight", (r, 0), (200, 520)) for r in (0, 200, 400)])
    cols = torch.cat([_block(init, 7, "layers.0.mlp.up.weight", (0, c), (600, 130)) for c in (0, 130, 260, 390)], 1)
    assert torch.equal(rows, full) and torch.equal(cols, full)
    assert not torch.equal(full, init(8, "layers.0.mlp.up.weight"))
    assert not torch.equal(full, init(7, "layers.1.mlp.up.weight"))


def test_expert_blocks_and_vocabulary_padding():
    experts = normal_init((4, 64, 300), 1.0)
    full = experts(3, "w")
    assert torch.equal(_block(experts, 3, "w", (2, 0, 150), (2, 64, 150)), full[2:, :, 150:])
    vocab = normal_init((512, 16), 1.0, valid_rows=300)
    table = vocab(1, "embed.weight")
    assert table[300:].abs().sum() == 0 and table[:300].abs().min() > 0
    assert torch.equal(_block(vocab, 1, "embed.weight", (256, 0), (256, 16)), table[256:])
    assert torch.equal(constant_init((5,), 1.5)(), torch.full((5,), 1.5))


def test_a_shard_draws_only_the_tiles_it_overlaps(monkeypatch):
    """A quarter of the rows of a [1024, 1024] matrix draws a quarter of its values."""
    drawn = []
    real = torch.randn

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        drawn.append(out.numel())
        return out

    monkeypatch.setattr(torch, "randn", counting)
    init = normal_init((1024, 1024), 1.0)
    _block(init, 0, "w", (256, 0), (256, 1024))
    assert sum(drawn) == 256 * 1024 and tile_shape(2) == TILE_2D
    drawn.clear()
    _block(init, 0, "w", (0, 100), (1024, 56))  # inside one tile column: that column's tiles
    assert sum(drawn) == 1024 * 256
