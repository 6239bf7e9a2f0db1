"""Real-text training data with no download: bytes of local files, byte-level tokens.

The default corpus is the Python standard library's own ``.py`` sources, which every
Python install ships, so ``python train.py`` trains on real text on any machine.

Batches are a pure function of ``(seed, step, split)``: every process draws the same
window offsets from a generator seeded the same way, and each data-parallel rank takes its
contiguous slice of the global batch. The global batch for a step is therefore identical
in every process and every parallel layout (the "parallel == serial" contract).
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sysconfig
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "ByteTokenizer",
    "TokenDataset",
    "default_corpus_files",
    "load_corpus",
]

# Between two files, so a window that spans a file boundary sees a clear break.
SEPARATOR = b"\n\n"

# Directory names under the stdlib that are not "the standard library's own sources".
_STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
)

SPLITS = ("train", "val")


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


def _expand_paths(paths: Iterable[str | os.PathLike[str]]) -> list[pathlib.Path]:
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
                    "__pycache__ are skipped); put text files in it or remove it from data.paths"
                )
            files.extend(in_dir)
        elif path.exists():
            raise ValueError(
                f"data path {str(path)!r} is neither a regular file nor a directory; "
                "remove it from data.paths"
            )
        else:
            raise FileNotFoundError(
                f"data path {str(path)!r} does not exist; fix data.paths or leave it unset "
                "to train on the Python standard library sources"
            )
    return files


def load_corpus(
    paths: Sequence[str | os.PathLike[str]] | None, max_bytes: int
) -> torch.Tensor:
    """Read files into a 1-D uint8 tensor of byte token ids, at most ``max_bytes`` long.

    ``paths`` are files or directories (walked recursively, sorted); ``None`` means
    ``default_corpus_files()``. Files are read in order as raw bytes (any bytes are valid
    for a byte tokenizer) and joined with ``SEPARATOR`` (``b"\\n\\n"``); reading stops once
    ``max_bytes`` bytes are collected and the result is cut to exactly that length when the
    files hold more. Raises FileNotFoundError for a missing path or an empty directory,
    ValueError for ``max_bytes <= 0``, an empty ``paths`` list or an all-empty corpus.
    Whether the corpus is long enough for a sequence length is checked by ``TokenDataset``.
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
        files = _expand_paths(paths)
        source = ", ".join(repr(str(p)) for p in paths)

    buffer = bytearray()
    for path in files:
        if len(buffer) >= max_bytes:
            break
        with open(path, "rb") as f:
            content = f.read(max_bytes - len(buffer))
        if not content:
            continue
        if buffer:
            buffer += SEPARATOR
        buffer += content
    del buffer[max_bytes:]
    if not buffer:
        raise ValueError(f"the corpus read from {source} is empty (all files have 0 bytes)")
    return torch.frombuffer(buffer, dtype=torch.uint8).clone()


def _split_seed(seed: int, step: int, split: str) -> int:
    """A 63-bit generator seed that depends only on (seed, step, split), stable across runs.

    Python's ``hash()`` is salted per process for str, so a cryptographic hash is used.
    """
    digest = hashlib.blake2b(f"meshtron-data:{seed}:{step}:{split}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


class TokenDataset:
    """Random fixed-length windows over a token stream, split into train and validation.

    The train split is the first ``(1 - val_fraction)`` of ``tokens`` and the validation
    split is the tail, so the two never share a token. A batch row is a window of
    ``seq_len + 1`` consecutive tokens inside one split; inputs are its first ``seq_len``
    tokens and targets the last ``seq_len`` (inputs shifted by one).

    No communication: every process computes the same global batch from
    ``(seed, step, split)`` and takes its own rows.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        seq_len: int,
        seed: int,
        val_fraction: float = 0.01,
    ) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        if tokens.is_floating_point() or tokens.is_complex():
            raise TypeError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.val_fraction = float(val_fraction)

        n = tokens.numel()
        n_val = int(round(n * val_fraction))
        n_train = n - n_val
        self.train_range = (0, n_train)
        self.val_range = (n_train, n)
        self._splits = {"train": tokens[:n_train], "val": tokens[n_train:]}

        need = self.seq_len + 1
        names = ("train",) if val_fraction == 0.0 else SPLITS
        for name in names:
            have = self._splits[name].numel()
            if have < need:
                raise ValueError(
                    f"the {name} split has {have} tokens ({n} tokens in the corpus, "
                    f"val_fraction={val_fraction}) but one window needs seq_len+1 = {need}; "
                    "give more data (data.max_bytes or data.paths), a shorter model.seq_len"
                    + (", or a different val_fraction" if val_fraction > 0 else "")
                )

    def split_tokens(self, split: str = "train") -> torch.Tensor:
        """The tokens of one split (``"train"`` or ``"val"``), a view of the corpus."""
        self._check_split(split)
        return self._splits[split]

    def _check_split(self, split: str) -> None:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        if split == "val" and self.val_fraction == 0.0:
            raise ValueError("no validation split: the dataset was built with val_fraction=0")

    def window_starts(self, step: int, global_batch_size: int, split: str = "train") -> torch.Tensor:
        """Start offsets (int64, ``[global_batch_size]``) of the step's windows in the split.

        Uniform in ``[0, len(split) - seq_len - 1]`` so a window never runs past the split.
        """
        self._check_split(split)
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(_split_seed(self.seed, step, split))
        high = self._splits[split].numel() - self.seq_len  # exclusive bound
        return torch.randint(0, high, (global_batch_size,), generator=gen, dtype=torch.int64)

    def _gather(self, starts: torch.Tensor, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        data = self._splits[split]
        index = starts[:, None] + torch.arange(self.seq_len + 1, dtype=torch.int64)
        windows = data[index].to(torch.int64)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def global_batch(
        self, step: int, global_batch_size: int, split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(inputs, targets)`` for ``step``: int64 ``[global_batch_size, seq_len]``.

        ``targets[:, i] == inputs[:, i + 1]`` shifted from the same window; identical in
        every process for the same ``(seed, step, split)``.
        """
        return self._gather(self.window_starts(step, global_batch_size, split), split)

    def local_batch(
        self,
        step: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        split: str = "train",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return this data-parallel rank's rows of ``global_batch(step, ...)``.

        Rank ``r`` gets the contiguous rows ``[r * b, (r + 1) * b)`` with
        ``b = global_batch_size // dp_size``; only those windows are gathered.
        """
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
        starts = self.window_starts(step, global_batch_size, split)
        return self._gather(starts[dp_rank * per_rank : (dp_rank + 1) * per_rank], split)

    def __repr__(self) -> str:
        return (
            f"TokenDataset(train={self.train_range[1] - self.train_range[0]} tokens, "
            f"val={self.val_range[1] - self.val_range[0]} tokens, seq_len={self.seq_len}, "
            f"seed={self.seed})"
        )
