"""Real-text training data: local files or a prepared token file, fixed-length windows.

Two sources, one dataset:

* in memory: the bytes of local files as byte-level tokens (``load_corpus``). The default
  corpus is the Python standard library's own ``.py`` sources, which every Python install
  ships, so ``python train.py`` trains on real text on any machine;
* prepared: a directory written by ``python -m meshtron.textdata.prepare`` (``tokens.bin``, a raw
  little-endian uint16/uint32 token stream, plus ``index.json``), memory-mapped read-only by
  ``load_prepared`` so a batch only touches the windows it needs.

Sampling is indexed by **sample**, not by step: sample ``i`` of a split is the window
``perm_e[i % num_windows]`` of that split's non-overlapping windows, where epoch
``e = i // num_windows`` has its own permutation seeded from ``(seed, e, split)``. Every
process computes the same samples, each data-parallel rank takes its contiguous rows of the
global batch (the "parallel == serial" contract), and a resumed run continues at sample
``consumed`` exactly, whatever batch sizes were used before.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sysconfig
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from meshtron.errors import ConfigError

__all__ = [
    "ByteTokenizer",
    "DataError",
    "TokenDataset",
    "build_dataset",
    "default_corpus_files",
    "load_corpus",
    "load_prepared",
]

# Between two files, so a window that spans a file boundary sees a clear break.
SEPARATOR = b"\n\n"

# Directory names under the stdlib that are not "the standard library's own sources".
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})

SPLITS = ("train", "val")


class DataError(ConfigError):
    """Token data that cannot be trained on (an id outside the vocabulary); the message names the
    file and the token offset. A ``ConfigError``, so the run's entry turns it into one line and
    exit code 2."""


def default_corpus_files() -> list[pathlib.Path]:
    """Return the standard library's own ``.py`` files, sorted by their stdlib-relative path.

    Taken from ``sysconfig.get_paths()["stdlib"]``; ``site-packages``/``dist-packages``,
    ``test``/``tests`` directories, ``idlelib`` and ``__pycache__`` are left out.
    Raises FileNotFoundError if the install ships no ``.py`` sources (some minimal
    distributions ship only bytecode).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(
            f"the Python standard library directory {root} does not exist; "
            "pass data files or directories explicitly (data.paths=[...])"
        )
    found: list[tuple[str, pathlib.Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into excluded trees (site-packages is big).
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = pathlib.Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    if not found:
        raise FileNotFoundError(
            f"no .py files found under the Python standard library directory {root} "
            "(this install may ship bytecode only); pass data files or directories "
            "explicitly (data.paths=[...])"
        )
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


class ByteTokenizer:
    """Byte-level tokenizer: token id = byte value, so ``vocab_size == 256``.

    Text is encoded as UTF-8; any byte string is valid input, so there is no unknown token.
    """

    vocab_size: int = 256

    def encode(self, text: str | bytes) -> torch.Tensor:
        """Return the token ids of ``text`` (UTF-8 bytes) as a 1-D **int64** tensor.

        int64 so the result can index an embedding directly; ``load_corpus`` keeps the
        corpus as uint8 to save memory and the dataset widens each batch to int64.
        """
        if isinstance(text, str):
            data = text.encode("utf-8")
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise TypeError(f"ByteTokenizer.encode expects str or bytes, got {type(text).__name__}")
        if not data:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Return the text for token ids ``ids`` (any integer tensor or sequence).

        Bytes are decoded as UTF-8 with ``errors="replace"``, so a window cut in the middle
        of a multi-byte character decodes to U+FFFD instead of raising. Ids outside
        ``[0, 256)`` raise ValueError.
        """
        if isinstance(ids, torch.Tensor):
            if ids.is_floating_point() or ids.is_complex():
                raise TypeError(f"ByteTokenizer.decode expects integer ids, got dtype {ids.dtype}")
            values = ids.reshape(-1).tolist()
        else:
            values = [int(v) for v in ids]
        bad = [v for v in values if not 0 <= v < self.vocab_size]
        if bad:
            raise ValueError(
                f"ByteTokenizer.decode: ids must be in [0, {self.vocab_size}), got {bad[:5]}"
                + (" ..." if len(bad) > 5 else "")
            )
        return bytes(values).decode("utf-8", errors="replace")


def _walk_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """Regular files under ``directory``, recursively, sorted by relative path.

    Hidden entries (name starts with ".") and ``__pycache__`` are skipped so that pointing
    at a source checkout does not read ``.git`` objects or bytecode.
    """
    found: list[tuple[str, pathlib.Path]] = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            if name.startswith("."):
                continue
            path = pathlib.Path(dirpath, name)
            if path.is_file():
                found.append((path.relative_to(directory).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def expand_paths(paths: Iterable[str | os.PathLike[str]], key: str = "data.paths") -> list[pathlib.Path]:
    """Files named by ``paths`` (directories walked, sorted); ``key`` names the setting
    in error messages (``data.paths`` for training, ``--src`` for ``textdata.prepare``)."""
    files: list[pathlib.Path] = []
    for raw in paths:
        path = pathlib.Path(raw).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            in_dir = _walk_files(path)
            if not in_dir:
                raise FileNotFoundError(
                    f"data directory {str(path)!r} contains no files (hidden files and "
                    f"__pycache__ are skipped); put text files in it or remove it from {key}"
                )
            files.extend(in_dir)
        elif path.exists():
            raise ValueError(f"data path {str(path)!r} is neither a regular file nor a directory; remove it from {key}")
        else:
            raise FileNotFoundError(
                f"data path {str(path)!r} does not exist; fix {key} or leave it unset "
                "to use the Python standard library sources"
            )
    return files


def load_corpus(
    paths: Sequence[str | os.PathLike[str]] | None, max_bytes: int, vocab_size: int | None = None
) -> torch.Tensor:
    """Read files into a 1-D uint8 tensor of byte token ids, at most ``max_bytes`` long.

    ``paths`` are files or directories (walked recursively, sorted); ``None`` means
    ``default_corpus_files()``. Files are read in order as raw bytes (any bytes are valid
    for a byte tokenizer) and joined with ``SEPARATOR`` (``b"\\n\\n"``); reading stops once
    ``max_bytes`` bytes are collected and the result is cut to exactly that length when the
    files hold more. Raises FileNotFoundError for a missing path or an empty directory,
    ValueError for ``max_bytes <= 0``, an empty ``paths`` list or an all-empty corpus.
    With ``vocab_size`` (the model's), each file's byte ids are checked as it is read: one
    at or above ``vocab_size`` raises ConfigError naming the file. Whether the corpus is long
    enough for a sequence length is checked by ``TokenDataset``.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}; set data.max_bytes > 0")
    if paths is None:
        files = default_corpus_files()
        source = "the Python standard library sources"
    else:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if len(paths) == 0:
            raise ValueError(
                "data paths list is empty; give at least one file or directory, or leave "
                "data.paths unset (null) to train on the Python standard library sources"
            )
        files = expand_paths(paths)
        source = ", ".join(repr(str(p)) for p in paths)

    buffer = bytearray()
    for path in files:
        if len(buffer) >= max_bytes:
            break
        with open(path, "rb") as f:
            content = f.read(max_bytes - len(buffer))
        if not content:
            continue
        if vocab_size is not None:
            _check_byte_ids(path, content, vocab_size)
        if buffer:
            buffer += SEPARATOR
        buffer += content
    del buffer[max_bytes:]
    if not buffer:
        raise ValueError(f"the corpus read from {source} is empty (all files have 0 bytes)")
    return torch.frombuffer(buffer, dtype=torch.uint8).clone()


def _check_byte_ids(path: pathlib.Path, content: bytes, vocab_size: int) -> None:
    """Raise ConfigError when a byte of ``path``'s ``content`` is not below ``vocab_size``."""
    max_id = int(np.frombuffer(content, dtype=np.uint8).max())
    if max_id >= vocab_size:
        raise ConfigError(
            f"data file {str(path)!r} has byte token ids up to {max_id}, and the byte tokenizer has "
            f"vocab_size {ByteTokenizer.vocab_size} but model.vocab_size={vocab_size}; set "
            f"model.vocab_size={ByteTokenizer.vocab_size} or larger"
        )


# ---------------------------------------------------------------- prepared token files

PREPARED_FORMAT = "meshtron-tokens"
PREPARED_VERSION = 1
TOKENS_FILE = "tokens.bin"
INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.json"
# dtype name in index.json -> little-endian numpy dtype of tokens.bin
PREPARED_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def token_dtype_for_vocab(vocab_size: int) -> str:
    """``"uint16"`` when every id of a ``vocab_size`` vocabulary fits 16 bits, else ``"uint32"``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size > 1 << 32:
        raise ValueError(f"vocab_size {vocab_size} does not fit uint32 token ids")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _prepare_hint(directory: pathlib.Path) -> str:
    return f"re-run `python -m meshtron.textdata.prepare --src PATH [PATH ...] --out {directory}`"


def _file_sha256(path: pathlib.Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _read_index(root: pathlib.Path, hint: str) -> tuple[pathlib.Path, dict]:
    """The path and parsed contents of ``root``'s ``index.json``, checked to be a directory's
    index of this meshtron's format and version."""
    if not root.exists():
        raise FileNotFoundError(
            f"prepared data directory {str(root)!r} does not exist; create it with "
            f"`python -m meshtron.textdata.prepare --src PATH [PATH ...] --out {root}` or fix data.prepared"
        )
    if not root.is_dir():
        raise ValueError(
            f"prepared data path {str(root)!r} is not a directory; data.prepared must name the "
            "directory written by `python -m meshtron.textdata.prepare --out DIR`"
        )
    index_path = root / INDEX_FILE
    if not index_path.is_file():
        raise FileNotFoundError(
            f"{index_path} is missing: {str(root)!r} is not a complete prepared data directory "
            f"(was textdata.prepare interrupted, or is this the wrong directory?); {hint}"
        )
    try:
        info = json.loads(index_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{index_path} is not valid JSON ({err}); {hint}") from err
    if not isinstance(info, dict) or info.get("format") != PREPARED_FORMAT:
        raise ValueError(
            f"{index_path} is not a meshtron token index (expected a JSON object with "
            f'"format": "{PREPARED_FORMAT}"); {hint}'
        )
    if info.get("version") != PREPARED_VERSION:
        raise ValueError(
            f"{index_path} has format version {info.get('version')!r} but this meshtron reads "
            f"version {PREPARED_VERSION}; {hint}"
        )
    return index_path, info


def _check_index_fields(index_path: pathlib.Path, info: dict, hint: str) -> None:
    """Check the index's ``dtype``/``n_tokens``/``vocab_size``/``tokenizer`` fields: their types,
    a known dtype, a non-empty corpus and a vocabulary whose ids fit the dtype."""
    for key, kind in (("dtype", str), ("n_tokens", int), ("vocab_size", int), ("tokenizer", str)):
        value = info.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{index_path}: field {key!r} must be a {kind.__name__}, got {value!r}; {hint}")
    dtype_name = info["dtype"]
    if dtype_name not in PREPARED_DTYPES:
        raise ValueError(
            f"{index_path}: unknown token dtype {dtype_name!r}; expected one of {', '.join(PREPARED_DTYPES)}; {hint}"
        )
    dtype = PREPARED_DTYPES[dtype_name]
    n_tokens, vocab_size = info["n_tokens"], info["vocab_size"]
    if n_tokens <= 0:
        raise ValueError(f"{index_path}: n_tokens={n_tokens}, the prepared corpus is empty; {hint}")
    if not 2 <= vocab_size <= np.iinfo(dtype).max + 1:
        raise ValueError(
            f"{index_path}: vocab_size={vocab_size} does not fit dtype {dtype_name} "
            f"(at most {np.iinfo(dtype).max + 1}); {hint}"
        )


def _check_tokens_file(tokens_path: pathlib.Path, dtype_name: str, n_tokens: int, hint: str) -> None:
    """Check that ``tokens.bin`` exists and its byte size is ``n_tokens`` items of ``dtype_name``."""
    dtype = PREPARED_DTYPES[dtype_name]
    if not tokens_path.is_file():
        raise FileNotFoundError(f"{tokens_path} is missing; {hint}")
    size = tokens_path.stat().st_size
    if size == 0:
        raise ValueError(f"{tokens_path} is empty (0 bytes); {hint}")
    if size % dtype.itemsize:
        raise ValueError(
            f"{tokens_path} has {size} bytes, not a multiple of {dtype.itemsize} ({dtype_name}): "
            f"the file is truncated or was not written as {dtype_name}; {hint}"
        )
    if size != n_tokens * dtype.itemsize:
        raise ValueError(
            f"{tokens_path} has {size} bytes = {size // dtype.itemsize} {dtype_name} tokens but "
            f"{INDEX_FILE} says n_tokens={n_tokens} ({n_tokens * dtype.itemsize} bytes): the "
            f"file is truncated, was overwritten or has a different dtype; {hint}"
        )


def _checked_max_token_id(
    info: dict, tokens: np.memmap, index_path: pathlib.Path, tokens_path: pathlib.Path, hint: str
) -> int:
    """The largest token id: the index's ``max_token_id`` (checked), or computed from ``tokens``
    for directories written before prepare recorded it; it must be below ``vocab_size``."""
    vocab_size = info["vocab_size"]
    max_token_id = info.get("max_token_id")
    if max_token_id is None:  # written before prepare recorded it: one pass over the file
        max_token_id = int(tokens.max())
    elif not isinstance(max_token_id, int) or isinstance(max_token_id, bool) or max_token_id < 0:
        raise ValueError(f"{index_path}: field 'max_token_id' must be a non-negative int, got {max_token_id!r}; {hint}")
    if max_token_id >= vocab_size:
        raise ValueError(
            f"{tokens_path} holds token ids up to {max_token_id} but {INDEX_FILE} says vocab_size={vocab_size}: "
            f"the token file was not written with this index's tokenizer; {hint}"
        )
    return max_token_id


def load_prepared(directory: str | os.PathLike[str], verify_checksum: bool = False) -> tuple[np.memmap, dict]:
    """Memory-map a directory written by ``python -m meshtron.textdata.prepare``.

    Returns ``(tokens, info)``: ``tokens`` a read-only 1-D ``np.memmap`` over ``tokens.bin``
    (uint16 or uint32, little-endian; nothing is read until a window is gathered) and
    ``info`` the parsed ``index.json`` plus ``"dir"`` and ``"max_token_id"`` (the largest id
    in ``tokens.bin``: recorded by prepare, computed here for directories written before it
    was). ``tokens.bin`` is checked against the index (byte size == ``n_tokens`` * item size,
    every id below ``vocab_size``; the SHA-256 too when ``verify_checksum``, which reads the
    whole file). A missing directory or file raises
    FileNotFoundError, anything else wrong (bad JSON, unknown format or dtype, an empty,
    truncated or wrongly typed token file) ValueError; every message names the file and
    says how to fix it.
    """
    root = pathlib.Path(directory).expanduser()
    hint = _prepare_hint(root)
    index_path, info = _read_index(root, hint)
    _check_index_fields(index_path, info, hint)
    dtype_name, n_tokens = info["dtype"], info["n_tokens"]
    tokens_path = root / TOKENS_FILE
    _check_tokens_file(tokens_path, dtype_name, n_tokens, hint)
    expected_sha = info.get("sha256")
    if verify_checksum and expected_sha is not None and _file_sha256(tokens_path) != expected_sha:
        raise ValueError(f"{tokens_path} does not match the SHA-256 in {INDEX_FILE} (corrupted?); {hint}")
    tokens = np.memmap(tokens_path, dtype=PREPARED_DTYPES[dtype_name], mode="r", shape=(n_tokens,))
    max_token_id = _checked_max_token_id(info, tokens, index_path, tokens_path, hint)
    return tokens, dict(info, dir=str(root), max_token_id=max_token_id)


# Prepared token files up to this many tokens (256 MiB of uint16) are scanned whole at startup,
# before any process group (a fraction of a second); larger ones are checked per read only.
STARTUP_SCAN_TOKENS = 1 << 27
_SCAN_CHUNK = 1 << 24


def first_id_at_or_above(tokens: np.ndarray, bound: int, chunk: int = _SCAN_CHUNK) -> tuple[int, int] | None:
    """``(offset, id)`` of the first token of ``tokens`` at or above ``bound``, or None; reads
    ``tokens`` (e.g. a memmap) ``chunk`` tokens at a time."""
    for lo in range(0, len(tokens), chunk):
        block = np.asarray(tokens[lo : lo + chunk])
        if block.size and int(block.max()) >= bound:
            at = int(np.argmax(block >= bound))
            return lo + at, int(block[at])
    return None


def out_of_vocab_message(path: str, offset: int, token_id: int, vocab_size: int, where: str = "") -> str:
    """The one-line error for token ``token_id`` at token ``offset`` of ``path``, not below ``vocab_size``."""
    directory = pathlib.Path(path).parent
    return (
        f"{path} holds token id {token_id} at token offset {offset}{where}, but its {INDEX_FILE} says "
        f"vocab_size={vocab_size}: the token file was changed after meshtron-prepare wrote it (an id at or "
        f"above the vocabulary would index past the embedding); {_prepare_hint(directory)}"
    )


# ---------------------------------------------------------------- sampling


def _split_seed(seed: int, step: int, split: str) -> int:
    """A 63-bit seed that depends only on (seed, step, split), stable across runs.

    ``step`` is the epoch for the window permutation. Python's ``hash()`` is salted per
    process for str, so a cryptographic hash is used.
    """
    digest = hashlib.blake2b(f"meshtron-data:{seed}:{step}:{split}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


_U64 = np.uint64


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic)."""
    z = x + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def window_permutation(n: int, seed: int) -> np.ndarray:
    """A permutation of ``range(n)`` (int64) that depends only on ``(n, seed)``.

    Sorting SplitMix64 hashes of ``seed`` and the index is defined by integer arithmetic
    alone, so it is identical in every process, on every machine and with every numpy or
    torch version (a library generator's stream is not promised to stay the same).
    """
    with np.errstate(over="ignore"):
        keys = _splitmix64(np.arange(n, dtype=_U64) ^ _splitmix64(np.full(1, seed, dtype=_U64)))
    return np.argsort(keys, kind="stable").astype(np.int64)


class TokenDataset:
    """Fixed-length windows over a token stream, split into train and validation.

    ``tokens`` is a 1-D integer ``torch.Tensor`` (an in-memory corpus) or numpy array,
    typically the read-only ``np.memmap`` from ``load_prepared``; only the windows of a
    batch are read from it. The train split is the first ``(1 - val_fraction)`` of
    ``tokens`` and the validation split is the tail, so the two never share a token.

    A split of ``n`` tokens has ``num_windows = (n - 1) // seq_len`` non-overlapping windows
    ``[k * seq_len, k * seq_len + seq_len + 1)`` (consecutive windows share one boundary
    token, so every token is a target once; up to ``seq_len - 1`` tail tokens are unused).
    Sample ``i`` is window ``perm_e[i % num_windows]`` where ``e = i // num_windows`` and
    ``perm_e = window_permutation(num_windows, seed(seed, e, split))``: each epoch visits
    every window once, in its own order. A row's inputs are the window's first ``seq_len``
    tokens and its targets the last ``seq_len`` (inputs shifted by one), int64.

    No communication: every process computes the same samples, and a data-parallel rank
    gathers only its own rows.
    """

    def __init__(
        self,
        tokens: torch.Tensor | np.ndarray,
        seq_len: int,
        seed: int,
        val_fraction: float = 0.01,
        *,
        vocab_size: int | None = None,
        source: str | None = None,
    ) -> None:
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1:
                raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
            if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
                raise TypeError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
        elif isinstance(tokens, np.ndarray):
            if tokens.ndim != 1:
                raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
            if tokens.dtype.kind not in "iu":
                raise TypeError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
        else:
            raise TypeError(
                f"tokens must be a torch.Tensor or a numpy array (e.g. from load_prepared), got {type(tokens).__name__}"
            )
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.val_fraction = float(val_fraction)
        # Every window read is checked against this bound (max over the window: O(tokens read)),
        # so an id the file gained after it was prepared never reaches the embedding.
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.source = source or "the token stream"

        n = len(tokens)
        n_val = int(round(n * val_fraction))
        n_train = n - n_val
        self.train_range = (0, n_train)
        self.val_range = (n_train, n)
        # Slices are views: a memmap stays a memmap, nothing is read here.
        self._splits = {"train": tokens[:n_train], "val": tokens[n_train:]}
        self._perm_cache: dict[tuple[str, int], np.ndarray] = {}

        need = self.seq_len + 1
        names = ("train",) if val_fraction == 0.0 else SPLITS
        for name in names:
            have = len(self._splits[name])
            if have < need:
                raise ValueError(
                    f"the {name} split has {have} tokens ({n} tokens in the corpus, "
                    f"val_fraction={val_fraction}) but one window needs seq_len+1 = {need}; "
                    "give more data (data.max_bytes, data.paths or data.prepared), a shorter "
                    "model.seq_len" + (", or a different val_fraction" if val_fraction > 0 else "")
                )

    def split_tokens(self, split: str = "train") -> torch.Tensor | np.ndarray:
        """The tokens of one split (``"train"`` or ``"val"``), a view of the corpus."""
        self._check_split(split)
        return self._splits[split]

    def _check_split(self, split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        if split == "val" and self.val_fraction == 0.0:
            raise ValueError("no validation split: the dataset was built with val_fraction=0")

    def num_windows(self, split: str = "train") -> int:
        """Windows (= samples per epoch) of a split: ``(len(split) - 1) // seq_len``."""
        self._check_split(split)
        return (len(self._splits[split]) - 1) // self.seq_len

    def _permutation(self, split: str, epoch: int) -> np.ndarray:
        key = (split, epoch)
        perm = self._perm_cache.get(key)
        if perm is None:
            perm = window_permutation(self.num_windows(split), _split_seed(self.seed, epoch, split))
            # Keep the current epoch (and the one a batch may straddle into) per split.
            stale = [k for k in self._perm_cache if k[0] == split and abs(k[1] - epoch) > 1]
            for k in stale:
                del self._perm_cache[k]
            self._perm_cache[key] = perm
        return perm

    def sample_windows(self, first_sample: int, count: int, split: str = "train") -> np.ndarray:
        """Window indices (int64 ``[count]``) of samples ``[first_sample, first_sample + count)``."""
        self._check_split(split)
        if first_sample < 0:
            raise ValueError(f"first_sample must be >= 0, got {first_sample}")
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        n_win = self.num_windows(split)
        samples = np.arange(first_sample, first_sample + count, dtype=np.int64)
        epochs, positions = np.divmod(samples, n_win)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            mask = epochs == epoch
            out[mask] = self._permutation(split, int(epoch))[positions[mask]]
        return out

    def sample_starts(self, first_sample: int, count: int, split: str = "train") -> torch.Tensor:
        """Start offsets in the split (int64 ``[count]``) of samples ``[first_sample, +count)``."""
        return torch.from_numpy(self.sample_windows(first_sample, count, split) * self.seq_len)

    def window_starts(self, step: int, global_batch_size: int, split: str = "train") -> torch.Tensor:
        """Start offsets of batch ``step``'s windows: samples ``[step * gbs, (step + 1) * gbs)``."""
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.sample_starts(step * global_batch_size, global_batch_size, split)

    def _read(self, starts: torch.Tensor, split: str) -> np.ndarray | torch.Tensor:
        """The windows at ``starts`` (``[len(starts), seq_len + 1]``, the stream's dtype), checked
        against ``vocab_size``: DataError naming the file and the token offset of the first id
        (in row order) at or above it."""
        data = self._splits[split]
        if isinstance(data, np.ndarray):
            # Fancy indexing a memmap reads only the pages of these windows.
            raw = data[starts.numpy()[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)]
        else:
            raw = data[starts[:, None] + torch.arange(self.seq_len + 1, dtype=torch.int64)]
        if self.vocab_size is not None and raw.shape[0] and int(raw.max()) >= self.vocab_size:
            bad = np.asarray(raw >= self.vocab_size).reshape(-1)
            at = int(np.argmax(bad))
            row, col = divmod(at, self.seq_len + 1)
            split_start = self.train_range[0] if split == "train" else self.val_range[0]
            offset = split_start + int(starts[row]) + col
            raise DataError(
                out_of_vocab_message(
                    self.source, offset, int(raw.reshape(-1)[at]), self.vocab_size, f" (a window of the {split} split)"
                )
            )
        return raw

    def _gather(self, starts: torch.Tensor, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._batch(self._read(starts, split))

    @staticmethod
    def _batch(raw: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` int64 of windows ``raw`` (targets shifted by one)."""
        if isinstance(raw, np.ndarray):
            windows = torch.from_numpy(np.asarray(raw, dtype=np.int64))
        else:
            windows = raw.to(torch.int64)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def global_batch_at(
        self, first_sample: int, global_batch_size: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, int64 ``[global_batch_size, seq_len]``, of samples
        ``[first_sample, first_sample + global_batch_size)``."""
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        return self._gather(self.sample_starts(first_sample, global_batch_size, split), split)

    def local_batch_at(
        self,
        first_sample: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        split: str = "train",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's rows of ``global_batch_at(first_sample, ...)``.

        Rank ``r`` gets the contiguous rows ``[r * b, (r + 1) * b)`` with
        ``b = global_batch_size // dp_size``; only those windows are gathered. A run that
        has consumed ``c`` samples resumes with ``first_sample=c``, whatever batch sizes
        it used so far.
        """
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        if dp_size <= 0:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        if global_batch_size % dp_size != 0:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by the data-parallel "
                f"size {dp_size}; set trainer.global_batch_size to a multiple of {dp_size}"
            )
        per_rank = global_batch_size // dp_size
        if self.vocab_size is not None and dp_size > 1:
            # Check every replica's rows, not only this rank's: all ranks then fail at the same
            # step, before that step's collectives, instead of one rank leaving the others
            # waiting in one (costs reading the global batch instead of 1/dp of it).
            raw = self._read(self.sample_starts(first_sample, global_batch_size, split), split)
            return self._batch(raw[dp_rank * per_rank : (dp_rank + 1) * per_rank])
        starts = self.sample_starts(first_sample + dp_rank * per_rank, per_rank, split)
        return self._gather(starts, split)

    def global_batch(
        self, step: int, global_batch_size: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step`` of a fixed batch size: ``global_batch_at(step * global_batch_size, ...)``.

        ``targets[:, i] == inputs[:, i + 1]`` shifted from the same window; identical in
        every process for the same ``(seed, step, split)``.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.global_batch_at(step * global_batch_size, global_batch_size, split)

    def local_batch(
        self,
        step: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        split: str = "train",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of ``global_batch(step, ...)``: ``local_batch_at(step * gbs, ...)``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.local_batch_at(step * global_batch_size, global_batch_size, dp_rank, dp_size, split)

    def __repr__(self) -> str:
        return (
            f"TokenDataset(train={self.train_range[1] - self.train_range[0]} tokens, "
            f"val={self.val_range[1] - self.val_range[0]} tokens, seq_len={self.seq_len}, "
            f"seed={self.seed})"
        )


# ---------------------------------------------------------------- from the config


def build_dataset(data_cfg, seq_len: int, seed: int, vocab_size: int) -> TokenDataset:
    """The training dataset for a ``DataConfig`` and the model's ``seq_len``/``vocab_size``.

    ``data_cfg.prepared`` set: the memory-mapped output of ``textdata.prepare`` (``paths``
    and ``max_bytes`` are ignored); otherwise the byte-level in-memory corpus of
    ``data_cfg.paths`` (None = the standard library sources) cut to ``max_bytes``. Every
    token id must be below ``vocab_size`` (ids at or above it, even inside the padded
    vocabulary, would make the loss non-finite): ConfigError naming the file otherwise. A
    prepared file's ids are checked against its tokenizer's vocab_size from the tokens
    themselves: the whole file here when it has at most ``STARTUP_SCAN_TOKENS`` tokens, and
    every window as the dataset reads it (``DataError`` naming the file and the token offset).
    Also raises the errors of ``load_prepared``/``load_corpus``/``TokenDataset`` (OSError or
    ValueError).
    """
    prepared = getattr(data_cfg, "prepared", None)
    bound, source = None, None
    if prepared:
        tokens, info = load_prepared(prepared)
        need = info["vocab_size"]
        # need <= model.vocab_size: the tokenizer's ids all have embedding rows (not padded ones).
        if need > vocab_size:
            tokens_path = pathlib.Path(info["dir"]) / TOKENS_FILE
            raise ConfigError(
                f"the {info['tokenizer']} tokenizer of data.prepared={prepared!r} has vocab_size {need} but "
                f"model.vocab_size={vocab_size}; set model.vocab_size={need} or larger (or re-run "
                f"meshtron-prepare with a smaller --vocab-size): {tokens_path} holds token ids up to "
                f"{info['max_token_id']}"
            )
        # index.json's max_token_id describes the file as prepared, not as it is now: the ids
        # themselves are checked, against the tokenizer's vocab_size (<= model.vocab_size, so
        # also below the padded rows). A small file whole, here, before any process group; a
        # large one window by window as it is read (hashing or scanning a 1 TB corpus at every
        # rank's startup would take minutes to hours).
        bound, source = need, str(pathlib.Path(info["dir"]) / TOKENS_FILE)
        if len(tokens) <= STARTUP_SCAN_TOKENS:
            found = first_id_at_or_above(tokens, bound)
            if found is not None:
                raise DataError(out_of_vocab_message(source, found[0], found[1], bound))
            bound = None  # every id is checked: no per-read check (nor the global batch's reads) needed
    else:
        tokens = load_corpus(data_cfg.paths, data_cfg.max_bytes, vocab_size=vocab_size)  # every byte checked
    return TokenDataset(tokens, seq_len, seed, data_cfg.val_fraction, vocab_size=bound, source=source)


def document_end_id(data_cfg, vocab_size: int) -> int | None:
    """The end-of-document token that `data.reset_at_eos` restarts attention and positions at:
    None when reset_at_eos is off; `data.eos_id` when set; else the single end-of-document id
    that a prepared dataset's index.json records (bpe / hf tokenizers). The byte tokenizer's
    separator is two tokens ("\\n\\n", which source text also holds), so it names no document
    end: ConfigError saying what to set."""
    if not getattr(data_cfg, "reset_at_eos", False):
        return None
    eos = getattr(data_cfg, "eos_id", None)
    if eos is None and getattr(data_cfg, "prepared", None):
        path = pathlib.Path(data_cfg.prepared) / INDEX_FILE
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"data.reset_at_eos=true: cannot read the end-of-document id from {path}: {err}") from err
        ids = info.get("eod_ids") or []
        if len(ids) == 1:
            eos = int(ids[0])
    if eos is None:
        raise ConfigError(
            "data.reset_at_eos=true needs one end-of-document token id: the byte tokenizer's separator is two "
            "tokens; prepare the data with --tokenizer bpe or hf:FOLDER (data.prepared=DIR), or set data.eos_id=N"
        )
    if not 0 <= eos < vocab_size:
        raise ConfigError(f"data.eos_id={eos} is not a token id of model.vocab_size={vocab_size}")
    return eos
