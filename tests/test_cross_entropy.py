"""mpu.cross_entropy (the torch path): one chunked pass and one all-gather of [3, N] statistics,
against F.cross_entropy on the full logits: values and gradients, padding, ignored targets,
chunked vs unchunked, 16-bit inputs and a two-way vocabulary split with a fake all-gather."""

import pytest
import torch
import torch.nn.functional as F

import meshtron.mpu.cross_entropy as ce
from meshtron.mpu.cross_entropy import IGNORE_INDEX, local_statistics, vocab_parallel_cross_entropy


def _case(rows, vocab, padded, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, padded, generator=g) * 3
    logits[:, vocab:] = torch.randn(rows, padded - vocab, generator=g) * 3 + 5  # padding must not matter
    target = torch.randint(0, vocab, (rows,), generator=g)
    target[0] = vocab - 1
    target[1] = IGNORE_INDEX
    dloss = torch.rand(rows, generator=g) + 0.5
    return logits, target, dloss


def _reference(logits, target, vocab, dloss):
    ref = logits[:, :vocab].clone().requires_grad_(True)
    loss = F.cross_entropy(ref, target, reduction="none", ignore_index=IGNORE_INDEX)
    (loss * dloss).sum().backward()
    return loss.detach(), ref.grad


@pytest.mark.parametrize("vocab,padded", [(7, 8), (100, 128), (300, 384)])
@pytest.mark.parametrize("chunk", [ce.CHUNK_ELEMENTS, 300, 1])  # one chunk, several rows each, one row each
def test_matches_torch(monkeypatch, vocab, padded, chunk):
    monkeypatch.setattr(ce, "CHUNK_ELEMENTS", chunk)
    logits, target, dloss = _case(13, vocab, padded, seed=vocab + chunk)
    want, want_grad = _reference(logits, target, vocab, dloss)
    x = logits.clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x * 1.0, target, vocab_size=vocab)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    (loss * dloss).sum().backward()
    torch.testing.assert_close(x.grad[:, :vocab], want_grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(x.grad[:, vocab:], torch.zeros_like(x.grad[:, vocab:]))  # padding: exactly 0
    assert loss[1] == 0 and torch.equal(x.grad[1], torch.zeros(padded))  # ignored row
    assert torch.equal(logits, x.detach())  # the logits are left as they were


def test_chunked_equals_unchunked():
    """Chunking changes only which rows are processed together: identical statistics."""
    logits, target, _ = _case(9, 100, 128)
    one = local_statistics(logits, target, 0, 100, chunk_elements=10**9)
    for chunk in (1, 100, 250):
        torch.testing.assert_close(local_statistics(logits, target, 0, 100, chunk_elements=chunk), one, rtol=0, atol=0)


def test_gpu_chunks_cover_a_microbatch():
    """On a GPU a 4,096-token microbatch of gpt_1b's tp=4 vocabulary shard (12,672 columns) is
    one chunk; the CPU keeps cache-sized chunks."""
    assert ce.chunk_elements_for("cuda") // 12672 >= 4096
    assert ce.chunk_elements_for("cpu") == ce.CHUNK_ELEMENTS < 12672 * 64


def test_batched_shape_and_half_precision():
    logits, target, dloss = _case(12, 100, 128, seed=3)
    want, want_grad = _reference(logits.bfloat16().float(), target, 100, dloss)
    x = logits.bfloat16().reshape(3, 4, 128).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(x, target.reshape(3, 4), vocab_size=100)
    assert loss.dtype == torch.float32 and loss.shape == (3, 4)
    torch.testing.assert_close(loss.reshape(-1), want, rtol=1e-5, atol=1e-5)
    (loss.reshape(-1) * dloss).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.reshape(12, 128)[:, :100].float(), want_grad, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("vocab,padded", [(100, 128), (300, 384), (5, 256)])  # (5, 256): rank 1 all padding
def test_two_way_split_with_fake_all_gather(monkeypatch, vocab, padded):
    """Each half runs the whole Function with `all_gather_stats` replaced by a fake returning
    both ranks' statistics: one collective of [3, rows], and loss and gradient slices equal
    the unsplit reference."""
    logits, target, dloss = _case(17, vocab, padded, seed=vocab + 1)
    want, want_grad = _reference(logits, target, vocab, dloss)
    width = padded // 2
    shards = [(logits[:, s : s + width], s) for s in (0, width)]
    stats = [local_statistics(shard, target, start, max(0, min(width, vocab - start))) for shard, start in shards]
    monkeypatch.setattr(ce, "group_size", lambda group: 2)
    grads = []
    for rank, (shard, start) in enumerate(shards):
        calls = []

        def fake(x, group):
            calls.append(tuple(x.shape))
            torch.testing.assert_close(x, stats[rank], rtol=0, atol=0)
            return torch.stack(stats)

        monkeypatch.setattr(ce, "all_gather_stats", fake)
        x = shard.clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(x * 1.0, target, vocab_start=start, vocab_size=vocab, group="tp")
        assert calls == [(3, 17)]
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
        (loss * dloss).sum().backward()
        grads.append(x.grad)
    grad = torch.cat(grads, dim=-1)
    torch.testing.assert_close(grad[:, :vocab], want_grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(grad[:, vocab:], torch.zeros_like(grad[:, vocab:]))
