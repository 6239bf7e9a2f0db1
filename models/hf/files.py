"""Local Hugging Face model folders: read config.json + *.safetensors (sharded or not), write
model.safetensors + config.json. No network."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from meshtron.models.hf.config import HFConversionError, require_safetensors, require_transformers

# --------------------------------------------------------------------------------------------
# Folders
# --------------------------------------------------------------------------------------------

def save_hf_folder(state_dict: dict[str, torch.Tensor], hf_config, out_dir) -> Path:
    """Write `model.safetensors` and `config.json` into `out_dir` so that
    `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads the model. A tied
    `lm_head.weight` is left out (as `save_pretrained` does)."""
    require_transformers()
    st = require_safetensors()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()
               if not (tied and k == "lm_head.weight")}
    st.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config.save_pretrained(str(out))
    return out


def read_hf_folder(src_dir) -> tuple[object, dict[str, torch.Tensor]]:
    """(config, full state dict) of a local Hugging Face model folder: `config.json` and
    `model.safetensors`, or the shards listed in `model.safetensors.index.json` (or every
    `*.safetensors`). Local files only, no network."""
    transformers = require_transformers()
    st = require_safetensors()
    src = Path(src_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}/config.json not found (not a Hugging Face model folder)")
    hf_config = transformers.AutoConfig.from_pretrained(str(src), local_files_only=True)
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (src / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {src} (convert .bin checkpoints to safetensors first)")
    state_dict: dict[str, torch.Tensor] = {}
    for name in files:
        part = st.load_file(os.fspath(src / name))
        overlap = state_dict.keys() & part.keys()
        if overlap:
            raise HFConversionError(f"tensor {sorted(overlap)[0]} appears in more than one shard of {src}")
        state_dict.update(part)
    return hf_config, state_dict
