"""Tests for textdata/data.py: corpus loading, byte tokenizer, deterministic batches."""

from __future__ import annotations

import pathlib
import sysconfig

import pytest
import torch

from meshtron.textdata.data import (
    SEPARATOR,
    ByteTokenizer,
    TokenDataset,
    _split_seed,
    default_corpus_files,
    load_corpus,
)


def _arange_dataset(n: int = 10_000, seq_len: int = 16, seed: int = 0, val_fraction: float = 0.1):
    # Token i has value i (int64) so a window's position in the corpus is readable from it.
    return TokenDataset(torch.arange(n, dtype=torch.int64), seq_len=seq_len, seed=seed, val_fraction=val_fraction)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_dtype():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    ids = tok.encode("héllo")
    assert ids.dtype == torch.int64
    assert ids.tolist() == list("héllo".encode())
    assert tok.decode(ids) == "héllo"
    assert tok.encode(b"\x00\xff").tolist() == [0, 255]
    assert tok.encode("").numel() == 0
    assert tok.decode([104, 105]) == "hi"


def test_tokenizer_decode_replaces_invalid_utf8_and_rejects_out_of_range():
    tok = ByteTokenizer()
    assert tok.decode(torch.tensor([0xC3], dtype=torch.uint8)) == "\ufffd"
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([300])


# ---------------------------------------------------------------- load_corpus


def test_load_corpus_files_and_directories_in_sorted_order(tmp_path: pathlib.Path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_bytes(b"BBB")
    (tmp_path / "d" / "a.txt").write_bytes(b"AA")
    (tmp_path / "d" / "sub" / "c.bin").write_bytes(b"\x00\xff")
    (tmp_path / "d" / ".hidden").write_bytes(b"nope")
    (tmp_path / "d" / "__pycache__").mkdir()
    (tmp_path / "d" / "__pycache__" / "x.pyc").write_bytes(b"nope")
    (tmp_path / "single.txt").write_bytes(b"S")
    out = load_corpus([str(tmp_path / "single.txt"), str(tmp_path / "d")], max_bytes=1000)
    assert out.dtype == torch.uint8 and out.dim() == 1
    expected = SEPARATOR.join([b"S", b"AA", b"BBB", b"\x00\xff"])
    assert bytes(out.tolist()) == expected


def test_load_corpus_truncates_to_max_bytes(tmp_path: pathlib.Path):
    (tmp_path / "a.txt").write_bytes(b"0123456789")
    (tmp_path / "b.txt").write_bytes(b"abcdefghij")
    out = load_corpus([tmp_path], max_bytes=15)
    assert bytes(out.tolist()) == (b"0123456789" + SEPARATOR + b"abcdefghij")[:15]
    assert load_corpus([tmp_path], max_bytes=4).tolist() == list(b"0123")


def test_load_corpus_missing_path(tmp_path: pathlib.Path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=r"nope\.txt.*does not exist"):
        load_corpus([str(missing)], max_bytes=100)


def test_load_corpus_empty_directory(tmp_path: pathlib.Path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty.*contains no files"):
        load_corpus([str(tmp_path / "empty")], max_bytes=100)


def test_load_corpus_bad_arguments(tmp_path: pathlib.Path):
    (tmp_path / "a.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        load_corpus([tmp_path / "a.txt"], max_bytes=100)
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        load_corpus([tmp_path / "a.txt"], max_bytes=0)
    with pytest.raises(ValueError, match="paths list is empty"):
        load_corpus([], max_bytes=10)


def test_default_corpus_is_stdlib_sources():
    files = default_corpus_files()
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    assert all(r.endswith(".py") for r in rel)
    excluded = {"site-packages", "test", "tests", "idlelib"}
    assert not any(excluded & set(pathlib.PurePosixPath(r).parts) for r in rel)
    assert "os.py" in rel


def test_default_corpus_loads_at_least_1mb():
    out = load_corpus(None, max_bytes=2_000_000)
    assert out.dtype == torch.uint8
    assert 1_000_000 <= out.numel() <= 2_000_000
    # Real Python text: mostly printable ASCII.
    assert (out[:100_000] < 128).float().mean() > 0.95


# ---------------------------------------------------------------- TokenDataset


def test_too_small_corpus_error():
    with pytest.raises(ValueError, match=r"train split has 8 tokens.*seq_len\+1 = 17"):
        TokenDataset(torch.arange(8), seq_len=16, seed=0, val_fraction=0.0)
    # Train is big enough but the 1% tail is not.
    with pytest.raises(ValueError, match=r"val split has 10 tokens.*seq_len\+1 = 17"):
        TokenDataset(torch.arange(1000), seq_len=16, seed=0, val_fraction=0.01)


def test_same_seed_step_same_batch_and_different_step_differs():
    ds = _arange_dataset()
    x1, y1 = ds.global_batch(step=3, global_batch_size=8)
    ds2 = _arange_dataset()  # a fresh object, like another process
    x2, y2 = ds2.global_batch(step=3, global_batch_size=8)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    x3, _ = ds.global_batch(step=4, global_batch_size=8)
    assert not torch.equal(x1, x3)
    x4, _ = _arange_dataset(seed=1).global_batch(step=3, global_batch_size=8)
    assert not torch.equal(x1, x4)


def test_seed_derivation_is_stable():
    # Pinned value: batches must not change between runs, processes or Python versions.
    assert _split_seed(0, 0, "train") == _split_seed(0, 0, "train")
    assert _split_seed(0, 0, "train") != _split_seed(0, 0, "val")
    assert _split_seed(1234, 7, "train") == 8241746639182941952


def test_batch_shapes_dtypes_and_shift():
    ds = _arange_dataset(seq_len=16)
    x, y = ds.global_batch(step=0, global_batch_size=8)
    assert x.shape == y.shape == (8, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Token value == position, so each row is a run of consecutive positions.
    assert torch.equal(y, x + 1)


def test_uint8_corpus_gives_int64_batches():
    tokens = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ds = TokenDataset(tokens, seq_len=32, seed=0)
    x, y = ds.global_batch(0, 4)
    assert x.dtype == torch.int64
    start = ds.window_starts(0, 4)[0].item()
    assert x[0].tolist() == tokens[start : start + 32].tolist()
    assert y[0].tolist() == tokens[start + 1 : start + 33].tolist()


@pytest.mark.parametrize("dp_size", [1, 2, 4])
@pytest.mark.parametrize("split", ["train", "val"])
def test_local_batches_concatenate_to_global(dp_size: int, split: str):
    ds = _arange_dataset()
    gx, gy = ds.global_batch(step=11, global_batch_size=8, split=split)
    parts = [ds.local_batch(11, 8, dp_rank=r, dp_size=dp_size, split=split) for r in range(dp_size)]
    assert all(p[0].shape == (8 // dp_size, 16) for p in parts)
    assert torch.equal(torch.cat([p[0] for p in parts]), gx)
    assert torch.equal(torch.cat([p[1] for p in parts]), gy)


def test_local_batch_not_divisible():
    ds = _arange_dataset()
    with pytest.raises(ValueError, match=r"global batch size 6 is not divisible by the data-parallel size 4"):
        ds.local_batch(0, 6, dp_rank=0, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank"):
        ds.local_batch(0, 8, dp_rank=2, dp_size=2)


def test_windows_stay_inside_their_split_and_splits_are_disjoint():
    n, seq_len = 1000, 16
    ds = _arange_dataset(n=n, seq_len=seq_len, val_fraction=0.1)
    assert ds.train_range == (0, 900) and ds.val_range == (900, 1000)
    train_seen, val_seen = set(), set()
    for step in range(50):
        x, y = ds.global_batch(step, 64, split="train")
        train_seen |= set(x.flatten().tolist()) | set(y.flatten().tolist())
        x, y = ds.global_batch(step, 64, split="val")
        val_seen |= set(x.flatten().tolist()) | set(y.flatten().tolist())
    assert max(train_seen) <= 899 and min(train_seen) >= 0
    assert min(val_seen) >= 900 and max(val_seen) <= 999
    assert train_seen.isdisjoint(val_seen)
    # Windows are the non-overlapping chunks [k*16, k*16+17): train has (900-1)//16 = 56 of
    # them, reaching token 56*16 = 896; val has (100-1)//16 = 6, reaching 900 + 96 = 996.
    assert 0 in train_seen and 896 in train_seen and 897 not in train_seen
    assert 900 in val_seen and 996 in val_seen and 997 not in val_seen


def test_tight_split_has_exactly_one_window():
    # 17 tokens and seq_len 16: only start offset 0 exists.
    ds = TokenDataset(torch.arange(17), seq_len=16, seed=0, val_fraction=0.0)
    x, y = ds.global_batch(5, 3)
    assert torch.equal(x, torch.arange(16).expand(3, 16))
    assert torch.equal(y, torch.arange(1, 17).expand(3, 16))
    with pytest.raises(ValueError, match="val_fraction=0"):
        ds.global_batch(0, 1, split="val")


def test_unknown_split():
    with pytest.raises(ValueError, match="unknown split 'test'"):
        _arange_dataset().global_batch(0, 2, split="test")


# ---------------------------------------------------------------- sample-indexed sampling

from meshtron.textdata.data import window_permutation  # noqa: E402


def _starts(ds: TokenDataset, x: torch.Tensor, split: str = "train") -> list[int]:
    # Token value == position, so a row's first input is its window's absolute start.
    offset = ds.train_range[0] if split == "train" else ds.val_range[0]
    return [int(v) - offset for v in x[:, 0]]


def test_window_permutation_is_pinned_and_a_permutation():
    # Pinned: the sample order must not change between runs, machines or library versions.
    assert window_permutation(10, 0).tolist() == [1, 4, 5, 7, 6, 9, 0, 3, 2, 8]
    assert window_permutation(10, 12345).tolist() == [0, 8, 4, 2, 9, 5, 1, 6, 3, 7]
    perm = window_permutation(1000, 7)
    assert perm.dtype.name == "int64" and sorted(perm.tolist()) == list(range(1000))


@pytest.mark.parametrize("split", ["train", "val"])
def test_one_epoch_covers_every_window_once(split: str):
    ds = _arange_dataset(n=2000, seq_len=16, val_fraction=0.25)
    n_win = ds.num_windows(split)
    assert n_win == (len(ds.split_tokens(split)) - 1) // 16
    starts = []
    for step in range(n_win // 5 + 1):  # batch size 5, the last batch runs into epoch 1
        x, y = ds.global_batch(step, 5, split=split)
        assert torch.equal(y, x + 1)
        starts += _starts(ds, x, split)
    first_epoch = starts[:n_win]
    assert sorted(first_epoch) == [k * 16 for k in range(n_win)]
    # The next epoch is a different order of the same windows.
    assert ds.sample_windows(n_win, n_win, split).tolist() != ds.sample_windows(0, n_win, split).tolist()
    assert sorted(ds.sample_windows(n_win, n_win, split).tolist()) == list(range(n_win))


@pytest.mark.parametrize("dp_size", [1, 2, 3, 6])
def test_local_batch_at_concatenates_to_global_across_an_epoch_boundary(dp_size: int):
    ds = _arange_dataset(n=1000, seq_len=16, val_fraction=0.0)
    n_win = ds.num_windows()
    first = n_win - 4  # the 12 samples straddle epochs 0 and 1
    gx, gy = ds.global_batch_at(first, 12)
    parts = [ds.local_batch_at(first, 12, r, dp_size) for r in range(dp_size)]
    assert torch.equal(torch.cat([p[0] for p in parts]), gx)
    assert torch.equal(torch.cat([p[1] for p in parts]), gy)
    assert _starts(ds, gx) == (ds.sample_windows(first, 12) * 16).tolist()


def test_resume_skips_exactly_the_consumed_samples_when_the_batch_size_changes():
    ds = _arange_dataset(n=3000, seq_len=8, val_fraction=0.0)
    one_pass, _ = ds.global_batch_at(0, 60)
    # 5 steps of batch 4 (20 samples), then the run resumes with batch 8 on 2 dp ranks.
    consumed, rows = 0, []
    for _ in range(5):
        rows.append(ds.global_batch_at(consumed, 4)[0])
        consumed += 4
    resumed = TokenDataset(torch.arange(3000), seq_len=8, seed=0, val_fraction=0.0)  # new process
    for _ in range(5):
        parts = [resumed.local_batch_at(consumed, 8, r, 2)[0] for r in range(2)]
        rows.append(torch.cat(parts))
        consumed += 8
    assert consumed == 60
    assert torch.equal(torch.cat(rows), one_pass)


def test_local_batch_by_step_is_local_batch_at_sample_step_times_batch():
    ds = _arange_dataset()
    for split in ("train", "val"):
        a = ds.local_batch(7, 8, dp_rank=1, dp_size=2, split=split)
        b = ds.local_batch_at(56, 8, dp_rank=1, dp_size=2, split=split)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(ds.window_starts(3, 4), ds.sample_starts(12, 4))


def test_sampling_is_deterministic_across_instances_and_seeded():
    a, b = _arange_dataset(seed=5), _arange_dataset(seed=5)
    assert torch.equal(a.global_batch_at(123, 16)[0], b.global_batch_at(123, 16)[0])
    assert not torch.equal(a.global_batch_at(0, 16)[0], _arange_dataset(seed=6).global_batch_at(0, 16)[0])


def test_numpy_tokens_and_bad_inputs():
    import numpy as np

    tokens = np.arange(5000, dtype=np.uint16)
    ds_np = TokenDataset(tokens, seq_len=16, seed=3)
    ds_t = TokenDataset(torch.arange(5000), seq_len=16, seed=3)
    for first in (0, 40, 301):
        xn, yn = ds_np.local_batch_at(first, 8, 1, 2)
        xt, yt = ds_t.local_batch_at(first, 8, 1, 2)
        assert xn.dtype == yn.dtype == torch.int64
        assert torch.equal(xn, xt) and torch.equal(yn, yt)
    with pytest.raises(TypeError, match="integer token ids"):
        TokenDataset(np.zeros(100, dtype=np.float32), seq_len=4, seed=0)
    with pytest.raises(TypeError, match="torch.Tensor or a numpy array"):
        TokenDataset(list(range(100)), seq_len=4, seed=0)
    with pytest.raises(ValueError, match="1-D array"):
        TokenDataset(np.zeros((10, 10), dtype=np.int64), seq_len=4, seed=0)
    with pytest.raises(ValueError, match="first_sample must be >= 0"):
        ds_t.global_batch_at(-1, 4)
    with pytest.raises(ValueError, match="step must be >= 0"):
        ds_t.local_batch(-1, 4, 0, 1)
