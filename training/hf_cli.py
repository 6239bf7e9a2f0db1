"""`meshtron-hf import|export` (also `python -m meshtron.training.hf_cli`): a Hugging Face
folder <-> a meshtron checkpoint, single process. Conversion itself is models/hf."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from meshtron.models.config import GPTConfig
from meshtron.models.gpt import GPT
from meshtron.models.hf import (
    MAX_POSITION_FIELDS,
    HFConversionError,
    TensorStream,
    config_from_hf,
    hf_config_dict_over,
    hf_config_from_gpt,
    hf_family,
    hf_tensor_shapes,
    load_hf_state_dict,
    read_hf_folder,
    read_import_base,
    save_hf_folder,
    save_import_base,
    stream_hf_tensors,
)
from meshtron.mpu.mesh import single_process_mesh
from meshtron.training.checkpoint import TrainState, expected_model_shapes, read_full_tensors, save_checkpoint
from meshtron.training.checkpoint_files import CheckpointError, read_meta, resolve_resume


def import_to_checkpoint(src_dir, out_dir, seq_len: int | None = None) -> Path:
    """Convert a `save_pretrained` folder into a weights-only meshtron checkpoint in `out_dir`
    (`out_dir/step_00000000`, loadable under any layout with `checkpoint.init_from`), plus
    `out_dir/model/imported.yaml`, the Hydra model config of it, and `out_dir/hf/`, the source's
    own config.json, generation_config.json, tokenizer files and (GPT-2) whole position table,
    which `export --base out_dir` writes back. A `seq_len` below the model's maximum positions
    keeps GPT-2's first `seq_len` learned positions. Single process."""

    hf_config, state_dict = read_hf_folder(src_dir)
    try:
        cfg = config_from_hf(hf_config, **({"seq_len": seq_len} if seq_len is not None else {}))
    except HFConversionError as err:
        raise HFConversionError(f"{Path(src_dir) / 'config.json'}: {err}") from None
    mesh = single_process_mesh()
    model = GPT(cfg, mesh)
    load_hf_state_dict(model, state_dict)
    out = Path(out_dir)
    path = save_checkpoint(out, TrainState(), [model], None, mesh, model_config=dataclasses.asdict(cfg))
    save_import_base(src_dir, out / "hf", state_dict)
    (out / "model").mkdir(parents=True, exist_ok=True)
    lines = ["# @package model", f"# imported from {Path(src_dir).resolve()} by meshtron-hf import"]
    lines += [f"{k}: {json.dumps(v)}" for k, v in dataclasses.asdict(cfg).items()]
    (out / "model" / "imported.yaml").write_text("\n".join(lines) + "\n")
    return path


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(choice: str, original: dict | None) -> torch.dtype:
    """The dtype export writes: `choice` ("auto" = the original config.json's `dtype` /
    `torch_dtype` when there is a base and it names one of DTYPES, else float32)."""
    if choice != "auto":
        return DTYPES[choice]
    named = (original or {}).get("dtype") or (original or {}).get("torch_dtype")
    return DTYPES.get(str(named).removeprefix("torch."), torch.float32)


def export_from_checkpoint(src, out_dir, base=None, dtype: str = "auto", max_file_bytes: int = 5 * 10**9) -> Path:
    """Write the weights of a meshtron checkpoint (a step_N folder, or a checkpoint.dir: its
    newest) as a Hugging Face folder loadable by `AutoModelForCausalLM.from_pretrained`, with
    a generation_config.json (bos/eos/pad ids).

    Streamed: one conversion unit at a time is read from the checkpoint (whatever layout saved
    it), converted and written, in `dtype` (`export_dtype`: with a base, the original model's
    dtype), in safetensors files of at most `max_file_bytes` with an index; the process holds
    one unit's tensors, never the model.

    `base`: the `--out` of `meshtron-hf import` (or the original Hugging Face folder) of the
    model this checkpoint was trained from. Then config.json is the original one with the
    model's shape fields written over it (`hf_config_dict_over`: bos/eos ids,
    output_router_logits and unknown fields kept), the maximum positions stay the original's
    and GPT-2 positions beyond the trained seq_len are the original rows, the generation
    config is the original's (pad = eos when it has none) and the tokenizer files are copied.
    Without `base` the config is meshtron's alone (n_positions = seq_len) and the generation
    config holds the config's bos/eos ids that lie inside the vocabulary."""

    path = resolve_resume(None, str(src))
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    saved = read_meta(path)["model"]
    cfg = GPTConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in fields})
    hf_family(cfg)  # fails early, naming the field, for models transformers cannot hold
    original = read_import_base(base) if base is not None else None
    shapes = hf_tensor_shapes(cfg)
    full_shapes = expected_model_shapes(cfg)
    tensors = stream_hf_tensors(cfg, lambda names: read_full_tensors(path, names, full_shapes))
    if original is None:
        hf_config = hf_config_from_gpt(cfg)
        generation = _generation_config(hf_config.to_dict(), None, cfg.vocab_size)
        copy_files = ()
    else:
        hf_config = hf_config_dict_over(cfg, original["config"])
        generation = _generation_config(hf_config, original["generation"], cfg.vocab_size)
        copy_files = tuple(original["tokenizer_files"])
        if original["positions"] is not None:
            n_positions = hf_config[MAX_POSITION_FIELDS["gpt2"]]
            shapes[_WPE] = (n_positions, cfg.hidden_size)
            tensors = _with_original_positions(tensors, original["positions"], n_positions, cfg, base)
    return save_hf_folder(
        TensorStream(shapes, tensors),
        hf_config,
        out_dir,
        generation_config=generation,
        copy_files=copy_files,
        dtype=export_dtype(dtype, None if original is None else original["config"]),
        max_file_bytes=max_file_bytes,
    )


_WPE = "transformer.wpe.weight"


def _with_original_positions(tensors, positions, n_positions: int, cfg: GPTConfig, base):
    """`tensors` with the trained GPT-2 position table (cfg.seq_len rows) extended to
    `n_positions` rows by the original table's rows beyond it (they were never trained)."""
    if tuple(positions.shape) != (n_positions, cfg.hidden_size):
        raise HFConversionError(
            f"--base {base}: the original position table has shape {tuple(positions.shape)}, "
            f"expected ({n_positions}, {cfg.hidden_size}) from its config.json"
        )
    for key, tensor in tensors:
        if key == _WPE and n_positions != tensor.shape[0]:
            tensor = torch.cat([tensor, positions[cfg.seq_len :].to(tensor.dtype)], dim=0)
        yield key, tensor


def _generation_config(config: dict, original: dict | None, vocab_size: int) -> dict:
    """generation_config.json: the original one (if any) completed with config.json's
    bos/eos/pad ids, pad = eos when there is no pad token (what `generate` falls back to).
    Without an original, ids outside the vocabulary (transformers' GPT-2 defaults on a
    smaller model) are left out."""
    gen = dict(original or {})
    # transformers rebuilds a generation config marked as derived from config.json at generate
    # time, which would drop the pad id added here.
    gen.pop("_from_model_config", None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        if gen.get(key) is None and value is not None:
            ids = value if isinstance(value, list) else [value]
            if original is not None or all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
                gen[key] = value
    eos = gen.get("eos_token_id")
    if gen.get("pad_token_id") is None and eos is not None:
        gen["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    return gen


def _size(text: str) -> int:
    """Bytes of "5GB", "500MB", "64KB" or a plain integer (argparse type)."""
    import argparse

    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(upper[: -len(unit)]) * factor)
    if upper.isdigit():
        return int(upper)
    raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MB or 1000000")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="meshtron-hf", description="Hugging Face folder <-> meshtron checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face folder -> meshtron checkpoint (weights only)")
    imp.add_argument("--src", required=True, help="a save_pretrained folder (config.json + *.safetensors)")
    imp.add_argument("--out", required=True, help="checkpoint directory to create")
    imp.add_argument(
        "--seq-len", type=int, default=None, help="training sequence length (default: the model's maximum positions)"
    )
    exp = sub.add_parser("export", help="meshtron checkpoint -> Hugging Face folder")
    exp.add_argument("--src", required=True, help="a step_N checkpoint folder or a checkpoint.dir (newest)")
    exp.add_argument("--out", required=True, help="folder to write config.json + model.safetensors into")
    exp.add_argument(
        "--base",
        default=None,
        help="the --out of `meshtron-hf import` (or the original Hugging Face "
        "folder) of the model trained: keeps its config fields, "
        "generation config, tokenizer files and untrained positions",
    )
    exp.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="dtype of the written weights (auto: the --base model's dtype, else float32)",
    )
    exp.add_argument(
        "--max-shard-size", type=_size, default=5 * 10**9, help="largest safetensors file, e.g. 5GB or 500MB (5GB)"
    )
    args = parser.parse_args(argv)

    try:
        if args.command == "import":
            path = import_to_checkpoint(args.src, args.out, args.seq_len)
            print(
                f"meshtron: wrote {path}; train from it with\n  python train.py --config-dir {Path(args.out)} "
                f"+model=imported checkpoint.init_from={path}\nand export the result with\n  meshtron-hf export "
                f"--src CHECKPOINT_DIR --out FOLDER --base {Path(args.out)}"
            )
        else:
            out = export_from_checkpoint(args.src, args.out, args.base, args.dtype, args.max_shard_size)
            print(f"meshtron: wrote {out} (transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    except (HFConversionError, CheckpointError, OSError) as err:  # bad input files, unwritable --out
        print(f"meshtron: {args.command} failed: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
