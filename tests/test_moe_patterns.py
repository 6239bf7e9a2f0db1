"""Issue 40's first pieces, single process: MoE layer patterns (the first k layers dense,
listed layers dense), DeepSeek-V3's routed scaling factor and Qwen2-MoE's gated shared expert
of its own width; planned parameter counts equal the built model's."""

from __future__ import annotations

import pytest
import torch

from meshtron.models.config import GPTConfig
from meshtron.models.gpt import GPT
from meshtron.moe.layer import MoELayer
from meshtron.moe.router import TopKRouter
from meshtron.mpu.init import initialize_parameters
from meshtron.mpu.mesh import single_process_mesh
from meshtron.planning.flops import param_count


def _cfg(**kw) -> GPTConfig:
    base = dict(arch="llama", num_layers=5, hidden_size=32, num_heads=4, vocab_size=64, seq_len=8, num_experts=4)
    return GPTConfig(**{**base, "top_k": 2, "moe_ffn_hidden_size": 16, **kw})


def test_first_dense_and_listed_dense_layers_build_dense_mlps():
    cfg = _cfg(moe_first_dense=2, moe_dense_layers=[3])
    model = GPT(cfg, single_process_mesh())
    kinds = [isinstance(model.layers[str(i)].mlp, MoELayer) for i in range(5)]
    assert kinds == [False, False, True, False, True] == [cfg.is_moe_layer(i) for i in range(5)]
    assert param_count(cfg)["total"] == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match=r"model.moe_dense_layers=\[5\] must list layer indices between 0 and 4"):
        _cfg(moe_dense_layers=[5])


def test_routed_scaling_factor_multiplies_the_combine_weights():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 16)
    plain = TopKRouter(16, 8, 3, score="sigmoid").route(x)
    scaled = TopKRouter(16, 8, 3, score="sigmoid", scaling_factor=2.5).route(x)
    assert torch.equal(plain.topk_idx, scaled.topk_idx)
    assert torch.allclose(scaled.topk_weight, 2.5 * plain.topk_weight, rtol=0, atol=1e-7)
    assert torch.allclose(scaled.topk_weight.sum(-1), torch.full((6, 3), 2.5))


def test_gated_shared_expert_of_its_own_width():
    """out = routed + sigmoid(x . w) * shared(x), the shared MLP 24 wide (not 16 x shared_experts)."""
    cfg = _cfg(shared_experts=1, shared_ffn_hidden_size=24, shared_expert_gate=True).moe()
    mesh = single_process_mesh()
    layer = MoELayer(cfg, mesh)
    initialize_parameters(layer, 3, mesh)
    assert layer.shared.up.shape == (24, 32) and layer.shared.output_gate.shape == (1, 32)
    x = torch.randn(8, 2, 32)
    with torch.no_grad():
        out = layer(x)
        gate = layer.shared.output_gate
        layer.shared.output_gate = None
        ungated = layer(x)
        shared = layer.shared(x)
        layer.shared.output_gate = gate
    want = ungated - shared + torch.sigmoid(x @ gate.t()) * shared
    assert torch.allclose(out, want, atol=1e-6)
    model_cfg = _cfg(shared_experts=1, shared_ffn_hidden_size=24, shared_expert_gate=True)
    model = GPT(model_cfg, mesh)
    assert param_count(model_cfg)["total"] == sum(p.numel() for p in model.parameters())
    with pytest.raises(ValueError, match="apply to shared experts: set model.shared_experts >= 1"):
        _cfg(shared_expert_gate=True)
