"""Local Hugging Face model folders: read config.json + *.safetensors (sharded or not), write
model.safetensors + config.json. No network."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from meshtron.models.hf.config import (
    HFConversionError,
    check_model_type,
    require_safetensors,
    require_transformers,
)

# --------------------------------------------------------------------------------------------
# Folders
# --------------------------------------------------------------------------------------------

def save_hf_folder(state_dict: dict[str, torch.Tensor], hf_config, out_dir) -> Path:
    """Write `model.safetensors` and `config.json` into `out_dir` so that
    `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads the model. A tied
    `lm_head.weight` is left out (as `save_pretrained` does). OSError naming `out_dir` when
    it cannot be written."""
    require_transformers()
    st = require_safetensors()
    out = Path(out_dir)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()
               if not (tied and k == "lm_head.weight")}
    try:
        out.mkdir(parents=True, exist_ok=True)
        st.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        hf_config.save_pretrained(str(out))
    except OSError as err:
        raise OSError(f"cannot write the Hugging Face folder {out}: {err.strerror or err}") from err
    return out


def read_hf_folder(src_dir) -> tuple[object, dict[str, torch.Tensor]]:
    """(config, full state dict) of a local Hugging Face model folder: `config.json` and
    `model.safetensors`, or the shards listed in `model.safetensors.index.json` (or every
    `*.safetensors`). Local files only, no network. A config.json that is not JSON or has an
    unsupported model_type, a bad index or a truncated/corrupt weights file raises
    HFConversionError naming the file; a missing one FileNotFoundError."""
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
        hf_config = transformers.AutoConfig.from_pretrained(str(src), local_files_only=True)
    except (OSError, ValueError) as err:
        raise HFConversionError(f"{config_path}: transformers cannot read it: {err}") from None
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
        raise HFConversionError(f"{path} is not a readable safetensors file ({err}): truncated or corrupt? "
                                "copy or save it again") from None
