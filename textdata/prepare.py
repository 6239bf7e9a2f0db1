"""Tokenize text files or folders into a memory-mapped token file: ``python -m meshtron.textdata.prepare``.

    python -m meshtron.textdata.prepare --src corpus/ notes.txt --out data/corpus              # byte tokens
    python -m meshtron.textdata.prepare --src corpus/ --out data/bpe --tokenizer bpe --vocab-size 8192
    python -m meshtron.textdata.prepare --out data/stdlib --max-bytes 16000000                 # stdlib sources
    python -m meshtron.textdata.prepare --src corpus/ --out data/gpt2 --tokenizer hf:models/gpt2   # a model's own

Each file is one document (folders are walked recursively in sorted order, hidden files and
``__pycache__`` skipped, like ``data.paths``), followed by an end-of-document separator. The
output directory holds

* ``tokens.bin``: the token ids, raw little-endian uint16 (vocab_size <= 65536) or uint32;
* ``index.json``: format and version, dtype, ``n_tokens``, the documents (path, start,
  length), tokenizer kind, ``vocab_size`` and ``max_token_id`` (the largest id written,
  checked against the model's vocabulary at load), the end-of-document ids, the sources, and the
  byte size and SHA-256 of ``tokens.bin``;
* ``tokenizer.json`` for ``--tokenizer bpe`` and ``hf:FOLDER`` (a Hugging Face ``tokenizers`` file).

Tokenizers: ``byte`` (built in, ids are the bytes, vocab 256, the separator is
``b"\\n\\n"`` exactly as in the in-memory corpus) or ``bpe``: a byte-level BPE trained
offline on the same corpus with Hugging Face ``tokenizers`` (``pip install tokenizers``),
whose separator is the special token ``<|endoftext|>`` (id 0). BPE input is decoded as
UTF-8 (invalid bytes become U+FFFD).

``hf:FOLDER`` tokenizes with a model's own tokenizer: FOLDER is a Hugging Face folder
(``tokenizer.json``, or ``vocab.json`` + ``merges.txt``, with ``tokenizer_config.json``) loaded
with ``transformers.AutoTokenizer`` (fast tokenizers only, local files only). Documents are
encoded without special tokens (no BOS) and each is followed by the tokenizer's EOS token,
which must exist; text that spells a special token is encoded as text. ``index.json`` records
``tokenizer: "hf"``, the folder (``tokenizer_source``), the tokenizer class, ``vocab_size``
(every id of the tokenizer, added tokens included), ``eos_id``/``eos_token``, ``bos_id`` and the
SHA-256 of the tokenizer file copied into the output.

Everything is written into a hidden temporary directory beside ``--out`` which is renamed
into place at the end, so an interrupted run never leaves a directory that looks valid.
Train on it with ``data.prepared=DIR``; ``load_prepared`` memory-maps it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence

import numpy as np

from meshtron.textdata.data import (
    INDEX_FILE,
    PREPARED_DTYPES,
    PREPARED_FORMAT,
    PREPARED_VERSION,
    SEPARATOR,
    TOKENIZER_FILE,
    TOKENS_FILE,
    ByteTokenizer,
    default_corpus_files,
    expand_paths,
    load_prepared,
    token_dtype_for_vocab,
)

__all__ = ["BPETokenizer", "HFTokenizer", "load_prepared", "load_tokenizer", "main", "prepare"]

TOKENIZERS = ("byte", "bpe", "hf:FOLDER")
HF_PREFIX = "hf:"
EOD_TOKEN = "<|endoftext|>"
DEFAULT_BPE_VOCAB = 8192
# 256 byte symbols + the end-of-document token.
MIN_BPE_VOCAB = 257
_CHUNK = 1 << 24


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError(
            "--tokenizer bpe needs the Hugging Face `tokenizers` package, which is not "
            "installed; `pip install tokenizers` (or `pip install -e '.[hf]'`), or use "
            "--tokenizer byte"
        ) from err
    return tokenizers


class BPETokenizer:
    """A trained byte-level BPE (``tokenizer.json``) with ``ByteTokenizer``'s interface."""

    def __init__(self, path: str | os.PathLike[str], eod_id: int | None = None) -> None:
        tokenizers = _import_tokenizers()
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        if hasattr(self._tok, "encode_special_tokens"):
            self._tok.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size()
        self.eod_id = self._tok.token_to_id(EOD_TOKEN) if eod_id is None else eod_id

    def encode(self, text: str | bytes):
        import torch

        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", errors="replace")
        return torch.tensor(self._tok.encode(text).ids, dtype=torch.int64)

    def decode(self, ids) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.reshape(-1).tolist()
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class HFTokenizer:
    """A Hugging Face model folder's fast tokenizer (``transformers.AutoTokenizer``, local
    files only): ``backend`` is its ``tokenizers.Tokenizer``; ``vocab_size`` covers every id
    (added tokens included); ``eod_id`` is its EOS id. ValueError naming the folder when it
    has no readable fast tokenizer or no EOS token."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        root = pathlib.Path(folder).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(
                f"--tokenizer hf:{folder}: {str(root)!r} is not a directory (give a Hugging "
                f"Face model folder with tokenizer.json or vocab.json + merges.txt)"
            )
        try:
            import transformers
        except ImportError as err:
            raise ImportError("--tokenizer hf:FOLDER needs `transformers`; pip install 'meshtron[hf]'") from err
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(root), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"--tokenizer hf:{folder}: transformers cannot load a tokenizer from it ({err})") from None
        if not getattr(tok, "is_fast", False):
            raise ValueError(
                f"--tokenizer hf:{folder}: {type(tok).__name__} is not a fast tokenizer; save the "
                f"folder with a tokenizer.json (a *TokenizerFast)"
            )
        if tok.eos_token_id is None:
            raise ValueError(
                f"--tokenizer hf:{folder}: the tokenizer has no eos_token, which prepare writes "
                f"after every document; set eos_token in its tokenizer_config.json"
            )
        self.source = str(root.resolve())
        self.class_name = type(tok).__name__
        self.backend = tok.backend_tokenizer
        if hasattr(self.backend, "encode_special_tokens"):
            self.backend.encode_special_tokens = True  # a literal "<|endoftext|>" in a file is just text
        self.vocab_size = max(len(tok), max(tok.get_vocab().values()) + 1)
        self.eod_id = int(tok.eos_token_id)
        self.eos_token = str(tok.eos_token)
        self.bos_id = tok.bos_token_id

    def encode_batch(self, texts: list[str]):
        """Ids of each text, without special tokens."""
        return self.backend.encode_batch(texts, add_special_tokens=False)


def load_tokenizer(directory: str | os.PathLike[str]) -> ByteTokenizer | BPETokenizer:
    """The tokenizer a prepared directory was written with (validates the directory)."""
    _, info = load_prepared(directory)
    if info["tokenizer"] == "byte":
        return ByteTokenizer()
    if info["tokenizer"] in ("bpe", "hf"):
        path = pathlib.Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; re-run python -m meshtron.textdata.prepare")
        return BPETokenizer(path, eod_id=info["eod_ids"][0] if info["tokenizer"] == "hf" else None)
    raise ValueError(f"{pathlib.Path(directory) / INDEX_FILE}: unknown tokenizer {info['tokenizer']!r}")


# ---------------------------------------------------------------- reading


def _source_files(src: Sequence[str] | None, out: pathlib.Path) -> tuple[list[pathlib.Path], list[str]]:
    if src is None:
        files = default_corpus_files()
        sources = ["<python stdlib .py sources>"]
    else:
        if len(src) == 0:
            raise ValueError("--src needs at least one file or directory")
        files = expand_paths(src, key="--src")
        sources = [str(pathlib.Path(s).expanduser().resolve()) for s in src]
    # Never read our own output (or its temporary siblings) back in.
    out_resolved = out.resolve()
    files = [f for f in files if out_resolved not in f.resolve().parents]
    if not files:
        raise ValueError(f"no input files left after leaving out the output directory {out}")
    return files, sources


def _byte_chunks(files: list[pathlib.Path], max_bytes: int | None) -> Iterator[tuple[pathlib.Path, Iterator[bytes]]]:
    """Per non-empty file, an iterator over its bytes in chunks, within the max_bytes budget."""
    budget = [max_bytes if max_bytes is not None else float("inf")]

    def read(path: pathlib.Path, first: bytes) -> Iterator[bytes]:
        yield first
        with open(path, "rb") as f:
            f.seek(len(first))
            while budget[0] > 0:
                block = f.read(int(min(_CHUNK, budget[0])))
                if not block:
                    return
                budget[0] -= len(block)
                yield block

    for path in files:
        if budget[0] <= 0:
            return
        with open(path, "rb") as f:
            first = f.read(int(min(_CHUNK, budget[0])))
        if not first:
            continue
        budget[0] -= len(first)
        yield path, read(path, first)


def _documents_text(files: list[pathlib.Path], max_bytes: int | None) -> Iterator[tuple[pathlib.Path, str]]:
    for path, chunks in _byte_chunks(files, max_bytes):
        yield path, b"".join(chunks).decode("utf-8", errors="replace")


# ---------------------------------------------------------------- writing


class _TokenWriter:
    """Appends token ids to a file as a fixed dtype, hashing what it writes."""

    def __init__(self, path: pathlib.Path, dtype_name: str, vocab_size: int) -> None:
        self.dtype = PREPARED_DTYPES[dtype_name]
        self.vocab_size = vocab_size
        self.file = open(path, "wb")
        self.sha = hashlib.sha256()
        self.n_tokens = 0
        self.max_id = 0

    def write(self, ids) -> int:
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        if arr.size:
            self.max_id = max(self.max_id, int(arr.max()))
        data = arr.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.sha.update(data)
        self.n_tokens += arr.size
        return arr.size

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def _write_byte_tokens(files, max_bytes, writer: _TokenWriter) -> list[dict]:
    eod = np.frombuffer(SEPARATOR, dtype=np.uint8)
    documents = []
    for path, chunks in _byte_chunks(files, max_bytes):
        start, length = writer.n_tokens, 0
        for block in chunks:
            length += writer.write(np.frombuffer(block, dtype=np.uint8))
        writer.write(eod)
        documents.append({"path": str(path), "start": start, "length": length})
    return documents


def _train_bpe(files, max_bytes, vocab_size: int, min_frequency: int):
    tokenizers = _import_tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((text for _, text in _documents_text(files, max_bytes)), trainer=trainer)
    if hasattr(tok, "encode_special_tokens"):
        tok.encode_special_tokens = True  # a literal "<|endoftext|>" in a file is just text
    return tok


def _write_bpe_tokens(tok, files, max_bytes, writer: _TokenWriter, eod_id: int) -> list[dict]:
    """`tok`: a tokenizers.Tokenizer or an HFTokenizer (anything with encode_batch)."""
    documents = []
    batch: list[tuple[pathlib.Path, str]] = []

    def flush() -> None:
        encoded = tok.encode_batch([text for _, text in batch])
        for (path, _), enc in zip(batch, encoded):
            start = writer.n_tokens
            length = writer.write(np.asarray(enc.ids, dtype=np.int64))
            writer.write(np.array([eod_id], dtype=np.int64))
            documents.append({"path": str(path), "start": start, "length": length})
        batch.clear()

    pending = 0
    for path, text in _documents_text(files, max_bytes):
        batch.append((path, text))
        pending += len(text)
        if len(batch) >= 256 or pending >= _CHUNK:
            flush()
            pending = 0
    if batch:
        flush()
    return documents


def _install(tmp: pathlib.Path, out: pathlib.Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``out`` (replacing an existing one when allowed)."""
    old = None
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        else:
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prepare(
    src: Sequence[str | os.PathLike[str]] | None,
    out: str | os.PathLike[str],
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    max_bytes: int | None = None,
    overwrite: bool = False,
    min_frequency: int = 2,
) -> dict:
    """Tokenize ``src`` (files/folders; None = the stdlib ``.py`` sources) into ``out``.

    Returns the ``index.json`` contents. ``vocab_size`` is the BPE target (default
    8192, at least 257; the trained vocabulary can be smaller on a small corpus) and must
    be left unset (or 256) for the byte tokenizer. ``max_bytes`` caps the source bytes
    read (the last file is cut). An existing non-empty ``out`` is only replaced with
    ``overwrite``. ``tokenizer="hf:FOLDER"`` uses a Hugging Face folder's own tokenizer
    (``HFTokenizer``; ``vocab_size`` must be left unset, ``min_frequency`` does not apply).
    Raises ValueError/FileNotFoundError/ImportError with a clear message.
    """
    hf_tok = None
    if tokenizer.startswith(HF_PREFIX):
        if not tokenizer[len(HF_PREFIX) :]:
            raise ValueError("--tokenizer hf:FOLDER needs a folder after 'hf:'")
        if vocab_size is not None:
            raise ValueError(
                f"--vocab-size {vocab_size} does not apply to --tokenizer {tokenizer} (its vocabulary "
                f"is the tokenizer's own); leave it out"
            )
        hf_tok = HFTokenizer(tokenizer[len(HF_PREFIX) :])  # fails before reading anything
        vocab_size = hf_tok.vocab_size
        if vocab_size > 1 << 32:
            raise ValueError(f"--tokenizer {tokenizer}: vocabulary of {vocab_size} does not fit uint32 token ids")
    elif tokenizer not in TOKENIZERS[:2]:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; use one of {', '.join(TOKENIZERS)}")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"--max-bytes must be positive, got {max_bytes}")
    if hf_tok is not None:
        pass  # the vocabulary is the tokenizer's, checked above
    elif tokenizer == "byte":
        if vocab_size not in (None, ByteTokenizer.vocab_size):
            raise ValueError(
                f"--vocab-size {vocab_size} does not apply to the byte tokenizer (its vocabulary is "
                f"{ByteTokenizer.vocab_size}); leave it out or use --tokenizer bpe"
            )
        vocab_size = ByteTokenizer.vocab_size
    else:
        vocab_size = DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size
        if vocab_size < MIN_BPE_VOCAB:
            raise ValueError(
                f"--vocab-size {vocab_size} is too small for a byte-level BPE: it needs at least "
                f"{MIN_BPE_VOCAB} (256 bytes + the end-of-document token)"
            )
        if vocab_size > 1 << 32:
            raise ValueError(
                f"--vocab-size {vocab_size} is too large: token ids are stored as uint32 (at most {1 << 32})"
            )
        if min_frequency < 0:
            raise ValueError(f"--min-frequency must be >= 0, got {min_frequency}")
        _import_tokenizers()  # fail before reading anything

    out = pathlib.Path(out).expanduser()
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"--out {str(out)!r} exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise ValueError(
                f"--out {str(out)!r} exists and is not empty; pass --overwrite to replace it "
                "or choose another directory"
            )
    files, sources = _source_files(None if src is None else [str(s) for s in src], out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as err:
        raise OSError(f"--out {str(out)!r}: cannot write into {str(out.parent)!r} ({err.strerror})") from err
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary dir
        tok = None
        if hf_tok is not None:
            tok = hf_tok
            eod_ids = [hf_tok.eod_id]
        elif tokenizer == "bpe":
            tok = _train_bpe(files, max_bytes, vocab_size, min_frequency)
            vocab_size = tok.get_vocab_size()
            eod_ids = [tok.token_to_id(EOD_TOKEN)]
        else:
            eod_ids = list(SEPARATOR)
        dtype_name = token_dtype_for_vocab(vocab_size)
        writer = _TokenWriter(tmp / TOKENS_FILE, dtype_name, vocab_size)
        try:
            if tok is None:
                documents = _write_byte_tokens(files, max_bytes, writer)
            else:
                documents = _write_bpe_tokens(tok, files, max_bytes, writer, eod_ids[0])
        finally:
            writer.close()
        if writer.n_tokens == 0:
            raise ValueError(f"the corpus read from {', '.join(sources)} is empty (all files have 0 bytes)")
        hf_fields = {}
        if hf_tok is not None:
            hf_tok.backend.save(str(tmp / TOKENIZER_FILE))
            tokenizer_sha = hashlib.sha256((tmp / TOKENIZER_FILE).read_bytes()).hexdigest()
            hf_fields = {
                "tokenizer_source": hf_tok.source,
                "tokenizer_class": hf_tok.class_name,
                "tokenizer_sha256": tokenizer_sha,
                "eos_id": hf_tok.eod_id,
                "bos_id": hf_tok.bos_id,
            }
        elif tok is not None:
            tok.save(str(tmp / TOKENIZER_FILE))
        info = {
            "format": PREPARED_FORMAT,
            "version": PREPARED_VERSION,
            "dtype": dtype_name,
            "byte_order": "little",
            "n_tokens": writer.n_tokens,
            "bytes": writer.n_tokens * PREPARED_DTYPES[dtype_name].itemsize,
            "sha256": writer.sha.hexdigest(),
            "tokenizer": "hf" if hf_tok is not None else tokenizer,
            "vocab_size": vocab_size,
            "max_token_id": writer.max_id,
            "tokenizer_file": TOKENIZER_FILE if tok is not None else None,
            "eod_ids": eod_ids,
            "eod_token": (
                hf_tok.eos_token if hf_tok is not None else EOD_TOKEN if tok is not None else SEPARATOR.decode()
            ),
            **hf_fields,
            "sources": sources,
            "max_bytes": max_bytes,
            "n_documents": len(documents),
            "documents": documents,
        }
        index_tmp = tmp / (INDEX_FILE + ".part")
        with open(index_tmp, "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.rename(index_tmp, tmp / INDEX_FILE)  # written last: its presence marks a complete dir
        _install(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="meshtron-prepare",
        description="Tokenize text files/folders into DIR/tokens.bin + DIR/index.json (train with data.prepared=DIR).",
    )
    parser.add_argument(
        "--src",
        nargs="+",
        metavar="PATH",
        help="files or folders (walked recursively); default: the Python stdlib .py sources",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument(
        "--tokenizer",
        default="byte",
        metavar="{byte,bpe,hf:FOLDER}",
        help="byte (built in, vocab 256), bpe (trained here with HF tokenizers) or hf:FOLDER "
        "(a Hugging Face model folder's own tokenizer, e.g. the one meshtron-hf import reads)",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=None, help=f"BPE vocabulary size (default {DEFAULT_BPE_VOCAB})"
    )
    parser.add_argument("--max-bytes", type=int, default=None, help="read at most this many source bytes")
    parser.add_argument("--min-frequency", type=int, default=2, help="BPE: minimum pair frequency to merge")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    try:
        info = prepare(
            args.src,
            args.out,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            max_bytes=args.max_bytes,
            overwrite=args.overwrite,
            min_frequency=args.min_frequency,
        )
    except (OSError, ValueError, ImportError) as err:
        print(f"meshtron-prepare: error: {err}", file=sys.stderr)
        return 2
    print(
        f"wrote {info['n_tokens']} {info['dtype']} tokens ({info['n_documents']} documents, "
        f"{info['tokenizer']} tokenizer, vocab_size {info['vocab_size']}) to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
