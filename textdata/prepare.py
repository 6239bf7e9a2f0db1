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
with ``transformers.AutoTokenizer`` (fast tokenizers only, local files only). Each document is
encoded without special tokens (text that spells a special token, such as ``<|endoftext|>`` in
a source file, is encoded as text), preceded by BOS when the tokenizer itself puts BOS first
(Llama 3, Mistral; not Qwen, nor GPT-2) and followed by the family's end-of-document token: the
tokenizer's ``eos_token``, except that a chat-turn end (``<|eot_id|>``, ``<|eom_id|>``,
``<|im_end|>``, the eos of Llama 3 and Qwen instruct folders) gives way to the base model's
end of text in the vocabulary (``<|end_of_text|>``, ``<|endoftext|>``); ``--eos TOKEN`` names it
instead. A folder without tokenizer files, one transformers cannot load, a tokenizer that maps
text to no tokens, or no end-of-document token to choose: one line, exit 2, nothing written.
``index.json`` records ``tokenizer: "hf"``, the folder (``tokenizer_source``), the tokenizer
class, ``vocab_size`` (every id of the tokenizer, added tokens included),
``eos_id``/``eod_token``/``eos_rule`` (and the tokenizer's own ``tokenizer_eos_token``),
``bos_id``/``bos_token`` (null when no BOS is written) and the SHA-256 of the tokenizer file
copied into the output. A document's ``start``/``length`` cover its text tokens (BOS, when
written, is at ``start - 1``).

Everything is written into a hidden temporary directory beside ``--out`` which is renamed
into place at the end, so an interrupted run never leaves a directory that looks valid.
A write that fails (a full disk, or a file larger than the process's file-size limit,
``ulimit -f``: Python ignores SIGXFSZ, so the write fails with EFBIG instead of killing the
process) is one line naming the file being written and what to change, exit 2; the temporary
directory is removed and ``--out`` is left as it was. With the byte tokenizer, whose
``tokens.bin`` size is known from the sources' sizes, a file-size limit too small for it is
refused before anything is read.
Train on it with ``data.prepared=DIR``; ``load_prepared`` memory-maps it.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import pathlib
import re
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

try:
    import resource  # the file-size limit (ulimit -f); POSIX only
except ImportError:  # pragma: no cover - Windows
    resource = None

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
        return torch.tensor(self._tok.encode(text, add_special_tokens=False).ids, dtype=torch.int64)

    def decode(self, ids) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.reshape(-1).tolist()
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


# Files a Hugging Face folder holds its tokenizer in (one of these sets must be there).
HF_TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))
# eos_token values that end a chat turn, not a document (Llama 3 instruct, Qwen instruct), and the
# end-of-text tokens their families' base models end documents with.
CHAT_TURN_ENDS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>")
DOCUMENT_ENDS = ("<|end_of_text|>", "<|endoftext|>")
# Encoded to tell an empty or unusable tokenizer and whether the tokenizer puts BOS first.
PROBE_TEXT = "The quick brown fox jumps over the lazy dog, 0123456789 times."


def _one_line(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class HFTokenizer:
    """A Hugging Face model folder's fast tokenizer (``transformers.AutoTokenizer``, local
    files only), set up the way its family prepares pretraining text:

    * ``backend`` is its ``tokenizers.Tokenizer``, encoding without special tokens, and text
      that spells a special token (``"<|endoftext|>"`` in a source file) stays text;
    * ``eod_id``/``eos_token``: the end-of-document token written after every document: the
      tokenizer's ``eos_token``, except that a chat-turn end (``<|eot_id|>``, ``<|eom_id|>``,
      ``<|im_end|>``: the eos of Llama 3 and Qwen instruct folders) is replaced by the one
      end-of-text token its vocabulary holds (``<|end_of_text|>`` or ``<|endoftext|>``, the base
      model's eos); ``eos`` (``--eos TOKEN``) overrides both. ``eos_rule`` says which applied;
    * ``bos_id``: the BOS written before every document when the tokenizer itself puts it first
      (``tokenizer(text)`` starts with ``bos_token_id``: Llama 3's post-processor, Mistral's
      ``add_bos_token``), else None (Qwen has no BOS; GPT-2's bos is its eos, not added);
    * ``vocab_size`` covers every id (added tokens included).

    ValueError (one line, naming the folder) when the folder has no tokenizer files, transformers
    cannot load them, the tokenizer is not a fast one, maps text to no tokens (or only to its
    unknown token), or no end-of-document token can be chosen (it says what to set)."""

    def __init__(self, folder: str | os.PathLike[str], eos: str | None = None) -> None:
        where = f"--tokenizer hf:{folder}"
        root = pathlib.Path(folder).expanduser()
        tok = _load_fast_tokenizer(root, where)
        self.source = str(root.resolve())
        self.class_name = type(tok).__name__
        # A copy: transformers resets its backend's encode_special_tokens on every call.
        self.backend = type(tok.backend_tokenizer).from_str(tok.backend_tokenizer.to_str())
        if hasattr(self.backend, "encode_special_tokens"):
            self.backend.encode_special_tokens = True  # a literal "<|endoftext|>" in a file is just text
        vocab = tok.get_vocab()
        self.vocab_size = max(len(tok), max(vocab.values(), default=-1) + 1)
        probe = _probe_ids(tok, self.backend, self.vocab_size, where)

        declared = tok.eos_token
        self.tokenizer_eos_token = None if declared is None else str(declared)
        self.eos_token, self.eos_rule = _end_of_document(declared, eos, vocab, where)
        if self.eos_token not in vocab:
            raise ValueError(f"{where}: its eos_token {self.eos_token!r} is not in its vocabulary; pass --eos TOKEN")
        self.eod_id = int(vocab[self.eos_token])
        self.bos_id, self.bos_token = _bos_written(tok, probe, self.eod_id)

    def encode_batch(self, texts: list[str]):
        """Ids of each text, without special tokens."""
        return self.backend.encode_batch(texts, add_special_tokens=False)


def _load_fast_tokenizer(root: pathlib.Path, where: str):
    """The fast ``transformers.AutoTokenizer`` of the Hugging Face folder ``root`` (local files
    only); ``where`` (``--tokenizer hf:FOLDER``) starts every error message."""
    if not root.is_dir():
        raise FileNotFoundError(
            f"{where}: {str(root)!r} is not a directory (give a Hugging Face model folder with "
            f"tokenizer.json, or vocab.json + merges.txt)"
        )
    if not any(all((root / name).is_file() for name in group) for group in HF_TOKENIZER_FILES):
        raise ValueError(
            f"{where}: the folder has no tokenizer files (tokenizer.json, vocab.json + merges.txt, "
            f"or tokenizer.model); copy them from the model's Hugging Face repository into it"
        )
    try:
        import transformers
    except ImportError as err:
        raise ImportError(f"{where} needs `transformers`; pip install 'meshtron[hf]'") from err
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its load-time advice is not ours to print
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    except Exception as err:  # noqa: BLE001 -- any failure to load is one line naming the folder
        raise ValueError(f"{where}: transformers cannot load a tokenizer from it ({_one_line(err)})") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    if not getattr(tok, "is_fast", False) or getattr(tok, "backend_tokenizer", None) is None:
        raise ValueError(
            f"{where}: {type(tok).__name__} is not a fast tokenizer; save the folder with a "
            f"tokenizer.json (a *TokenizerFast)"
        )
    return tok


def _probe_ids(tok, backend, vocab_size: int, where: str) -> list[int]:
    """The ids ``backend`` encodes PROBE_TEXT to (without special tokens), checked to be some
    tokens other than ``tok``'s unknown token."""
    probe = backend.encode(PROBE_TEXT, add_special_tokens=False).ids
    if not probe:
        raise ValueError(
            f"{where}: its tokenizer maps text to no tokens (vocabulary of {vocab_size}): "
            f"the tokenizer files are empty or not the model's; copy them from the model's repository"
        )
    if tok.unk_token_id is not None and all(i == tok.unk_token_id for i in probe):
        raise ValueError(
            f"{where}: its tokenizer maps every word of a test sentence to its unknown token "
            f"{tok.unk_token!r} (vocabulary of {vocab_size}); copy the tokenizer files from the model's repository"
        )
    return probe


def _end_of_document(declared, eos: str | None, vocab: dict, where: str) -> tuple[str, str]:
    """``(eos_token, eos_rule)``: the end-of-document token and why: ``eos`` (``--eos``), else
    the tokenizer's ``declared`` eos_token, or its vocabulary's one end of text when that
    eos_token ends a chat turn."""
    if eos is not None:
        if eos not in vocab:
            raise ValueError(f"{where}: --eos {eos!r} is not a token of its tokenizer; give one of its tokens")
        return eos, "--eos"
    if declared is None:
        raise ValueError(
            f"{where}: the tokenizer has no eos_token, which prepare writes after every document; "
            f"set eos_token in its tokenizer_config.json or pass --eos TOKEN"
        )
    if str(declared) in CHAT_TURN_ENDS:
        ends = [t for t in DOCUMENT_ENDS if t in vocab]
        if len(ends) != 1:
            raise ValueError(
                f"{where}: the tokenizer's eos_token {str(declared)!r} ends a chat turn, and its vocabulary "
                f"holds {' and '.join(ends) or f'neither of {DOCUMENT_ENDS[0]}, {DOCUMENT_ENDS[1]}'}; pass "
                f"--eos TOKEN (the base model's end of text)"
            )
        return ends[0], f"end of text; the tokenizer's eos_token {str(declared)} ends a chat turn"
    return str(declared), "the tokenizer's eos_token"


def _bos_written(tok, probe: list[int], eod_id: int) -> tuple[int | None, str | None]:
    """``(bos_id, bos_token)`` written first in every document when the tokenizer itself puts
    BOS first (and BOS is not the end-of-document token), else ``(None, None)``."""
    with_special = list(tok(PROBE_TEXT, add_special_tokens=True)["input_ids"])
    bos_id = tok.bos_token_id
    adds_bos = (
        bos_id is not None
        and int(bos_id) != eod_id  # GPT-2 style: bos is eos, the separator already marks the start
        and with_special[:1] == [bos_id]
        and probe[:1] != [bos_id]
    )
    return (int(bos_id) if adds_bos else None), (str(tok.bos_token) if adds_bos else None)


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


def write_failure(out: pathlib.Path, name: str, err: BaseException) -> OSError:
    """The one-line error for a failed write of ``name`` (a file of ``--out``): what failed and
    what to change; ``err`` is an OSError, or a tokenizers exception ending in "(os error N)"."""
    code = getattr(err, "errno", None)
    if code is None:
        match = re.search(r"os error (\d+)", str(err))
        code = int(match.group(1)) if match else None
    reason = os.strerror(code) if code else " ".join(str(err).split())
    if code == errno.EFBIG:
        fix = (
            f"this process may write files of at most {_file_size_limit()} bytes (the file-size limit, ulimit -f): "
            f"raise it (ulimit -f unlimited) or read less with --max-bytes"
        )
    elif code == errno.ENOSPC:
        fix = f"free space on the disk of {out.parent} or choose another --out"
    else:
        fix = "choose another --out"
    return OSError(f"--out {str(out)!r}: writing {name} failed ({reason}); {fix}; --out was left as it was")


def _file_size_limit() -> int | None:
    """The soft RLIMIT_FSIZE in bytes, None when unlimited (or not known)."""
    if resource is None:
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if limit == resource.RLIM_INFINITY else limit


class _TokenWriter:
    """Appends token ids to a file as a fixed dtype, hashing what it writes; a failed write is
    `write_failure` naming ``out``'s file."""

    def __init__(self, path: pathlib.Path, dtype_name: str, vocab_size: int, out: pathlib.Path) -> None:
        self.dtype = PREPARED_DTYPES[dtype_name]
        self.vocab_size = vocab_size
        self.out = out
        try:
            self.file = open(path, "wb")
        except OSError as err:
            raise write_failure(out, path.name, err) from err
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
        try:
            self.file.write(data)
        except OSError as err:
            raise write_failure(self.out, TOKENS_FILE, err) from err
        self.sha.update(data)
        self.n_tokens += arr.size
        return arr.size

    def close(self) -> None:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as err:
            raise write_failure(self.out, TOKENS_FILE, err) from err
        finally:
            try:
                self.file.close()
            except OSError:
                pass  # its buffer failed to flush just above: that error is the one to report


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


def _write_bpe_tokens(
    tok, files, max_bytes, writer: _TokenWriter, eod_id: int, bos_id: int | None = None, name: str = "bpe"
) -> list[dict]:
    """`tok`: a tokenizers.Tokenizer or an HFTokenizer (anything with encode_batch). Each document
    is [bos_id] + its ids + [eod_id]; its record's start/length cover its ids. A document with
    visible text that encodes to no tokens is a ValueError naming it (a tokenizer that drops text)."""
    documents = []
    batch: list[tuple[pathlib.Path, str]] = []
    bos = None if bos_id is None else np.array([bos_id], dtype=np.int64)

    def flush() -> None:
        encoded = tok.encode_batch([text for _, text in batch])
        for (path, text), enc in zip(batch, encoded):
            if not enc.ids and not text.isspace():
                raise ValueError(
                    f"--tokenizer {name}: {path} ({len(text)} characters) encodes to no tokens; the tokenizer "
                    f"drops text (are its files the model's?)"
                )
            if bos is not None:
                writer.write(bos)
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
    eos: str | None = None,
) -> dict:
    """Tokenize ``src`` (files/folders; None = the stdlib ``.py`` sources) into ``out``.

    Returns the ``index.json`` contents. ``vocab_size`` is the BPE target (default
    8192, at least 257; the trained vocabulary can be smaller on a small corpus) and must
    be left unset (or 256) for the byte tokenizer. ``max_bytes`` caps the source bytes
    read (the last file is cut). An existing non-empty ``out`` is only replaced with
    ``overwrite``. ``tokenizer="hf:FOLDER"`` uses a Hugging Face folder's own tokenizer
    (``HFTokenizer``; ``vocab_size`` must be left unset, ``min_frequency`` does not apply);
    ``eos`` (hf only) names the end-of-document token instead of the one ``HFTokenizer`` picks.
    Raises ValueError/FileNotFoundError/ImportError with a clear message.
    """
    hf_tok, vocab_size = _checked_tokenizer_options(tokenizer, vocab_size, max_bytes, min_frequency, eos)
    out = _checked_out(pathlib.Path(out).expanduser(), overwrite)
    files, sources = _source_files(None if src is None else [str(s) for s in src], out)
    _check_file_size_limit(files, max_bytes, out, tokenizer)
    tmp = _make_temp_dir(out)
    try:
        _make_ordinary(tmp)
        tok, vocab_size, eod_ids = _corpus_tokenizer(hf_tok, tokenizer, files, max_bytes, vocab_size, min_frequency)
        dtype_name = token_dtype_for_vocab(vocab_size)
        writer = _TokenWriter(tmp / TOKENS_FILE, dtype_name, vocab_size, out)
        try:
            documents = _write_documents(tok, hf_tok, tokenizer, files, max_bytes, writer, eod_ids)
        finally:
            writer.close()
        if writer.n_tokens == 0:
            raise ValueError(f"the corpus read from {', '.join(sources)} is empty (all files have 0 bytes)")
        hf_fields = _save_tokenizer(tmp, out, tok, hf_tok)
        info = _index_info(
            writer,
            dtype_name,
            vocab_size,
            documents,
            tokenizer=tokenizer,
            tok=tok,
            hf_tok=hf_tok,
            eod_ids=eod_ids,
            hf_fields=hf_fields,
            sources=sources,
            max_bytes=max_bytes,
        )
        _write_index(tmp, out, info)
        _install(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def _checked_tokenizer_options(
    tokenizer: str, vocab_size: int | None, max_bytes: int | None, min_frequency: int, eos: str | None
) -> tuple[HFTokenizer | None, int]:
    """``(hf_tok, vocab_size)``: the loaded ``HFTokenizer`` for ``hf:FOLDER`` (else None) and the
    vocabulary size to write with, after checking prepare's tokenizer options; nothing is read."""
    hf_tok = None
    if tokenizer.startswith(HF_PREFIX):
        hf_tok = _load_hf_tokenizer(tokenizer, vocab_size, eos)
        vocab_size = hf_tok.vocab_size
    elif tokenizer not in TOKENIZERS[:2]:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; use one of {', '.join(TOKENIZERS)}")
    elif eos is not None:
        raise ValueError(f"--eos applies to --tokenizer hf:FOLDER only (the {tokenizer} separator is fixed)")
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
        vocab_size = _checked_bpe_options(vocab_size, min_frequency)
    return hf_tok, vocab_size


def _load_hf_tokenizer(tokenizer: str, vocab_size: int | None, eos: str | None) -> HFTokenizer:
    """The ``HFTokenizer`` of ``tokenizer`` (``hf:FOLDER``), whose vocabulary must fit uint32 ids;
    ``vocab_size`` must be unset."""
    if not tokenizer[len(HF_PREFIX) :]:
        raise ValueError("--tokenizer hf:FOLDER needs a folder after 'hf:'")
    if vocab_size is not None:
        raise ValueError(
            f"--vocab-size {vocab_size} does not apply to --tokenizer {tokenizer} (its vocabulary "
            f"is the tokenizer's own); leave it out"
        )
    hf_tok = HFTokenizer(tokenizer[len(HF_PREFIX) :], eos=eos)  # fails before reading anything
    if hf_tok.vocab_size > 1 << 32:
        raise ValueError(f"--tokenizer {tokenizer}: vocabulary of {hf_tok.vocab_size} does not fit uint32 token ids")
    return hf_tok


def _checked_bpe_options(vocab_size: int | None, min_frequency: int) -> int:
    """The BPE target vocabulary size (default DEFAULT_BPE_VOCAB), checked with ``min_frequency``
    and the ``tokenizers`` package being installed."""
    vocab_size = DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small for a byte-level BPE: it needs at least "
            f"{MIN_BPE_VOCAB} (256 bytes + the end-of-document token)"
        )
    if vocab_size > 1 << 32:
        raise ValueError(f"--vocab-size {vocab_size} is too large: token ids are stored as uint32 (at most {1 << 32})")
    if min_frequency < 0:
        raise ValueError(f"--min-frequency must be >= 0, got {min_frequency}")
    _import_tokenizers()  # fail before reading anything
    return vocab_size


def _checked_out(out: pathlib.Path, overwrite: bool) -> pathlib.Path:
    """``out``, checked to be absent, an empty directory, or a directory ``overwrite`` replaces."""
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"--out {str(out)!r} exists and is not a directory")
        if any(out.iterdir()) and not overwrite:
            raise ValueError(
                f"--out {str(out)!r} exists and is not empty; pass --overwrite to replace it "
                "or choose another directory"
            )
    return out


def _check_file_size_limit(files: list[pathlib.Path], max_bytes: int | None, out: pathlib.Path, tokenizer: str) -> None:
    """Refuse, before anything is read, a byte-tokenizer ``tokens.bin`` that would exceed the
    process's file-size limit (``ulimit -f``)."""
    limit = _file_size_limit()
    if limit is not None and tokenizer == "byte":  # tokens.bin holds >= one uint16 per source byte
        sizes = sum(f.stat().st_size for f in files)
        least = min(sizes, max_bytes if max_bytes is not None else sizes) * PREPARED_DTYPES["uint16"].itemsize
        if least > limit:
            raise OSError(
                f"--out {str(out)!r}: {TOKENS_FILE} would be at least {least} bytes, over this process's "
                f"file-size limit of {limit} bytes (ulimit -f); raise it (ulimit -f unlimited) or read "
                f"less with --max-bytes (each source byte is 2 bytes of {TOKENS_FILE}); nothing was written"
            )


def _make_temp_dir(out: pathlib.Path) -> pathlib.Path:
    """A new hidden temporary directory beside ``out`` (creating ``out``'s parent)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as err:
        raise OSError(f"--out {str(out)!r}: cannot write into {str(out.parent)!r} ({err.strerror})") from err


def _make_ordinary(tmp: pathlib.Path) -> None:
    """Give ``tmp`` an ordinary directory's permissions (0o777 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary dir


def _corpus_tokenizer(
    hf_tok: HFTokenizer | None,
    tokenizer: str,
    files: list[pathlib.Path],
    max_bytes: int | None,
    vocab_size: int,
    min_frequency: int,
) -> tuple:
    """``(tok, vocab_size, eod_ids)``: the tokenizer to encode with (``hf_tok``, a BPE trained on
    the corpus, or None for bytes), its vocabulary size and its end-of-document ids."""
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
    return tok, vocab_size, eod_ids


def _write_documents(tok, hf_tok, tokenizer: str, files, max_bytes, writer: _TokenWriter, eod_ids: list) -> list[dict]:
    """Write every document's tokens with ``tok`` (None: bytes); the documents' records."""
    if tok is None:
        return _write_byte_tokens(files, max_bytes, writer)
    return _write_bpe_tokens(
        tok,
        files,
        max_bytes,
        writer,
        eod_ids[0],
        bos_id=hf_tok.bos_id if hf_tok is not None else None,
        name=tokenizer,
    )


def _save_tokenizer(tmp: pathlib.Path, out: pathlib.Path, tok, hf_tok: HFTokenizer | None) -> dict:
    """Save ``tok``'s ``tokenizer.json`` into ``tmp`` (none for bytes); the index fields of an
    ``hf_tok`` (its source, class, file SHA-256, eos and bos), else ``{}``."""
    hf_fields = {}
    if tok is not None:
        try:  # tokenizers (Rust) reports a failed write as a plain Exception "... (os error N)"
            (hf_tok.backend if hf_tok is not None else tok).save(str(tmp / TOKENIZER_FILE))
        except Exception as err:  # noqa: BLE001 -- any failure to save is one line naming the file
            raise write_failure(out, TOKENIZER_FILE, err) from err
    if hf_tok is not None:
        tokenizer_sha = hashlib.sha256((tmp / TOKENIZER_FILE).read_bytes()).hexdigest()
        hf_fields = {
            "tokenizer_source": hf_tok.source,
            "tokenizer_class": hf_tok.class_name,
            "tokenizer_sha256": tokenizer_sha,
            "eos_id": hf_tok.eod_id,
            "eos_rule": hf_tok.eos_rule,
            "tokenizer_eos_token": hf_tok.tokenizer_eos_token,
            "bos_id": hf_tok.bos_id,
            "bos_token": hf_tok.bos_token,
        }
    return hf_fields


def _index_info(
    writer: _TokenWriter,
    dtype_name: str,
    vocab_size: int,
    documents: list[dict],
    *,
    tokenizer: str,
    tok,
    hf_tok: HFTokenizer | None,
    eod_ids: list,
    hf_fields: dict,
    sources: list[str],
    max_bytes: int | None,
) -> dict:
    """The ``index.json`` contents of a finished ``tokens.bin`` written by ``writer``."""
    return {
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
        "eod_token": (hf_tok.eos_token if hf_tok is not None else EOD_TOKEN if tok is not None else SEPARATOR.decode()),
        **hf_fields,
        "sources": sources,
        "max_bytes": max_bytes,
        "n_documents": len(documents),
        "documents": documents,
    }


def _write_index(tmp: pathlib.Path, out: pathlib.Path, info: dict) -> None:
    """Write ``info`` as ``tmp``'s ``index.json`` (via a ``.part`` file renamed into place)."""
    index_tmp = tmp / (INDEX_FILE + ".part")
    try:
        with open(index_tmp, "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        raise write_failure(out, INDEX_FILE, err) from err
    os.rename(index_tmp, tmp / INDEX_FILE)  # written last: its presence marks a complete dir


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
    parser.add_argument(
        "--eos",
        default=None,
        metavar="TOKEN",
        help="hf:FOLDER: the end-of-document token (default: the tokenizer's eos_token, or the base "
        "model's end of text when that eos_token ends a chat turn)",
    )
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
            eos=args.eos,
        )
    except (OSError, ValueError, ImportError) as err:
        print(f"meshtron-prepare: error: {err}", file=sys.stderr)
        return 2
    print(
        f"wrote {info['n_tokens']} {info['dtype']} tokens ({info['n_documents']} documents, "
        f"{info['tokenizer']} tokenizer, vocab_size {info['vocab_size']}) to {args.out}"
    )
    if info["tokenizer"] == "hf":
        bos = f"{info['bos_token']} (id {info['bos_id']}) + " if info["bos_id"] is not None else ""
        print(f"documents: {bos}text + {info['eod_token']} (id {info['eos_id']}; {info['eos_rule']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
