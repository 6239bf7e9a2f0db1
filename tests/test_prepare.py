"""Tests for textdata/prepare.py and the prepared-data path of textdata/data.py."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from meshtron.textdata.data import SEPARATOR, TokenDataset, build_dataset, load_corpus, load_prepared
from meshtron.textdata.prepare import load_tokenizer, prepare
from meshtron.training.config import DataConfig

REPO = pathlib.Path(__file__).resolve().parents[1]

DOCS = {
    "a.txt": "hello world\nthis is the first document.\n" * 20,
    "sub/b.py": "def f(x):\n    return x + 1  # héllo ünïcode\n" * 30,
    "c.md": "# Title\n\nA literal <|endoftext|> inside text stays text.\n" * 10,
}
ORDER = ["a.txt", "c.md", "sub/b.py"]  # sorted relative paths


@pytest.fixture
def corpus(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "corpus"
    for rel, text in DOCS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "empty.txt").write_bytes(b"")  # skipped: not a document
    return root


@pytest.fixture
def byte_dir(corpus: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    prepare([corpus], tmp_path / "byte")
    return tmp_path / "byte"


# ---------------------------------------------------------------- prepare


def test_byte_prepare_round_trips_and_writes_the_index(corpus: pathlib.Path, byte_dir: pathlib.Path):
    contents = [DOCS[rel].encode() for rel in ORDER]
    expected = b"".join(c + SEPARATOR for c in contents)
    raw = (byte_dir / "tokens.bin").read_bytes()
    assert raw == np.frombuffer(expected, dtype=np.uint8).astype("<u2").tobytes()

    tokens, info = load_prepared(byte_dir)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.dtype("<u2")
    assert bytes(tokens.astype(np.uint8)) == expected
    index = json.loads((byte_dir / "index.json").read_text())
    assert info == dict(index, dir=str(byte_dir))
    assert index["format"] == "meshtron-tokens" and index["version"] == 1
    assert index["dtype"] == "uint16" and index["byte_order"] == "little"
    assert index["tokenizer"] == "byte" and index["vocab_size"] == 256
    assert index["n_tokens"] == len(expected) and index["bytes"] == 2 * len(expected)
    assert index["sha256"] == hashlib.sha256(raw).hexdigest()
    assert index["eod_ids"] == list(SEPARATOR)
    assert index["sources"] == [str(corpus.resolve())]
    assert index["n_documents"] == 3
    starts = np.cumsum([0] + [len(c) + len(SEPARATOR) for c in contents[:-1]]).tolist()
    assert [
        (pathlib.Path(d["path"]).relative_to(corpus).as_posix(), d["start"], d["length"]) for d in index["documents"]
    ] == [(rel, s, len(c)) for rel, s, c in zip(ORDER, starts, contents)]
    assert not (byte_dir / "tokenizer.json").exists()
    assert load_tokenizer(byte_dir).decode(tokens[: len(contents[0])]) == DOCS["a.txt"]
    # Nothing temporary left beside the output.
    assert sorted(p.name for p in byte_dir.parent.iterdir()) == ["byte", "corpus"]


def test_byte_prepare_max_bytes_and_single_files(corpus: pathlib.Path, tmp_path: pathlib.Path):
    info = prepare([corpus / "c.md", corpus / "a.txt"], tmp_path / "out", max_bytes=len(DOCS["c.md"]) + 5)
    tokens, _ = load_prepared(tmp_path / "out")
    expected = DOCS["c.md"].encode() + SEPARATOR + DOCS["a.txt"].encode()[:5] + SEPARATOR
    assert bytes(tokens.astype(np.uint8)) == expected
    assert info["n_documents"] == 2 and info["max_bytes"] == len(DOCS["c.md"]) + 5


def test_bpe_prepare_respects_vocab_and_round_trips(corpus: pathlib.Path, tmp_path: pathlib.Path):
    pytest.importorskip("tokenizers")
    out = tmp_path / "bpe"
    info = prepare([corpus], out, tokenizer="bpe", vocab_size=300, min_frequency=1)
    tokens, loaded = load_prepared(out)
    assert loaded["tokenizer"] == "bpe" and loaded["dtype"] == "uint16"
    assert (out / "tokenizer.json").is_file() and loaded["tokenizer_file"] == "tokenizer.json"
    assert 257 <= info["vocab_size"] <= 300
    assert int(tokens.max()) < info["vocab_size"]
    assert len(tokens) < sum(len(t.encode()) for t in DOCS.values())  # merges compress
    tok = load_tokenizer(out)
    assert tok.vocab_size == info["vocab_size"]
    eod = info["eod_ids"]
    assert len(eod) == 1 and eod[0] == tok.eod_id
    # One end-of-document token per document: a literal "<|endoftext|>" in c.md is text.
    assert int((tokens == eod[0]).sum()) == 3
    for doc, rel in zip(info["documents"], ORDER):
        ids = tokens[doc["start"] : doc["start"] + doc["length"]]
        assert tok.decode(ids) == DOCS[rel]
        assert tokens[doc["start"] + doc["length"]] == eod[0]
    assert tok.encode(DOCS["a.txt"]).tolist() == tokens[: info["documents"][0]["length"]].tolist()


def test_prepare_argument_errors(corpus: pathlib.Path, tmp_path: pathlib.Path, byte_dir: pathlib.Path):
    with pytest.raises(ValueError, match="does not apply to the byte tokenizer"):
        prepare([corpus], tmp_path / "x", vocab_size=1000)
    with pytest.raises(ValueError, match="at least 257"):
        prepare([corpus], tmp_path / "x", tokenizer="bpe", vocab_size=100)
    with pytest.raises(ValueError, match="unknown tokenizer 'wordpiece'"):
        prepare([corpus], tmp_path / "x", tokenizer="wordpiece")
    with pytest.raises(FileNotFoundError, match=r"nope.*does not exist; fix --src"):
        prepare([tmp_path / "nope"], tmp_path / "x")
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "e.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        prepare([tmp_path / "zero"], tmp_path / "x")
    with pytest.raises(ValueError, match="pass --overwrite"):
        prepare([corpus], byte_dir)
    # Failures leave neither the output nor a temporary directory behind.
    assert not (tmp_path / "x").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_prepare_overwrite_replaces_and_excludes_its_own_output(corpus: pathlib.Path, byte_dir: pathlib.Path):
    info = prepare([corpus / "a.txt"], byte_dir, overwrite=True)
    assert info["n_documents"] == 1
    assert load_prepared(byte_dir)[1]["n_tokens"] == len(DOCS["a.txt"]) + len(SEPARATOR)
    # An output inside the source folder is never read back in.
    inside = corpus / "prepared"
    prepare([corpus], inside)
    first = load_prepared(inside)[1]["n_tokens"]
    assert prepare([corpus], inside, overwrite=True)["n_tokens"] == first


def test_bpe_without_tokenizers_package(corpus: pathlib.Path, tmp_path: pathlib.Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import raises ImportError
    with pytest.raises(ImportError, match="pip install tokenizers"):
        prepare([corpus], tmp_path / "x", tokenizer="bpe")
    assert not (tmp_path / "x").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "meshtron.textdata.prepare", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli(corpus: pathlib.Path, tmp_path: pathlib.Path):
    out = tmp_path / "cli"
    done = _cli("--src", str(corpus / "a.txt"), str(corpus / "sub"), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "uint16 tokens (2 documents, byte tokenizer, vocab_size 256)" in done.stdout
    tokens, info = load_prepared(out)
    assert bytes(tokens.astype(np.uint8)) == b"".join(DOCS[r].encode() + SEPARATOR for r in ("a.txt", "sub/b.py"))
    done = _cli("--src", str(tmp_path / "missing"), "--out", str(tmp_path / "o2"))
    assert done.returncode == 2
    assert "meshtron-prepare: error:" in done.stderr and "missing" in done.stderr
    assert not (tmp_path / "o2").exists()


def test_cli_bpe(corpus: pathlib.Path, tmp_path: pathlib.Path):
    pytest.importorskip("tokenizers")
    out = tmp_path / "bpe"
    done = _cli("--src", str(corpus), "--out", str(out), "--tokenizer", "bpe", "--vocab-size", "280")
    assert done.returncode == 0, done.stderr
    _, info = load_prepared(out)
    assert info["tokenizer"] == "bpe" and info["vocab_size"] <= 280


# ---------------------------------------------------------------- the memory-mapped dataset


def test_memmap_dataset_gives_the_in_memory_batches(byte_dir: pathlib.Path):
    tokens, _ = load_prepared(byte_dir)
    mapped = TokenDataset(tokens, seq_len=16, seed=9, val_fraction=0.1)
    assert isinstance(mapped.split_tokens("train"), np.memmap)  # a view: nothing was read
    memory = TokenDataset(torch.from_numpy(np.array(tokens, dtype=np.int64)), seq_len=16, seed=9, val_fraction=0.1)
    for split in ("train", "val"):
        for first in (0, 13, 200):
            for rank in range(2):
                a = mapped.local_batch_at(first, 8, rank, 2, split)
                b = memory.local_batch_at(first, 8, rank, 2, split)
                assert a[0].dtype == torch.int64
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_build_dataset_from_paths_and_prepared(corpus: pathlib.Path, byte_dir: pathlib.Path):
    from_paths = build_dataset(DataConfig(paths=[str(corpus)], val_fraction=0.05), 16, 1, 256)
    assert torch.equal(from_paths.split_tokens("train"), load_corpus([corpus], 16_000_000)[: from_paths.train_range[1]])
    # prepared wins over paths/max_bytes.
    ds = build_dataset(DataConfig(paths=["/nonexistent"], max_bytes=1, prepared=str(byte_dir)), 16, 1, 256)
    assert isinstance(ds.split_tokens("train"), np.memmap)
    assert ds.val_range[1] == load_prepared(byte_dir)[1]["n_tokens"]


def test_build_dataset_vocab_too_big_for_the_model(corpus: pathlib.Path, byte_dir: pathlib.Path, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"byte tokenizer of data.prepared=.* has vocab_size 256 but "
        r"model.vocab_size=200; set model.vocab_size=256 or larger",
    ):
        build_dataset(DataConfig(prepared=str(byte_dir)), 16, 0, 200)
    with pytest.raises(ValueError, match=r"the byte tokenizer has vocab_size 256 but model.vocab_size=100"):
        build_dataset(DataConfig(paths=[str(corpus)]), 16, 0, 100)
    pytest.importorskip("tokenizers")
    prepare([corpus], tmp_path / "bpe", tokenizer="bpe", vocab_size=300, min_frequency=1)
    v = load_prepared(tmp_path / "bpe")[1]["vocab_size"]
    with pytest.raises(
        ValueError,
        match=rf"bpe tokenizer .* vocab_size {v} but model.vocab_size=256; "
        rf"set model.vocab_size={v} or larger .*--vocab-size",
    ):
        build_dataset(DataConfig(prepared=str(tmp_path / "bpe")), 16, 0, 256)
    assert build_dataset(DataConfig(prepared=str(tmp_path / "bpe"), val_fraction=0.1), 16, 0, v).num_windows() > 0


# ---------------------------------------------------------------- load_prepared errors


def _edit_index(directory: pathlib.Path, **changes) -> None:
    path = directory / "index.json"
    index = json.loads(path.read_text())
    index.update(changes)
    path.write_text(json.dumps(index))


def test_load_prepared_missing_things(tmp_path: pathlib.Path, byte_dir: pathlib.Path):
    with pytest.raises(
        FileNotFoundError,
        match=r"prepared data directory .*nowhere.* does not exist; "
        r"create it with `python -m meshtron.textdata.prepare",
    ):
        load_prepared(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        load_prepared(tmp_path / "file")
    (byte_dir / "tokens.bin").unlink()
    with pytest.raises(FileNotFoundError, match=r"tokens\.bin is missing; re-run `python -m meshtron.textdata.prepare"):
        load_prepared(byte_dir)
    (byte_dir / "index.json").unlink()
    with pytest.raises(
        FileNotFoundError,
        match=r"index\.json is missing: .* not a complete prepared data "
        r"directory .*interrupted",
    ):
        load_prepared(byte_dir)


def test_load_prepared_empty_and_truncated_token_files(byte_dir: pathlib.Path):
    path = byte_dir / "tokens.bin"
    raw = path.read_bytes()
    path.write_bytes(raw[:-1])
    with pytest.raises(
        ValueError,
        match=r"tokens\.bin has \d+ bytes, not a multiple of 2 \(uint16\): "
        r"the file is truncated",
    ):
        load_prepared(byte_dir)
    path.write_bytes(raw[:-2])
    with pytest.raises(
        ValueError,
        match=r"tokens\.bin has \d+ bytes = \d+ uint16 tokens but index\.json "
        r"says n_tokens=\d+ .*truncated",
    ):
        load_prepared(byte_dir)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"tokens\.bin is empty \(0 bytes\); re-run"):
        load_prepared(byte_dir)


def test_load_prepared_wrong_dtype_and_bad_index(byte_dir: pathlib.Path):
    n = load_prepared(byte_dir)[1]["n_tokens"]
    _edit_index(byte_dir, dtype="uint32")  # the file holds uint16: sizes disagree
    with pytest.raises(ValueError, match=r"says n_tokens=\d+ .*different dtype"):
        load_prepared(byte_dir)
    _edit_index(byte_dir, dtype="float32")
    with pytest.raises(ValueError, match=r"unknown token dtype 'float32'; expected one of uint16, uint32"):
        load_prepared(byte_dir)
    _edit_index(byte_dir, dtype="uint16", n_tokens="many")
    with pytest.raises(ValueError, match=r"field 'n_tokens' must be a int, got 'many'"):
        load_prepared(byte_dir)
    _edit_index(byte_dir, n_tokens=0)
    with pytest.raises(ValueError, match=r"n_tokens=0, the prepared corpus is empty"):
        load_prepared(byte_dir)
    _edit_index(byte_dir, n_tokens=n, vocab_size=70_000)
    with pytest.raises(ValueError, match=r"vocab_size=70000 does not fit dtype uint16"):
        load_prepared(byte_dir)
    _edit_index(byte_dir, vocab_size=256, version=99)
    with pytest.raises(ValueError, match=r"format version 99 but this meshtron reads version 1"):
        load_prepared(byte_dir)
    _edit_index(byte_dir, version=1, format="something-else")
    with pytest.raises(ValueError, match=r"is not a meshtron token index"):
        load_prepared(byte_dir)
    (byte_dir / "index.json").write_text('{"format": "meshtron-tokens", ')
    with pytest.raises(
        ValueError, match=r"index\.json is not valid JSON .*re-run `python -m meshtron.textdata.prepare"
    ):
        load_prepared(byte_dir)


def test_load_prepared_checksum(byte_dir: pathlib.Path):
    load_prepared(byte_dir, verify_checksum=True)
    path = byte_dir / "tokens.bin"
    raw = bytearray(path.read_bytes())
    raw[0] ^= 1
    path.write_bytes(bytes(raw))
    load_prepared(byte_dir)  # size still matches: only the checksum notices
    with pytest.raises(ValueError, match="does not match the SHA-256"):
        load_prepared(byte_dir, verify_checksum=True)


# ---------------------------------------------------------------- token ids vs the vocabulary


def _hand_made_dir(directory: pathlib.Path, ids: list[int], vocab_size: int) -> pathlib.Path:
    """A prepared directory written without meshtron-prepare: an index without max_token_id."""
    directory.mkdir()
    (directory / "tokens.bin").write_bytes(np.asarray(ids, dtype="<u2").tobytes())
    index = {
        "format": "meshtron-tokens",
        "version": 1,
        "dtype": "uint16",
        "n_tokens": len(ids),
        "vocab_size": vocab_size,
        "tokenizer": "byte",
    }
    (directory / "index.json").write_text(json.dumps(index))
    return directory


def test_prepare_records_the_max_token_id(corpus: pathlib.Path, byte_dir: pathlib.Path, tmp_path: pathlib.Path):
    index = json.loads((byte_dir / "index.json").read_text())
    tokens, info = load_prepared(byte_dir)
    assert index["max_token_id"] == int(tokens.max()) == info["max_token_id"] == 0xC3  # UTF-8 lead byte
    pytest.importorskip("tokenizers")
    bpe = prepare([corpus], tmp_path / "bpe", tokenizer="bpe", vocab_size=300, min_frequency=1)
    assert bpe["max_token_id"] == int(load_prepared(tmp_path / "bpe")[0].max()) < bpe["vocab_size"]


def test_an_index_without_max_token_id_is_read_and_checked(byte_dir: pathlib.Path, tmp_path: pathlib.Path):
    index = json.loads((byte_dir / "index.json").read_text())
    del index["max_token_id"]  # written before prepare recorded it
    (byte_dir / "index.json").write_text(json.dumps(index))
    assert load_prepared(byte_dir)[1]["max_token_id"] == 0xC3
    # ids inside the padded vocabulary (300 pads to 384) but not below the index's vocab_size
    lying = _hand_made_dir(tmp_path / "lying", [1, 2, 383, 4] * 10, vocab_size=300)
    with pytest.raises(
        ValueError,
        match=r"lying/tokens\.bin holds token ids up to 383 but index\.json says "
        r"vocab_size=300: .*re-run",
    ):
        load_prepared(lying)
    _edit_index(byte_dir, max_token_id=256)
    with pytest.raises(ValueError, match=r"tokens\.bin holds token ids up to 256 but index\.json says vocab_size=256"):
        load_prepared(byte_dir)
    _edit_index(byte_dir, max_token_id=-1)
    with pytest.raises(ValueError, match=r"field 'max_token_id' must be a non-negative int, got -1"):
        load_prepared(byte_dir)


def test_build_dataset_refuses_ids_the_model_cannot_embed(corpus: pathlib.Path, tmp_path: pathlib.Path):
    from meshtron.errors import ConfigError

    honest = _hand_made_dir(tmp_path / "honest", list(range(384)) * 2, vocab_size=384)
    with pytest.raises(
        ConfigError,
        match=r"has vocab_size 384 but model.vocab_size=300; set model.vocab_size=384 "
        r"or larger \(or re-run meshtron-prepare with a smaller --vocab-size\): "
        r".*honest/tokens\.bin holds token ids up to 383",
    ):
        build_dataset(DataConfig(prepared=str(honest)), 16, 0, 300)
    assert build_dataset(DataConfig(prepared=str(honest), val_fraction=0.1), 16, 0, 384).num_windows() > 0
    # Raw files are checked as they are read: the message names the file with the id.
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_bytes(b"plain ascii " * 10)
    (tmp_path / "raw" / "b.bin").write_bytes(bytes([1, 2, 250]) * 10)
    with pytest.raises(
        ConfigError,
        match=r"data file '.*raw/b\.bin' has byte token ids up to 250, and the byte "
        r"tokenizer has vocab_size 256 but model.vocab_size=200",
    ):
        build_dataset(DataConfig(paths=[str(tmp_path / "raw")]), 8, 0, 200)
    assert (
        build_dataset(DataConfig(paths=[str(tmp_path / "raw" / "a.txt")], val_fraction=0.1), 8, 0, 200).num_windows()
        > 0
    )


# ---------------------------------------------------------------- bad input: one line, exit 2


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--src", "{tmp}/nofiles"], r"data directory '.*nofiles' contains no files"),
        (["--src", "{tmp}/zero"], r"the corpus read from .*zero is empty"),
        (["--src", "/dev/null"], r"data path '/dev/null' is neither a regular file nor a directory"),
        (["--out", "{tmp}/afile"], r"--out '.*afile' exists and is not a directory"),
        (["--out", "{tmp}/afile/sub"], r"--out '.*afile/sub': cannot write into '.*afile'"),
        (["--out", "{byte_dir}"], r"--out '.*byte' exists and is not empty; pass --overwrite"),
        (["--vocab-size", "300"], r"--vocab-size 300 does not apply to the byte tokenizer"),
        (["--tokenizer", "bpe", "--vocab-size", "100"], r"--vocab-size 100 is too small .* at least 257"),
        (["--tokenizer", "bpe", "--vocab-size", "99999999999"], r"--vocab-size 99999999999 is too large"),
        (["--tokenizer", "bpe", "--min-frequency", "-1"], r"--min-frequency must be >= 0, got -1"),
        (["--max-bytes", "0"], r"--max-bytes must be positive, got 0"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, expected, corpus, byte_dir, tmp_path, capsys):
    import re

    from meshtron.textdata.prepare import main

    (tmp_path / "nofiles").mkdir()
    (tmp_path / "nofiles" / ".hidden").write_text("skipped")
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "e.txt").write_bytes(b"")
    (tmp_path / "afile").write_text("a file, not a directory")
    before = {p: p.read_bytes() for p in byte_dir.iterdir()}
    argv = [a.format(tmp=tmp_path, byte_dir=byte_dir) for a in args]
    argv = (["--src", str(corpus)] if "--src" not in argv else []) + argv
    argv += ["--out", str(tmp_path / "new")] if "--out" not in argv else []
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshtron-prepare: error: "), lines
    assert re.search(expected, lines[0]), lines[0]
    assert {p: p.read_bytes() for p in byte_dir.iterdir()} == before  # nothing saved is touched
    assert (tmp_path / "afile").read_text() == "a file, not a directory"
    assert not (tmp_path / "new").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cli_failed_overwrite_keeps_the_old_prepared_dir(byte_dir: pathlib.Path, tmp_path: pathlib.Path):
    before = {p.name: p.read_bytes() for p in byte_dir.iterdir()}
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "e.txt").write_bytes(b"")
    done = _cli("--src", str(tmp_path / "zero"), "--out", str(byte_dir), "--overwrite")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"meshtron-prepare: error: the corpus read from {tmp_path / 'zero'} is empty (all files have 0 bytes)"
    ]
    assert {p.name: p.read_bytes() for p in byte_dir.iterdir()} == before
    load_prepared(byte_dir, verify_checksum=True)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# ---------------------------------------------------------------- a model's own tokenizer (hf:FOLDER)


def _hf_tokenizer_folder(folder: pathlib.Path, eos: bool = True) -> pathlib.Path:
    """A tiny byte-level BPE saved as a transformers fast tokenizer (eos <|endoftext|>, or none)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<pad>", "<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS.values(), trainer=trainer)
    special = {"eos_token": "<|endoftext|>"} if eos else {}
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(folder)
    return folder


def test_hf_tokenizer_prepare_records_it(corpus: pathlib.Path, tmp_path: pathlib.Path):
    folder = _hf_tokenizer_folder(tmp_path / "tok")
    info = prepare([corpus], tmp_path / "out", tokenizer=f"hf:{folder}")
    assert (info["tokenizer"], info["vocab_size"], info["eos_id"], info["eod_ids"]) == ("hf", 280, 1, [1])
    assert info["tokenizer_source"] == str(folder.resolve()) and info["eod_token"] == "<|endoftext|>"
    saved = (tmp_path / "out" / "tokenizer.json").read_bytes()
    assert info["tokenizer_sha256"] == hashlib.sha256(saved).hexdigest()
    tokens, _ = load_prepared(tmp_path / "out")
    tok = load_tokenizer(tmp_path / "out")
    ids = np.asarray(tokens)
    assert (ids == 1).sum() == len(ORDER)  # one eos per document; the spelled-out one in c.md is text
    first = ids[: info["documents"][0]["length"]]
    assert tok.decode(first) == DOCS["a.txt"]


def test_hf_tokenizer_errors(corpus: pathlib.Path, tmp_path: pathlib.Path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        prepare([corpus], tmp_path / "x", tokenizer=f"hf:{tmp_path / 'nope'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="the folder has no tokenizer files"):
        prepare([corpus], tmp_path / "x", tokenizer=f"hf:{tmp_path / 'empty'}")
    with pytest.raises(ValueError, match="needs a folder"):
        prepare([corpus], tmp_path / "x", tokenizer="hf:")
    folder = _hf_tokenizer_folder(tmp_path / "tok")
    with pytest.raises(ValueError, match="does not apply to --tokenizer hf:"):
        prepare([corpus], tmp_path / "x", tokenizer=f"hf:{folder}", vocab_size=300)
    no_eos = _hf_tokenizer_folder(tmp_path / "no_eos", eos=False)
    with pytest.raises(ValueError, match="has no eos_token"):
        prepare([corpus], tmp_path / "x", tokenizer=f"hf:{no_eos}")
    assert not (tmp_path / "x").exists()
