"""Packed documents' attention without a dense mask (mpu/document_attention.py), on the CPU:
FlexAttention's forward equals the dense path; the varlen segments (cu_seqlens, the longest)
run through a plain-torch `varlen_attn` equal the dense path forward and backward (the
construction is ours to get wrong, torch's kernel is not); the auto choice; the run config's
refusals; the model and the all-to-all context parallelism wired to the setting; the device
check's CPU rehearsal."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtron.errors import ConfigError
from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.gpt import GPT
from meshtron.mpu.attention_blocks import document_ids
from meshtron.mpu.context_parallel import ulysses_attention
from meshtron.mpu.document_attention import (
    dense_document_attention,
    document_attention,
    document_layout,
    document_segments,
    pick_backend,
    varlen_document_attention,
    varlen_reference,
)
from meshtron.mpu.init import initialize_parameters
from meshtron.mpu.mesh import single_process_mesh
from meshtron.training.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def docs_of(*rows: list[int]) -> torch.Tensor:
    """doc_ids [len(rows), s] of rows given as document lengths (ids count up within a row)."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


LAYOUTS = {  # name: (rows of document lengths); s = 67 or 130
    "one document": ([67],),
    "many tiny": ([3] * 22 + [1],),
    "length-1 documents": ([1, 1, 1, 20, 1, 1, 30, 1, 1, 1, 9],),
    "two rows, different": ([67], [1, 10, 1, 40, 15]),
    "odd 130": ([5, 1, 64, 1, 59], [130]),
}


def qkv(b: int, s: int, h: int = 4, hkv: int = 2, d: int = 16, grad: bool = False, seed: int = 0, dtype=FP32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=g, dtype=dtype).requires_grad_(grad) for n in (h, hkv, hkv)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flex_forward_equals_dense(layout):
    docs = docs_of(*LAYOUTS[layout])
    q, k, v = qkv(*docs.shape)
    for scale in (None, 0.3):
        dense = dense_document_attention(q, k, v, docs, scale=scale)
        flex = document_attention(q, k, v, docs, scale=scale, backend="flex")
        torch.testing.assert_close(flex, dense, atol=1e-6, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_varlen_segments_through_a_torch_varlen_equal_dense_forward_and_backward(layout):
    docs = docs_of(*LAYOUTS[layout])  # fp64: rounding cannot hide a wrong segment, nor fake one
    leaves = [qkv(*docs.shape, grad=True, seed=1, dtype=torch.float64) for _ in range(2)]
    grad_out = torch.randn(docs.shape[0], 4, docs.shape[1], 16, generator=torch.Generator().manual_seed(2)).double()
    outs = [
        varlen_document_attention(*leaves[0], docs, scale=0.3, kernel=varlen_reference),
        dense_document_attention(*leaves[1], docs, scale=0.3),
    ]
    for out in outs:
        out.backward(grad_out)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)
    for a, b in zip(*leaves):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch's flash varlen kernel, compiled flex)")
@pytest.mark.parametrize("backend", ["varlen", "flex"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_backends_equal_dense_forward_and_backward_in_bf16(backend, layout):
    """On the GPU, torch's varlen kernel and compiled flex give the dense path's output and
    gradients (bf16 inputs; reference: the dense path in fp32) within bf16 tolerance."""
    docs = docs_of(*LAYOUTS[layout]).cuda()
    base = [t.cuda() for t in qkv(*docs.shape, d=64, seed=3)]
    grad_out = torch.randn(docs.shape[0], 4, docs.shape[1], 64, device="cuda")
    got_leaves = [t.bfloat16().requires_grad_() for t in base]
    want_leaves = [t.clone().requires_grad_() for t in base]
    got = document_attention(*got_leaves, docs, backend=backend)
    want = dense_document_attention(*want_leaves, docs)
    got.backward(grad_out.bfloat16())
    want.backward(grad_out)
    tol = dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    for a, b in zip(got_leaves, want_leaves):
        torch.testing.assert_close(a.grad.float(), b.grad, **tol)


def test_segments_start_at_every_row_and_every_new_document():
    cu, longest = document_segments(torch.tensor([[0, 0, 1], [0, 1, 1]]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 3, 4, 6] and longest == 2
    cu, longest = document_segments(torch.tensor([[0, 0], [0, 0]]))  # same id across the row edge: 2 segments
    assert cu.tolist() == [0, 2, 4] and longest == 2
    tokens = torch.tensor([[5, 9, 5, 5, 9, 5, 5, 5]])  # 9 ends a document and belongs to it
    cu, longest = document_segments(document_ids(tokens, eos_id=9)[0])
    assert cu.tolist() == [0, 2, 5, 8] and longest == 3


def test_the_reference_refuses_what_the_kernel_would_misread():
    q, k, v = (t[0].transpose(0, 1) for t in qkv(1, 6))  # [T, h, d]
    good = torch.tensor([0, 2, 6], dtype=torch.int32)
    for cu, longest, message in [
        (good.long(), 4, "not int32"),
        (good, 3, "below the longest segment 4"),
        (torch.tensor([0, 2, 5], dtype=torch.int32), 4, "not the token count 6"),
        (torch.tensor([0, 2, 2, 6], dtype=torch.int32), 4, "empty or backward"),
    ]:
        with pytest.raises(ValueError, match=message):
            varlen_reference(q, k, v, cu, cu, longest, longest, window_size=(-1, 0), enable_gqa=True)


def test_layouts_are_built_once_per_tensor_and_again_when_it_changes():
    docs = docs_of([3, 4], [7])
    first = document_layout(docs, "varlen")
    assert document_layout(docs, "varlen") is first
    docs[1, 3:] = 1  # in place: the version moves, the layout follows
    cu, longest = document_layout(docs, "varlen")
    assert cu.tolist() == [0, 3, 7, 10, 14] and longest == 4
    mask = document_layout(docs, "flex")
    assert document_layout(docs, "flex") is mask
    ref = __import__("weakref").ref(docs)
    del docs
    gc.collect()
    assert ref() is None  # the cache keeps no ids alive (the block mask holds its own copy)


@pytest.mark.parametrize(
    "device, dtype, dropout, grad, picked",
    [
        ("cuda", BF16, 0.0, True, "varlen"),
        ("cuda", FP16, 0.0, False, "varlen"),
        ("cuda", FP32, 0.0, True, "flex"),
        ("cuda", BF16, 0.1, True, "dense"),
        ("cpu", FP32, 0.0, True, "dense"),
        ("cpu", BF16, 0.0, False, "dense"),
        ("mps", FP16, 0.0, True, "dense"),
    ],
)
def test_auto_picks_by_device_dtype_and_dropout(device, dtype, dropout, grad, picked):
    assert pick_backend("auto", device, dtype, dropout, grad) == picked


def test_a_torch_without_varlens_arguments_gets_flex(monkeypatch):
    """A torch whose varlen_attn lacks window_size / enable_gqa (older releases, e.g. a GPU
    image's): auto takes flex on CUDA, an explicit varlen says why not."""
    from meshtron.mpu import document_attention as module

    monkeypatch.setattr(module, "varlen_kernel_fits", lambda: False)
    assert pick_backend("auto", "cuda", BF16, 0.0, True) == "flex"
    with pytest.raises(ValueError, match="needs torch's varlen_attn with window_size and enable_gqa"):
        pick_backend("varlen", "cuda", BF16, 0.0, True)
    monkeypatch.undo()
    assert module.varlen_kernel_fits()  # this torch (2.13) has them


def test_auto_picks_flex_inside_compiled_blocks(monkeypatch):
    """Under torch.compile (trainer.compile) auto takes flex on CUDA, whose block mask keeps its
    shapes, not varlen, whose segment count would recompile every microbatch."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert pick_backend("auto", "cuda", BF16, 0.0, True) == "flex"
    assert pick_backend("auto", "cpu", FP32, 0.0, True) == "dense"
    assert pick_backend("varlen", "cuda", BF16, 0.0, True) == "varlen"  # asked for: kept


def test_explicit_backends_stay_or_say_why_not():
    assert pick_backend("dense", "cuda", BF16, 0.1, True) == "dense"
    assert pick_backend("flex", "cpu", FP32, 0.0, False) == "flex"  # forward only on the CPU
    assert pick_backend("varlen", "cuda", BF16, 0.0, True) == "varlen"
    for args, message in [
        (("varlen", "cpu", BF16, 0.0, False), "attention backend 'varlen' is torch's flash varlen kernel, CUDA only (got cpu)"),
        (("varlen", "cuda", FP32, 0.0, True), "attention backend 'varlen' needs fp16 or bf16 inputs (got float32)"),
        (("flex", "cuda", BF16, 0.1, True), "attention backend 'flex' has no attention dropout (got 0.1); use dense"),
        (("flex", "cpu", FP32, 0.0, True), "attention backend 'flex' has no backward on cpu (FlexAttention trains on CUDA only)"),
        (("flash", "cuda", BF16, 0.0, True), "attention backend 'flash' unknown; use one of auto, dense, flex, varlen"),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as err:
            pick_backend(*args)
        assert str(err.value) == message
    q, k, v = qkv(1, 8, grad=True)
    with pytest.raises(ValueError, match="'flex' has no backward on cpu"):  # ours, before torch's
        document_attention(q, k, v, docs_of([8]), backend="flex")


def _run(trainer=None, **sections):
    return RunConfig.from_dict({"trainer": trainer or {}, **sections})


@pytest.mark.parametrize(
    "tree, message",
    [
        (
            dict(trainer=dict(attention_backend="varlen", device="cpu")),
            "trainer.attention_backend=varlen is torch's flash varlen kernel, CUDA only; this run computes on the "
            "CPU: use trainer.attention_backend=auto or dense",
        ),
        (
            dict(trainer=dict(attention_backend="flex", device="cpu")),
            "trainer.attention_backend=flex cannot train on the CPU (FlexAttention has no backward there); use "
            "trainer.attention_backend=auto or dense",
        ),
        (
            dict(trainer=dict(attention_backend="varlen", precision="fp32")),
            "trainer.attention_backend=varlen needs 16-bit attention (trainer.precision=bf16 or fp16, got fp32); use "
            "trainer.attention_backend=flex or auto",
        ),
        (
            dict(trainer=dict(attention_backend="flex"), model=dict(attention_dropout=0.1)),
            "trainer.attention_backend=flex has no attention dropout (model.attention_dropout or model.dropout gives "
            "0.1); use trainer.attention_backend=dense or model.attention_dropout=0",
        ),
        (
            dict(trainer=dict(attention_backend="varlen", precision="bf16"), parallel=dict(cp=2)),
            "trainer.attention_backend=varlen applies to parallel.cp_comm=a2a (ring attention has its own blockwise "
            "kernel); use parallel.cp_comm=a2a or trainer.attention_backend=auto",
        ),
        (
            dict(trainer=dict(attention_backend="flash")),
            "trainer.attention_backend='flash' must be one of auto, dense, flex, varlen",
        ),
    ],
)
def test_config_refuses_what_cannot_run_with_one_line(tree, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(tree)
    assert str(err.value) == message


def test_config_checks_again_once_the_device_is_known():
    run = _run(dict(attention_backend="varlen"))  # device auto, precision auto: fine until resolved
    with pytest.raises(
        ConfigError, match=r"^trainer.attention_backend=varlen is torch's flash varlen kernel, CUDA only"
    ):
        run.with_precision_for("cpu", bf16_supported=False)
    assert run.with_precision_for("cuda", bf16_supported=True)[0].trainer.precision == "bf16"
    with pytest.raises(ConfigError, match=r"needs 16-bit attention \(trainer.precision=bf16 or fp16, got fp32\)"):
        run.with_precision_for("cuda", bf16_supported=False)  # auto picks fp32 there
    assert _run(dict(attention_backend="flex", device="cuda")).execution().attention_backend == "flex"
    assert _run(dict(attention_backend="flex"), parallel=dict(cp=2, cp_comm="a2a")).trainer.attention_backend == "flex"


def test_model_and_ulysses_use_the_setting():
    cfg = GPTConfig(arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, vocab_size=64, seq_len=40)
    tokens = torch.randint(0, 63, (2, 40), generator=torch.Generator().manual_seed(0))
    tokens[0, [5, 6, 20]] = tokens[1, [30]] = 63
    docs, positions = document_ids(tokens, eos_id=63)
    logits = {}
    for backend in ("dense", "flex"):
        model = GPT(cfg, single_process_mesh(), execution=ExecutionConfig(attention_backend=backend)).eval()
        initialize_parameters(model, 3, single_process_mesh())
        with torch.no_grad():
            logits[backend] = model(tokens, positions=positions, doc_ids=docs)
    torch.testing.assert_close(logits["flex"], logits["dense"], atol=1e-5, rtol=0)
    model = GPT(cfg, single_process_mesh(), execution=ExecutionConfig(attention_backend="varlen"))
    with pytest.raises(ValueError, match="'varlen' is torch's flash varlen kernel, CUDA only"):  # the setting arrives
        model(tokens, positions=positions, doc_ids=docs)
    q, k, v = qkv(*docs.shape)
    one = ulysses_attention(q, k, v, None, sequence_doc_ids=docs, attention_backend="flex")
    torch.testing.assert_close(one, dense_document_attention(q, k, v, docs), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="'varlen' is torch's flash varlen kernel, CUDA only"):
        ulysses_attention(q, k, v, None, sequence_doc_ids=docs, attention_backend="varlen")


def test_device_check_rehearses_on_the_cpu():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "attention_check.py"), "--cpu-rehearsal"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    records = json.loads(out.stdout)
    keys = {"name", "metric", "meshtron", "baseline", "ratio", "target", "met", "device", "date", "torch", "triton"}
    assert records and all(keys <= set(r) and r["rehearsal"] for r in records)
    assert [r["name"] for r in records] == ["varlen error vs dense fp32 s67", "flex error vs dense fp32 s67",
                                            "varlen error vs dense fp32 s130", "flex error vs dense fp32 s130"]  # fmt: skip
    for flex in records[1::2]:
        assert 0 < flex["meshtron"] < 1e-5 and flex["met"] is True
    for varlen in records[::2]:
        assert varlen["meshtron"] is None and varlen["met"] is False and "CUDA" in varlen["note"]
