"""Local Hugging Face model folders: read config.json + *.safetensors (sharded or not), write
model.safetensors + config.json. No network."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from meshtron.models.hf.config import (
    HFConversionError,
    check_model_type,
    require_safetensors,
    require_transformers,
)
from meshtron.models.hf.sources import SafetensorsSource

# --------------------------------------------------------------------------------------------
# Folders
# --------------------------------------------------------------------------------------------


def save_hf_folder(
    state_dict: dict[str, torch.Tensor] | TensorStream,
    hf_config,
    out_dir,
    *,
    generation_config: dict | None = None,
    copy_files: tuple[Path, ...] = (),
    dtype: torch.dtype | None = None,
    max_file_bytes: int = 5 * 10**9,
) -> Path:
    """Write the weights and `config.json` into `out_dir` so that
    `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads the model.

    `state_dict`: a full state dict, or a `TensorStream` (shapes known beforehand, tensors
    produced one at a time: written as they come, `write_safetensors_streamed`). Weights are
    written in `dtype` (default: the state dict's, fp32 for a stream) as `model.safetensors` or
    files of at most `max_file_bytes` with an index; config.json's dtype says which. `hf_config`
    is a transformers config (saved with `save_pretrained`) or a config.json dict (written as it
    is, after checking transformers can build a config from it). A tied `lm_head.weight` is
    left out (as `save_pretrained` does). `generation_config` (a dict) is written as
    `generation_config.json`; `copy_files` (tokenizer files) are copied in. OSError naming
    `out_dir` when it cannot be written."""
    transformers = require_transformers()
    out = Path(out_dir)
    if isinstance(hf_config, dict):
        try:
            config_object = transformers.AutoConfig.for_model(**hf_config)
        except (TypeError, ValueError, KeyError) as err:
            raise HFConversionError(f"the exported config.json would not load in transformers: {err}") from None
    else:
        config_object = hf_config
    tied = bool(getattr(config_object, "tie_word_embeddings", False))
    stream = state_dict if isinstance(state_dict, TensorStream) else TensorStream.of(state_dict)
    if tied:
        stream = stream.without("lm_head.weight")
    dtype = dtype or stream.dtype or torch.float32
    try:
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("model*.safetensors"), out / INDEX_FILE]:  # an earlier export's weights
            stale.unlink(missing_ok=True)
        write_safetensors_streamed(out, stream.shapes, stream.items, dtype, max_file_bytes)
        dtype_name = str(dtype).removeprefix("torch.")
        if isinstance(hf_config, dict):
            config = {**hf_config, ("torch_dtype" if "torch_dtype" in hf_config else "dtype"): dtype_name}
            (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            hf_config.dtype = dtype_name
            hf_config.save_pretrained(str(out))
        if generation_config is not None:
            (out / GENERATION_FILE).write_text(json.dumps(generation_config, indent=2, sort_keys=True) + "\n")
        for path in copy_files:
            shutil.copyfile(path, out / path.name)
    except OSError as err:
        raise OSError(f"cannot write the Hugging Face folder {out}: {err.strerror or err}") from err
    return out


@dataclasses.dataclass
class TensorStream:
    """Tensors known by name and shape beforehand (`shapes`, in writing order) and produced
    one at a time (`items` yields (name, tensor) in that order); `dtype`: theirs, if known."""

    shapes: dict[str, tuple[int, ...]]
    items: Iterator[tuple[str, torch.Tensor]]
    dtype: torch.dtype | None = None

    @classmethod
    def of(cls, state_dict: dict[str, torch.Tensor]) -> TensorStream:
        dtypes = {t.dtype for t in state_dict.values()}
        dtype = dtypes.pop() if len(dtypes) == 1 else None
        return cls({k: tuple(v.shape) for k, v in state_dict.items()}, iter(state_dict.items()), dtype)

    def without(self, name: str) -> TensorStream:
        shapes = {k: s for k, s in self.shapes.items() if k != name}
        return TensorStream(shapes, ((k, t) for k, t in self.items if k != name), self.dtype)


# --------------------------------------------------------------------------------------------
# Streamed, sharded safetensors: each tensor written as it comes, the headers known beforehand
# --------------------------------------------------------------------------------------------

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
INDEX_FILE = "model.safetensors.index.json"


def _file_groups(shapes: dict[str, tuple[int, ...]], itemsize: int, max_file_bytes: int) -> list[list[str]]:
    """Tensor names in order, cut into consecutive files of at most `max_file_bytes` (a bigger
    single tensor gets a file of its own)."""
    groups, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if groups[-1] and size + nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _header(names: list[str], shapes: dict, dtype: torch.dtype) -> bytes:
    itemsize, offset, entries = torch.tensor([], dtype=dtype).element_size(), 0, {}
    for name in names:
        end = offset + math.prod(shapes[name]) * itemsize
        entries[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shapes[name]), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors_streamed(
    out_dir,
    shapes: dict[str, tuple[int, ...]],
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    max_file_bytes: int = 5 * 10**9,
) -> list[Path]:
    """Write the tensors `tensors` yields ((name, tensor), in the order of `shapes`) as
    safetensors files of at most `max_file_bytes` in `dtype`: `model.safetensors`, or
    `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` (the layout
    `save_pretrained` writes). Each file's header is written first (every shape is known), then
    each tensor's bytes as it arrives: only the tensor being written is held. Returns the files."""
    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype {dtype} is not one of {sorted(map(str, _ST_DTYPES))}")
    itemsize = torch.tensor([], dtype=dtype).element_size()
    groups = _file_groups(shapes, itemsize, max_file_bytes)
    names = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stream = iter(tensors)
    for group, file_name in zip(groups, names):
        with open(out / file_name, "wb") as f:
            f.write(_header(group, shapes, dtype))
            for expected in group:
                name, tensor = next(stream)
                if name != expected or tuple(tensor.shape) != tuple(shapes[name]):
                    raise ValueError(f"got tensor {name} {tuple(tensor.shape)}, expected {expected} {shapes[expected]}")
                data = tensor.detach().to("cpu", dtype).contiguous()
                f.write(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    if len(groups) > 1:
        weight_map = {name: file for group, file in zip(groups, names) for name in group}
        total = sum(math.prod(s) * itemsize for s in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [out / n for n in names]


# --------------------------------------------------------------------------------------------
# The imported model's own files, kept beside a meshtron checkpoint for export ("--base")
# --------------------------------------------------------------------------------------------

GENERATION_FILE = "generation_config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)
POSITIONS_FILE = "original_positions.safetensors"
_WPE = "transformer.wpe.weight"


def save_import_base(src_dir, base_dir, state_dict: dict[str, torch.Tensor]) -> Path:
    """Keep what export needs from the Hugging Face folder `src_dir` in `base_dir`: its
    config.json verbatim, its generation_config.json and tokenizer files when present, and a
    GPT-2's whole position table (`original_positions.safetensors`, so a model imported at a
    shorter seq_len exports its untrained positions unchanged). OSError naming the folder."""
    src, base = Path(src_dir), Path(base_dir)
    try:
        base.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", GENERATION_FILE) + TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, base / name)
        wpe = state_dict.get(_WPE, state_dict.get("wpe.weight"))
        if wpe is not None:
            require_safetensors().save_file({_WPE: wpe.contiguous()}, str(base / POSITIONS_FILE))
    except OSError as err:
        raise OSError(f"cannot write {base}: {err.strerror or err}") from err
    return base


def read_import_base(base_dir) -> dict:
    """The imported model's own files for export: `base_dir` is the `--out` of
    `meshtron-hf import` (its `hf/` folder) or the original Hugging Face folder. Returns
    {"config": the config.json dict, "generation": the generation_config.json dict or None,
    "positions": GPT-2's full position table or None, "tokenizer_files": [paths]}.
    FileNotFoundError when neither holds a config.json."""
    base = Path(base_dir)
    if (base / "hf" / "config.json").is_file():
        base = base / "hf"
    if not (base / "config.json").is_file():
        raise FileNotFoundError(
            f"--base {base_dir}: no config.json in it or in its hf/ folder (give the --out of "
            f"meshtron-hf import or the original Hugging Face folder)"
        )
    config = _read_json_object(base / "config.json")
    generation = _read_json_object(base / GENERATION_FILE) if (base / GENERATION_FILE).is_file() else None
    positions = None
    if config.get("model_type") == "gpt2":
        if (base / POSITIONS_FILE).is_file():
            positions = _load_safetensors(base / POSITIONS_FILE)[_WPE]
        else:
            weights = {}
            for path in _weight_files(base):
                weights.update(_load_safetensors(path))
            positions = weights.get(_WPE, weights.get("wpe.weight"))
            if positions is None:
                raise HFConversionError(f"--base {base_dir}: its weights hold no {_WPE}")
    tokenizer_files = [base / name for name in TOKENIZER_FILES if (base / name).is_file()]
    return {"config": config, "generation": generation, "positions": positions, "tokenizer_files": tokenizer_files}


def read_hf_config(src_dir):
    """The transformers config of the local Hugging Face model folder `src_dir` (its
    config.json; no network). FileNotFoundError when there is none; HFConversionError naming
    the file when it is not JSON, has an unsupported model_type or transformers cannot read it."""
    transformers = require_transformers()
    src = Path(src_dir)
    config_path = src / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{src}/config.json not found (not a Hugging Face model folder)")
    model_type = _read_json_object(config_path).get("model_type")
    try:
        check_model_type(model_type)
    except HFConversionError as err:
        raise HFConversionError(f"{config_path}: {err}") from None
    try:
        return transformers.AutoConfig.from_pretrained(str(src), local_files_only=True)
    except (OSError, ValueError) as err:
        raise HFConversionError(f"{config_path}: transformers cannot read it: {err}") from None


def open_hf_weights(src_dir, family: str) -> SafetensorsSource:
    """The safetensors weights of the local model folder `src_dir` (`model.safetensors`, the
    shards its index lists, or every `*.safetensors`), memory-mapped for sliced reads; keys
    normalized for `family` ("gpt2", "llama", ...). Close it when done."""
    return SafetensorsSource(_weight_files(Path(src_dir)), family)


def read_hf_folder(src_dir) -> tuple[object, dict[str, torch.Tensor]]:
    """(config, full state dict) of a local Hugging Face model folder: `config.json` and
    `model.safetensors`, or the shards listed in `model.safetensors.index.json` (or every
    `*.safetensors`). Local files only, no network. A config.json that is not JSON or has an
    unsupported model_type, a bad index or a truncated/corrupt weights file raises
    HFConversionError naming the file; a missing one FileNotFoundError."""
    hf_config = read_hf_config(src_dir)
    src = Path(src_dir)
    state_dict: dict[str, torch.Tensor] = {}
    for path in _weight_files(src):
        part = _load_safetensors(path)
        overlap = state_dict.keys() & part.keys()
        if overlap:
            raise HFConversionError(f"tensor {sorted(overlap)[0]} appears in more than one shard of {src}")
        state_dict.update(part)
    return hf_config, state_dict


def _read_json_object(path: Path) -> dict:
    """The JSON object in `path`; HFConversionError naming the file when it is not one."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HFConversionError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise HFConversionError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _weight_files(src: Path) -> list[Path]:
    """The safetensors files of folder `src`: the shards its index lists, else
    `model.safetensors`, else every `*.safetensors`."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise HFConversionError(f"{index}: field 'weight_map' must map tensor names to shard file names")
        files = [src / name for name in sorted(set(weight_map.values()))]
        missing = [path for path in files if not path.is_file()]
        if missing:
            raise FileNotFoundError(f"{missing[0]} not found (listed in {index})")
        return files
    if (src / "model.safetensors").is_file():
        return [src / "model.safetensors"]
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {src} (convert .bin checkpoints to safetensors first)")
    return files


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; HFConversionError naming it when it is truncated or corrupt."""
    st = require_safetensors()
    from safetensors import SafetensorError

    try:
        return st.load_file(os.fspath(path))
    except SafetensorError as err:
        raise HFConversionError(
            f"{path} is not a readable safetensors file ({err}): truncated or corrupt? copy or save it again"
        ) from None
