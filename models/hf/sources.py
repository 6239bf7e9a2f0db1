"""Where Hugging Face weights are read from, one slice at a time: a state dict already in
memory (`DictSource`) or the safetensors files of a model folder (`SafetensorsSource`,
memory-mapped: a slice read copies only the bytes of that slice, in the file's dtype).

Both present the same three questions: which tensors are there (`keys`), their shapes
(`shape`, from the file headers: nothing is read) and `read(key, index)`, the sub-tensor at
`index` (a tuple of slices, one per dimension). `bytes_read` counts what reads returned, so
a test can prove a rank read its shards and nothing more. Keys are normalized as the
importer expects: non-weight buffers (causal-mask buffers, cached RoPE tables) are dropped
and GPT-2 checkpoints saved without the `transformer.` prefix get it."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from meshtron.models.hf.config import HFConversionError, require_safetensors

Index = tuple[slice, ...]

_IGNORED_KEYS = re.compile(r"(^|\.)h\.\d+\.attn\.(bias|masked_bias)$|\.rotary_emb\.inv_freq$")


def _canonical_names(keys: list[str], family: str) -> dict[str, str]:
    """{importer's name: stored name} of the weight tensors among `keys`."""
    keys = [k for k in keys if not _IGNORED_KEYS.search(k)]
    if family == "gpt2" and "transformer.wte.weight" not in keys and "wte.weight" in keys:
        return {(k if k.startswith("lm_head.") else "transformer." + k): k for k in keys}
    return {k: k for k in keys}


class DictSource:
    """Slices of a full state dict held in memory (`meshtron-hf import`, tests)."""

    def __init__(self, state_dict: dict[str, torch.Tensor], family: str):
        self._tensors = {
            name: state_dict[stored] for name, stored in _canonical_names(list(state_dict), family).items()
        }
        self.bytes_read = 0

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def read(self, key: str, index: Index) -> torch.Tensor:
        piece = self._tensors[key][index]
        self.bytes_read += piece.numel() * piece.element_size()
        return piece


class SafetensorsSource:
    """Slices of the safetensors files `files` (a model folder's shards), memory-mapped: each
    read copies only its slice, in the stored dtype. Close it (or use it as a context
    manager) to release the mappings."""

    def __init__(self, files: list[Path], family: str):
        st = require_safetensors()
        del st  # imported for its clear error when safetensors is missing
        from safetensors import SafetensorError, safe_open

        self._handles, owner = [], {}
        for path in files:
            try:
                handle = safe_open(os.fspath(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as err:
                self.close()
                raise HFConversionError(
                    f"{path} is not a readable safetensors file ({err}): truncated or corrupt? copy or save it again"
                ) from None
            self._handles.append(handle)
            for key in handle.keys():
                if key in owner:
                    self.close()
                    raise HFConversionError(f"tensor {key} appears in more than one shard of {path.parent}")
                owner[key] = handle
        self._stored = _canonical_names(list(owner), family)
        self._owner = {name: owner[stored] for name, stored in self._stored.items()}
        self._shapes = {name: tuple(self._owner[name].get_slice(s).get_shape()) for name, s in self._stored.items()}
        self.bytes_read = 0

    def keys(self) -> list[str]:
        return list(self._shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def read(self, key: str, index: Index) -> torch.Tensor:
        piece = self._owner[key].get_slice(self._stored[key])[index]
        self.bytes_read += piece.numel() * piece.element_size()
        return piece

    def close(self) -> None:
        for handle in getattr(self, "_handles", []):
            handle.__exit__(None, None, None)
        self._handles = []

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
