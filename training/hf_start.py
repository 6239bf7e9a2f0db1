"""Training straight from a Hugging Face folder: `checkpoint.init_from=hf:FOLDER`.

The folder's config.json is the model: its architecture replaces the run's `model` section,
which keeps only what a run chooses (`RUN_CHOSEN_FIELDS`: the training sequence length,
dropout and multi-token prediction). A `model` field the user set to something else than both meshtron's default and the
folder's value is a contradiction, refused naming the field (rather than training a model
nobody asked for). Before any process group, every rank checks that the folder's safetensors
headers hold exactly the tensors the model needs (`check_hf_weights`); each rank then reads
only the slices of its own shards, memory-mapped, in the checkpoint's dtype
(`load_hf_into`, models/hf/weights.py): no process ever holds the whole model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch import nn

from meshtron.dp import zero3
from meshtron.errors import ConfigError
from meshtron.models.config import GPTConfig
from meshtron.models.hf import (
    HFConversionError,
    checked_units,
    config_from_hf,
    hf_family,
    load_hf_weights,
    open_hf_weights,
    read_hf_config,
)
from meshtron.training.checkpoint import writable_weights

HF_PREFIX = "hf:"
# model fields a run chooses for itself, kept from the run's `model` section: multi-token
# prediction is a training choice (transformers builds none; the depths the folder holds are
# loaded, further ones start fresh: models/hf/weights.py held_mtp_depths)
RUN_CHOSEN_FIELDS = ("seq_len", "dropout", "attention_dropout", "mtp_depths", "mtp_loss_weight")


def hf_folder(init_from: str | None) -> Path | None:
    """The folder of `checkpoint.init_from=hf:FOLDER`, or None for any other value."""
    if init_from is None or not init_from.startswith(HF_PREFIX):
        return None
    return Path(init_from[len(HF_PREFIX) :]).expanduser()


def model_from_hf_folder(folder: Path, given: GPTConfig) -> GPTConfig:
    """The model of the Hugging Face folder `folder` with the run's own choices of `given`
    (`RUN_CHOSEN_FIELDS`; a seq_len left at meshtron's default is capped at the model's maximum
    positions). ConfigError naming the key when the folder cannot be read or converted, or when
    `given` sets an architecture field to another value than the folder's."""
    where = f"checkpoint.init_from={HF_PREFIX}{folder}"
    default = GPTConfig()
    try:
        hf_config = read_hf_config(folder)
        theirs = config_from_hf(hf_config)
        for f in dataclasses.fields(GPTConfig):
            mine = getattr(given, f.name)
            if f.name not in RUN_CHOSEN_FIELDS and mine not in (getattr(default, f.name), getattr(theirs, f.name)):
                raise ConfigError(
                    f"model.{f.name}={mine} contradicts {where}, whose config.json gives {getattr(theirs, f.name)}: the "
                    f"folder sets the architecture; drop the model override or +model preset (only "
                    f"{', '.join(RUN_CHOSEN_FIELDS)} are the run's to choose)"
                )
        chosen = {k: getattr(given, k) for k in RUN_CHOSEN_FIELDS}
        if chosen["seq_len"] == default.seq_len:
            chosen["seq_len"] = min(default.seq_len, theirs.seq_len)
        if not 1 <= chosen["seq_len"] <= theirs.seq_len:
            raise HFConversionError(
                f"model.seq_len={chosen['seq_len']} must lie between 1 and the model's maximum positions "
                f"({theirs.seq_len})"
            )
        return config_from_hf(hf_config, **chosen)
    except (HFConversionError, FileNotFoundError, OSError) as err:
        raise ConfigError(f"{where}: {err}") from None


def check_hf_weights(folder: Path, cfg: GPTConfig) -> None:
    """Check, from the safetensors headers alone, that `folder` holds exactly the tensors of
    `cfg` with their shapes. ConfigError naming the tensor. No process group needed."""
    try:
        with open_hf_weights(folder, hf_family(cfg)) as source:
            checked_units(cfg, source)
    except (HFConversionError, FileNotFoundError, OSError) as err:
        raise ConfigError(f"checkpoint.init_from={HF_PREFIX}{folder}: {err}") from None


def load_hf_into(folder: Path, chunks: list[nn.Module], optimizer) -> int:
    """Read this rank's shards of the Hugging Face weights in `folder` into `chunks` (and the
    optimizer's fp32 main weights where it keeps them); returns the bytes read. No
    communication (ZeRO-3 parameters are gathered and re-sharded over their groups around it)."""
    cfg = chunks[0].cfg
    with zero3.gathered(chunks), writable_weights(chunks, optimizer) as targets:
        with open_hf_weights(folder, hf_family(cfg)) as source:
            load_hf_weights(chunks, source, targets)
            return source.bytes_read
