"""Fused SwiGLU (kernels/swiglu.py) under the CPU interpreter against torch's silu(g) * u:
forward and both gradients in fp32 over sizes that leave a partial last block, the empty
case, the refusals, and the MoE experts running it under the triton backends."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton")

from meshtron.kernels import selfcheck  # noqa: E402
from meshtron.kernels.swiglu import swiglu, swiglu_reference  # noqa: E402


def _run(backend, gate, up, dout):
    gate, up = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    out = swiglu(gate, up, backend=backend)
    out.backward(dout)
    return out.detach(), gate.grad, up.grad


@pytest.mark.parametrize("shape", [(1, 1), (37, 29), (3, 128), (5, 300), (0, 16)])
def test_swiglu_kernel_matches_torch(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    gate, up, dout = (torch.randn(*shape, generator=gen) * 3 for _ in range(3))
    got, want = _run("triton", gate, up, dout), _run("torch", gate, up, dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_swiglu_takes_strided_inputs():
    """A transposed gate (the kernel makes its operands contiguous first)."""
    gen = torch.Generator().manual_seed(1)
    gate, up = torch.randn(24, 10, generator=gen).t(), torch.randn(10, 24, generator=gen)
    torch.testing.assert_close(swiglu(gate, up, backend="triton"), swiglu_reference(gate, up))


def test_swiglu_refuses_bad_input():
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="one shape and dtype"):
        swiglu(x, torch.zeros(4, 4), backend="triton")
    with pytest.raises(ValueError, match="one shape and dtype"):
        swiglu(x, x.double(), backend="triton")
    with pytest.raises(ValueError, match="must be 'torch' or 'triton'"):
        swiglu(x, x, backend="auto")


@pytest.mark.parametrize(
    "backend, min_elements, fused",
    [("triton", 1 << 26, True), ("triton_checked", 0, True), ("triton_checked", 241, False)],
)
def test_moe_experts_run_the_fused_swiglu(backend, min_elements, fused, monkeypatch):
    """GroupedExperts with SwiGLU: kernels.backend=triton launches the fused kernels (forward
    and backward), auto's checked mode does (once its check passed) only on activations of
    `AUTO_TRITON_MIN_ELEMENTS` elements and more (here 10 rows x 24 = 240); every run equals
    the torch backend."""
    from meshtron.kernels import backend as kernel_backend
    from meshtron.kernels import swiglu as swiglu_module
    from meshtron.moe.experts import GroupedExperts
    from meshtron.mpu.init import initialize_parameters
    from meshtron.mpu.mesh import single_process_mesh

    monkeypatch.setitem(kernel_backend.AUTO_TRITON_MIN_ELEMENTS, "swiglu", min_elements)
    launched = []
    original = swiglu_module.launch  # every launch, the autotuned first one and the cached ones
    monkeypatch.setattr(
        swiglu_module,
        "launch",
        lambda kernel, *a, **k: launched.append(kernel.base_fn.__name__) or original(kernel, *a, **k),
    )
    selfcheck.reset()
    mesh = single_process_mesh()
    results = []
    for be in ("torch", backend, backend):  # the checked mode runs torch on its first (checking) call
        experts = GroupedExperts(4, 16, 24, "swiglu", mesh, init_std=0.1, out_init_std=0.1, backend=be)
        initialize_parameters(experts, 3, mesh)
        x = torch.randn(10, 16, generator=torch.Generator().manual_seed(2), requires_grad=True)
        out = experts(x, torch.tensor([3, 0, 5, 2]))
        out.backward(torch.ones_like(out))
        results.append((out.detach(), x.grad, experts.w_gate.grad))
    selfcheck.reset()
    swiglu_kernels = {"_swiglu_fwd_kernel", "_swiglu_bwd_kernel"}
    assert (swiglu_kernels <= set(launched)) if fused else not swiglu_kernels & set(launched), launched
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_model_code_imports_no_triton():
    """The model, MoE and training modules import Triton's kernel modules only when a Triton
    backend runs: a kernel jitted before a test sets TRITON_INTERPRET=1 breaks every Triton
    interpreter test after it (a fresh interpreter, so nothing here has imported it yet)."""
    import subprocess
    import sys

    code = (
        "import sys; import meshtron.models.gpt, meshtron.moe.layer, meshtron.training.loop, "
        "meshtron.training.step; print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
