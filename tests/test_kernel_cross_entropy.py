"""Fused cross-entropy kernels (Triton under the CPU interpreter) against torch references."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import meshtron.kernels.cross_entropy as kce  # noqa: E402
from meshtron.kernels.cross_entropy import (  # noqa: E402
    IGNORE_INDEX,
    combine_gathered_partials,
    cross_entropy_partials,
    fused_cross_entropy,
    loss_from_stats,
)


def _case(rows, vocab, padded, seed=0, ignore=True, last=True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, padded, generator=g) * 3
    logits[:, vocab:] = torch.randn(rows, padded - vocab, generator=g) * 3 + 5  # padding must not matter
    target = torch.randint(0, vocab, (rows,), generator=g)
    if last:
        target[0] = vocab - 1
    if ignore and rows > 1:
        target[1] = IGNORE_INDEX
    return logits, target


def _expected(logits, target, vocab):
    ref = logits[:, :vocab].clone().requires_grad_(True)
    loss = F.cross_entropy(ref, target, reduction="none", ignore_index=IGNORE_INDEX)
    return loss, ref


@pytest.mark.parametrize("rows", [1, 5, 17])
@pytest.mark.parametrize("vocab,padded", [(7, 8), (100, 128), (300, 384)])
@pytest.mark.parametrize("inplace", [True, False])
def test_matches_torch_cross_entropy(rows, vocab, padded, inplace):
    logits, target = _case(rows, vocab, padded, seed=rows * 1000 + vocab)
    want, ref = _expected(logits, target, vocab)
    dloss = torch.rand(rows, generator=torch.Generator().manual_seed(1)) + 0.5
    (want * dloss).sum().backward()

    x = logits.clone().requires_grad_(True)
    feed = x * 1.0  # non-leaf, as an LM head output would be; in-place backward overwrites it
    loss = fused_cross_entropy(feed, target, vocab_size=vocab, backend="triton", inplace_backward=inplace)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    (loss * dloss).sum().backward()
    torch.testing.assert_close(x.grad[:, :vocab], ref.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(x.grad[:, vocab:], torch.zeros_like(x.grad[:, vocab:]))  # padding: exactly 0
    if rows > 1:
        assert loss[1] == 0 and torch.equal(x.grad[1], torch.zeros(padded))  # ignored row
    if inplace:
        torch.testing.assert_close(feed.detach(), x.grad)  # the logits' storage now holds the gradient
    else:
        torch.testing.assert_close(feed.detach(), logits)

    # The torch backend (mpu reference) agrees too.
    y = logits.clone().requires_grad_(True)
    ref_loss = fused_cross_entropy(y, target, vocab_size=vocab, backend="torch")
    torch.testing.assert_close(ref_loss, want.detach(), rtol=1e-5, atol=1e-5)


def test_batched_shape_and_reduced_loss():
    logits, target = _case(12, 100, 128, seed=3)
    want, ref = _expected(logits, target, 100)
    want.sum().backward()
    x = logits.view(3, 4, 128).clone().requires_grad_(True)
    loss = fused_cross_entropy(x * 1.0, target.view(3, 4), vocab_size=100, backend="triton")
    assert loss.shape == (3, 4)
    loss.sum().backward()  # expanded (stride-0) upstream gradient
    torch.testing.assert_close(loss.reshape(-1), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.reshape(12, 128)[:, :100], ref.grad, rtol=1e-5, atol=1e-6)


def test_half_precision_inputs():
    logits, target = _case(5, 100, 128, seed=4)
    half = logits.to(torch.float16)
    want, ref = _expected(half.float(), target, 100)
    want.sum().backward()
    x = half.clone().requires_grad_(True)
    loss = fused_cross_entropy(x * 1.0, target, vocab_size=100, backend="triton")
    loss.sum().backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.float16
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad[:, :100].float(), ref.grad, rtol=1e-3, atol=1e-3)


def test_inplace_detects_other_saved_use():
    """Another autograd use of the logits that would read them after the in-place backward
    fails loudly (version counter bumped); one whose backward runs first is unaffected."""
    logits, target = _case(5, 100, 128, seed=5)
    x = logits.clone().requires_grad_(True)
    feed = x * 1.0
    other = feed.sin().sum(-1)  # created first, so its backward runs after the loss's
    loss = fused_cross_entropy(feed, target, vocab_size=100, backend="triton") + other
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.sum().backward()

    want_x = logits.clone().requires_grad_(True)
    (F.cross_entropy(want_x[:, :100], target, reduction="none") + want_x.sin().sum(-1)).sum().backward()
    x = logits.clone().requires_grad_(True)
    feed = x * 1.0
    loss = fused_cross_entropy(feed, target, vocab_size=100, backend="triton")
    (loss + feed.sin().sum(-1)).sum().backward()  # sin's backward runs first: reads intact logits
    torch.testing.assert_close(x.grad, want_x.grad, rtol=1e-5, atol=1e-6)


def _split(logits, target, vocab, width):
    return [(logits[:, s : s + width], s) for s in range(0, logits.shape[1], width)]


@pytest.mark.parametrize("vocab,padded", [(100, 128), (300, 384), (5, 256)])  # (5, 256): rank 1 all padding
def test_two_way_split_partials_combined_by_hand(vocab, padded):
    logits, target = _case(17, vocab, padded, seed=vocab)
    want, _ = _expected(logits, target, vocab)
    parts = [
        cross_entropy_partials(shard, target, start, vocab)
        for shard, start in _split(logits, target, vocab, padded // 2)
    ]
    m, s, t = (torch.stack(p) for p in zip(*parts))
    loss, _ = loss_from_stats(*combine_gathered_partials(m, s, t), target)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab,padded", [(100, 128), (300, 384)])
def test_two_way_split_full_autograd_with_fake_all_gather(monkeypatch, vocab, padded):
    """Run the whole Function on each half, with `all_gather_stats` replaced by a fake that
    returns both ranks' (precomputed) partials: loss and gradient slices match the full."""
    logits, target = _case(17, vocab, padded, seed=vocab + 1)
    want, ref = _expected(logits, target, vocab)
    want.sum().backward()
    width = padded // 2
    shards = _split(logits, target, vocab, width)
    parts = [torch.stack(cross_entropy_partials(shard, target, start, vocab)) for shard, start in shards]
    grads = []
    for rank, (shard, start) in enumerate(shards):
        calls = []

        def fake(x, group):
            calls.append(tuple(x.shape))
            torch.testing.assert_close(x, parts[rank])  # this rank's own partials go out
            return torch.stack(parts)

        monkeypatch.setattr(kce, "all_gather_stats", fake)
        x = shard.clone().requires_grad_(True)
        loss = fused_cross_entropy(x * 1.0, target, vocab_start=start, vocab_size=vocab, backend="triton")
        assert calls == [(3, 17)]  # one collective: the stacked [3, rows] partials
        torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
        loss.sum().backward()
        grads.append(x.grad)
    grad = torch.cat(grads, dim=-1)
    torch.testing.assert_close(grad[:, :vocab], ref.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(grad[:, vocab:], torch.zeros_like(grad[:, vocab:]))


def test_bad_backend_raises():
    logits, target = _case(2, 7, 8)
    with pytest.raises(ValueError, match="backend"):
        fused_cross_entropy(logits, target, backend="cuda")


@pytest.mark.parametrize("chunk_rows", [4, 17])
def test_chunked_lm_loss_with_triton_kernels_equals_torch(chunk_rows):
    """kernels.linear_cross_entropy with the Triton statistics and in-place softmax-minus-one-hot
    kernels per chunk gives the torch chunk operations' loss and gradients (padding rows of the
    weight: zero gradient; ignored targets: none)."""
    from meshtron.kernels.linear_cross_entropy import linear_cross_entropy_sum

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(17, 24, generator=g), torch.randn(300, 24, generator=g) * 0.3
    target = torch.randint(0, 260, (17,), generator=g)
    target[2] = IGNORE_INDEX
    results = {}
    for backend in ("torch", "triton"):
        xb, wb = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = linear_cross_entropy_sum(xb, wb, target, vocab_size=260, chunk_rows=chunk_rows, backend=backend)
        (loss * 0.5).backward()
        results[backend] = (loss.detach(), xb.grad, wb.grad)
    for a, b in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(results["triton"][2][260:]) == 0


def test_softmax_minus_onehot_in_place():
    logits, target = _case(9, 50, 50)
    lse = torch.logsumexp(logits, dim=1)
    want = torch.softmax(logits, dim=1)
    want[torch.arange(9), target.clamp(min=0)] -= 1
    want[target == IGNORE_INDEX] = 0
    buf = logits.clone()
    out = kce.softmax_minus_onehot_(buf, target, lse)
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
