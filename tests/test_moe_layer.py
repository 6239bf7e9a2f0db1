"""MoE layer in one process: grouped GEMM vs a per-expert loop, and the whole layer vs the
per-token formula  y_t = sum_j w_tj * FFN_{e_tj}(x_t)  (+ shared experts), with and without
capacity dropping."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.kernels.backend import CHECKED
from meshtron.models.config import GPTConfig
from meshtron.moe import experts
from meshtron.moe.capacity import capacity_for, capacity_keep_mask
from meshtron.moe.experts import _padded_bmm, grouped_backend, grouped_matmul, native_grouped_mm_preferred
from meshtron.moe.layer import MoELayer
from meshtron.mpu.init import initialize_parameters
from meshtron.mpu.mesh import single_process_mesh


def loop_reference(x, weight, sizes):
    outs, start = [], 0
    for g, n in enumerate(sizes.tolist()):
        outs.append(x[start : start + n] @ weight[g])
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("sizes", [[3, 0, 1, 5], [0, 0, 4, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
@pytest.mark.parametrize("impl,dims", [("grouped", (8, 4)), ("grouped", (5, 3)), ("padded", (5, 3))])
def test_grouped_matmul_matches_loop(sizes, impl, dims):
    """Empty groups and single-token groups included; forward and both gradients; aligned
    sizes take torch's grouped GEMM, odd ones the padded batched matmul."""
    gen = torch.Generator().manual_seed(0)
    sizes = torch.tensor(sizes)
    x = torch.randn(int(sizes.sum()), dims[0], generator=gen, requires_grad=True)
    w = torch.randn(4, dims[0], dims[1], generator=gen, requires_grad=True)
    fn = grouped_matmul if impl == "grouped" else _padded_bmm
    out = fn(x, w, sizes)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = loop_reference(x2, w2, sizes)
    assert torch.allclose(out, ref, atol=1e-6)
    if x.shape[0]:
        grad = torch.randn(out.shape, generator=gen)
        out.backward(grad)
        ref.backward(grad)
        assert torch.allclose(x.grad, x2.grad, atol=1e-6)
        assert torch.allclose(w.grad, w2.grad, atol=1e-6)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [(8, 16), (5, 3)])
def test_grouped_matmul_under_autocast_computes_in_bf16(x_dtype, dims):
    """trainer.precision=bf16: fp32 main weights with fp32 or bf16 rows (a bf16 row comes from
    an earlier autocast GEMM) give the bf16 product of bf16 operands, and gradients in each
    operand's own dtype. (grouped_mm is not on autocast's lists: mixed dtypes raised on CUDA.)"""
    gen = torch.Generator().manual_seed(3)
    sizes = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, dims[0], generator=gen).to(x_dtype).requires_grad_()
    w = torch.randn(4, *dims, generator=gen, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_matmul(x, w, sizes)
    assert out.dtype == torch.bfloat16
    want = loop_reference(x.detach().bfloat16().float(), w.detach().bfloat16().float(), sizes)
    assert torch.allclose(out.float(), want, rtol=1e-2, atol=1e-2)
    out.float().sum().backward()
    assert x.grad.dtype == x_dtype and w.grad.dtype == torch.float32
    assert torch.allclose(
        w.grad, loop_reference_dw(x.detach().bfloat16().float(), sizes, 4, dims[1]), rtol=1e-2, atol=1e-2
    )


@pytest.mark.parametrize(
    "device_type,dtype,dims,want",
    [
        ("cuda", torch.bfloat16, (4096, 14336), True),
        ("cuda", torch.float16, (256, 512), False),  # torch's fast path is bf16 only: fp16 keeps Triton
        ("cuda", torch.bfloat16, (12, 512), False),  # 24-byte rows: grouped_mm refuses them
        ("cuda", torch.float32, (256, 512), False),  # torch's fp32 path is the padded bmm
        ("cpu", torch.bfloat16, (256, 512), False),  # the CPU runs what was asked (the interpreter in tests)
    ],
)
def test_auto_prefers_torch_grouped_mm_for_16_bit_cuda(device_type, dtype, dims, want):
    assert native_grouped_mm_preferred(device_type, dtype, *dims) is want


def test_grouped_backend_keeps_strict_and_cpu_choices():
    x, w = torch.zeros(4, 16), torch.zeros(2, 16, 32)
    for backend in ("torch", "triton", CHECKED):
        assert grouped_backend(x, w, backend) == backend  # CPU: nothing replaced


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.cuda
def test_auto_runs_torch_grouped_mm_on_cuda_bf16(monkeypatch):
    """kernels.backend=auto with bf16 on CUDA never reaches the Triton kernel (nor its self-check)."""

    def refuse(*args):
        raise AssertionError("the Triton grouped GEMM ran")

    monkeypatch.setattr(experts, "_grouped_gemm_triton", refuse)
    gen = torch.Generator().manual_seed(0)
    sizes = torch.tensor([3, 0, 5, 8], device="cuda")
    x = torch.randn(16, 64, generator=gen).cuda().bfloat16()
    w = torch.randn(4, 64, 32, generator=gen).cuda().bfloat16()
    assert grouped_backend(x, w, CHECKED) == "torch"
    out = grouped_matmul(x, w, sizes, CHECKED)
    assert torch.allclose(out.float(), loop_reference(x.float(), w.float(), sizes.cpu()).float(), rtol=2e-2, atol=2e-2)


def loop_reference_dw(x, sizes, groups, out_dim):
    """dW of sum(grouped x @ W): each group's column sums of x, broadcast over the out columns."""
    dw, start = torch.zeros(groups, x.shape[1], out_dim), 0
    for g, n in enumerate(sizes.tolist()):
        dw[g] = x[start : start + n].sum(0)[:, None].expand(-1, out_dim)
        start += n
    return dw


def _layer(activation, capacity_factor=None, shared=0, top_k=2, seed=5):
    """A tiny single-process MoE layer (4 experts, hidden 16) with (seed, name)-derived weights."""
    cfg = GPTConfig(
        arch="llama" if activation == "swiglu" else "gpt2",
        num_layers=2,
        hidden_size=16,
        num_heads=2,
        num_experts=4,
        top_k=top_k,
        moe_ffn_hidden_size=12,
        capacity_factor=capacity_factor,
        shared_experts=shared,
        seq_len=8,
    )
    layer = MoELayer(cfg.moe(), single_process_mesh())
    initialize_parameters(layer, seed, single_process_mesh())
    return cfg, layer


class OpLog(TorchDispatchMode):
    """Inside it, `ops` lists the names of the aten ops that run, in order, leaving out views
    and metadata-only ops (no kernel of their own on a GPU)."""

    VIEWS = frozenset(
        {
            "slice",
            "view",
            "alias",
            "detach",
            "_unsafe_view",
            "select",
            "t",
            "transpose",
            "unsqueeze",
            "expand",
            "reshape",
            "unbind",
            "as_strided",
            "permute",
            "empty_like",
        }
    )

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.VIEWS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_statistics_are_issued_after_the_first_expert_gemm():
    """A GPU that starts the layer idle waits for the ops issued before its first large
    kernel: only the routing (gate GEMM, softmax, top-k, weights) and the ep = 1 dispatch
    (pair sort, counts, row gather, offsets) come before the first expert GEMM; the balancing
    statistics (logsumexp, the counts' scatter into the stats vector, the aux arithmetic)
    after it."""
    cfg, layer = _layer("swiglu")
    layer.router.aux_loss_coef = layer.router.z_loss_coef = 0.01
    x = torch.randn(8, 2, 16)
    with OpLog() as log:
        layer(x)
    first_gemm = log.ops.index("_grouped_mm")
    before = log.ops[:first_gemm]
    assert "logsumexp" not in before and "logsumexp" in log.ops[first_gemm:], " ".join(log.ops)
    assert len(before) <= 16, " ".join(before)  # 47 when the statistics came first


def ffn(layer, e, x):
    ex = layer.experts
    up = x @ ex.w_up[e]
    hidden = F.gelu(up, approximate="tanh") if ex.w_gate is None else F.silu(x @ ex.w_gate[e]) * up
    return hidden @ ex.w_down[e]


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_layer_equals_per_token_formula(activation, shared, capacity_factor):
    cfg, layer = _layer(activation, capacity_factor, shared)
    x = torch.randn(8, 3, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = layer(x)
        routed = layer.last_router
        idx, w = routed.topk_idx.view(8, 3, 2), routed.topk_weight.view(8, 3, 2)
        keep = torch.ones_like(idx, dtype=torch.bool)
        if capacity_factor is not None:
            keep = capacity_keep_mask(idx, 4, capacity_for(8, 4, 2, capacity_factor), None)
            assert not keep.all(), "the case should drop something"
        want = torch.zeros_like(x)
        for s in range(8):
            for b in range(3):
                for j in range(2):
                    if keep[s, b, j]:
                        want[s, b] += w[s, b, j] * ffn(layer, int(idx[s, b, j]), x[s, b])
        if shared:
            want += layer.shared(x)
    assert torch.allclose(out, want, atol=1e-5)
    expected_drop = 1 - keep.sum().item() / keep.numel()
    assert layer.last_dropped.item() == pytest.approx(expected_drop)


def test_fully_dropped_token_passes_through_as_zero_update():
    """With capacity 1 per expert and all tokens preferring one expert, later tokens keep no
    choice: their MoE output is exactly zero (the block's residual carries them)."""
    cfg, layer = _layer("gelu", capacity_factor=0.01, top_k=1)
    assert capacity_for(8, 4, 1, 0.01) == 1
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2, 0] = 10.0
    x = torch.zeros(8, 1, 16)
    x[..., 0] = 1.0
    with torch.no_grad():
        out = layer(x)
    assert torch.all(layer.last_router.topk_idx == 2)
    assert out[0].abs().sum() > 0 and torch.count_nonzero(out[1:]) == 0


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_only_a_capacity_pays_the_dropped_fraction_collective(monkeypatch, capacity_factor):
    """Dropless layers drop nothing by construction: `last_dropped` is 0 without the per-forward
    all-reduce over tp x dp that a capacity needs to count the kept pairs globally."""
    import meshtron.moe.layer as layer_module

    calls = []
    real = layer_module.all_reduce_stats
    monkeypatch.setattr(layer_module, "all_reduce_stats", lambda t, group: calls.append(group) or real(t, group))
    _, layer = _layer("swiglu", capacity_factor)
    layer(torch.randn(8, 3, 16, generator=torch.Generator().manual_seed(1)))
    assert len(calls) == (0 if capacity_factor is None else 1)
    if capacity_factor is None:
        assert layer.last_dropped.item() == 0.0
    else:
        assert layer.last_dropped.item() > 0.0


def test_dispatch_chunks_come_from_the_trainer_config():
    """trainer.moe_dispatch_chunks reaches every MoE layer through the execution config."""
    from meshtron.models.gpt import init_model_chunks
    from meshtron.training.config import RunConfig

    run = RunConfig.from_dict({"trainer": {"moe_dispatch_chunks": 3}})
    assert run.execution().moe_dispatch_chunks == 3
    cfg = GPTConfig(
        arch="llama",
        num_layers=2,
        hidden_size=16,
        num_heads=2,
        num_experts=4,
        top_k=2,
        moe_ffn_hidden_size=8,
        seq_len=8,
        vocab_size=32,
    )
    (model,) = init_model_chunks(cfg, single_process_mesh(), 0, execution=run.execution())
    assert [m.dispatch_chunks for m in model.moe_layers()] == [3, 3]


def test_dispatch_chunks_refuse_fewer_than_one():
    from meshtron.models.config import ExecutionConfig
    from meshtron.training.config import ConfigError, RunConfig

    with pytest.raises(ConfigError, match="moe_dispatch_chunks"):
        RunConfig.from_dict({"trainer": {"moe_dispatch_chunks": 0}})
    with pytest.raises(ValueError, match="moe_dispatch_chunks"):
        ExecutionConfig(moe_dispatch_chunks=0)
    cfg = GPTConfig(arch="llama", hidden_size=16, num_heads=2, num_experts=4, top_k=2, moe_ffn_hidden_size=8)
    with pytest.raises(ValueError, match="trainer.moe_dispatch_chunks=0 must be at least 1"):
        MoELayer(cfg.moe(), single_process_mesh(), dispatch_chunks=0)


@pytest.mark.parametrize(
    "ep, chunks, tokens, want",
    [
        (1, 4, 64, 1),  # nothing travels at ep = etp = 1: one chunk
        (2, 4, 64, 4),
        (2, 4, 3, 3),  # at most one chunk per token
        (2, 1, 64, 1),
    ],
)
def test_dispatch_chunk_count(ep, chunks, tokens, want):
    """On a virtual mesh (nothing run): the chunks a layer cuts its tokens into."""
    from meshtron.mpu.mesh import ParallelConfig
    from meshtron.planning.plan import virtual_mesh

    cfg = GPTConfig(arch="llama", hidden_size=16, num_heads=2, num_experts=4, top_k=2, moe_ffn_hidden_size=8)
    layer = MoELayer(cfg.moe(), virtual_mesh(ParallelConfig(ep=ep), ep, 0), device="meta", dispatch_chunks=chunks)
    assert layer.dispatch_chunk_count(tokens) == want
    pairs = torch.zeros(tokens * 2)
    bounds = [len(t) for t, *_ in layer._chunks(torch.zeros(tokens, 1), pairs, pairs, None)]
    assert sum(bounds) == tokens and len(bounds) == want and max(bounds) - min(bounds) <= 1
