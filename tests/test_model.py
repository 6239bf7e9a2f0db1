"""Single-process model properties: layout-independent init, padded vocabulary, attention
semantics (causality, GQA), and vocab-parallel cross-entropy at tp=1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtron.models.config import GPTConfig
from meshtron.models.gpt import GPT
from meshtron.mpu.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from meshtron.mpu.init import initialize_parameters
from meshtron.mpu.mesh import ParallelConfig, single_process_mesh, virtual_mesh

CONFIGS = {
    "gpt2": GPTConfig(arch="gpt2", num_layers=2, hidden_size=32, num_heads=4, vocab_size=300, seq_len=16),
    "llama": GPTConfig(
        arch="llama",
        num_layers=2,
        hidden_size=64,
        num_heads=8,
        num_kv_heads=4,
        ffn_hidden_size=48,
        vocab_size=300,
        seq_len=16,
        tie_embeddings=False,
    ),
}


def _built(cfg, mesh, seed=3):
    model = GPT(cfg, mesh)
    initialize_parameters(model, seed, mesh)
    return model


@pytest.mark.parametrize("arch", CONFIGS)
@pytest.mark.parametrize("tp", [2, 4])
def test_init_is_layout_independent(arch, tp):
    """Concatenating every TP rank's shard gives the tp=1 parameter (real vocabulary rows)."""
    cfg = CONFIGS[arch]
    serial = dict(_built(cfg, single_process_mesh()).named_parameters())
    shards = [dict(_built(cfg, virtual_mesh(ParallelConfig(tp=tp), tp, r)).named_parameters()) for r in range(tp)]
    for name, full in serial.items():
        dim = shards[0][name].tp_shard_dim
        got = shards[0][name] if dim is None else torch.cat([s[name] for s in shards], dim=dim)
        if name in ("embed.weight", "head.weight"):
            assert torch.count_nonzero(got[cfg.vocab_size :]) == 0, "padded vocabulary rows must be zero"
            got, full = got[: cfg.vocab_size], full[: cfg.vocab_size]
        assert torch.equal(got, full), name
        if dim is None:
            assert all(torch.equal(s[name], shards[0][name]) for s in shards), f"{name} replicated differs"


def test_init_depends_on_seed_and_name_only():
    cfg = CONFIGS["gpt2"]
    a, b = _built(cfg, single_process_mesh(), 3), _built(cfg, single_process_mesh(), 4)
    assert not torch.equal(a.layers["0"].attn.qkv.weight, b.layers["0"].attn.qkv.weight)
    assert not torch.equal(a.layers["0"].attn.qkv.weight, a.layers["1"].attn.qkv.weight)


@pytest.mark.parametrize("arch", CONFIGS)
def test_attention_is_causal(arch):
    """Changing a later token never changes the logits of earlier positions."""
    cfg = CONFIGS[arch]
    model = _built(cfg, single_process_mesh()).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gqa_equals_repeated_kv_heads():
    """Grouped-query attention equals full attention whose k/v heads repeat per group."""
    cfg = CONFIGS["llama"]
    model = _built(cfg, single_process_mesh())
    attn = model.layers["0"].attn
    x = torch.randn(16, 2, cfg.hidden_size)
    qkv = F.linear(x, attn.qkv.weight).reshape(16, 2, cfg.num_kv_heads, attn.q_per_group + 2, cfg.head_dim)
    q = qkv[..., : attn.q_per_group, :].reshape(16, 2, cfg.num_heads, cfg.head_dim).permute(1, 2, 0, 3)
    k = qkv[..., attn.q_per_group, :].permute(1, 2, 0, 3).repeat_interleave(attn.q_per_group, dim=1)
    v = qkv[..., attn.q_per_group + 1, :].permute(1, 2, 0, 3).repeat_interleave(attn.q_per_group, dim=1)
    from meshtron.models.rope import apply_rope, rope_tables

    cos, sin = rope_tables(16, cfg.head_dim, cfg.rope_theta, x.device)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scores = (q @ k.transpose(-1, -2)) / cfg.head_dim**0.5
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    ref = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(16, 2, cfg.hidden_size)
    ref = F.linear(ref, attn.proj.weight)
    with torch.no_grad():
        got = attn(x, (cos, sin))
    assert torch.allclose(got, ref, atol=1e-5)


def test_cross_entropy_single_process_matches_torch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 7, 384, generator=gen, requires_grad=True)
    target = torch.randint(0, 300, (4, 7), generator=gen)
    target[1, 1] = IGNORE_INDEX
    loss = vocab_parallel_cross_entropy(logits, target, vocab_size=300)
    loss.sum().backward()
    ref_logits = logits.detach()[..., :300].clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, 300), target.reshape(-1), reduction="none").reshape(4, 7)
    ref.sum().backward()
    assert torch.allclose(loss, ref, atol=1e-6)
    assert torch.allclose(logits.grad[..., :300], ref_logits.grad, atol=1e-6)
    assert torch.count_nonzero(logits.grad[..., 300:]) == 0
    assert loss[1, 1] == 0


def test_padded_logits_never_enter_the_loss():
    """Huge values in the padded columns change nothing."""
    logits = torch.randn(3, 384)
    target = torch.tensor([0, 5, 299])
    base = vocab_parallel_cross_entropy(logits, target, vocab_size=300)
    logits[:, 300:] = 1e4
    assert torch.allclose(vocab_parallel_cross_entropy(logits, target, vocab_size=300), base)


def test_sequence_longer_than_model_is_rejected():
    model = _built(CONFIGS["gpt2"], single_process_mesh())
    with pytest.raises(ValueError, match="exceeds model.seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
