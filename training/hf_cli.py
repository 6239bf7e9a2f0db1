"""`meshtron-hf import|export` (also `python -m meshtron.training.hf_cli`): a Hugging Face
folder <-> a meshtron checkpoint, single process. Conversion itself is models/hf."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from meshtron.models.config import GPTConfig
from meshtron.models.hf import (
    HFConversionError,
    config_from_hf,
    export_hf_state_dict,
    hf_config_from_gpt,
    hf_family,
    load_hf_state_dict,
    read_hf_folder,
    save_hf_folder,
)
from meshtron.models.gpt import GPT
from meshtron.mpu.mesh import single_process_mesh
from meshtron.training.checkpoint import (
    CheckpointError,
    TrainState,
    load_checkpoint,
    read_meta,
    resolve_resume,
    save_checkpoint,
)

def import_to_checkpoint(src_dir, out_dir, seq_len: int | None = None) -> Path:
    """Convert a `save_pretrained` folder into a weights-only meshtron checkpoint in `out_dir`
    (`out_dir/step_00000000`, loadable under any layout with `checkpoint.init_from`), plus
    `out_dir/model/imported.yaml`, the Hydra model config of it. Single process."""

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
    (out / "model").mkdir(parents=True, exist_ok=True)
    lines = ["# @package model", f"# imported from {Path(src_dir).resolve()} by meshtron-hf import"]
    lines += [f"{k}: {json.dumps(v)}" for k, v in dataclasses.asdict(cfg).items()]
    (out / "model" / "imported.yaml").write_text("\n".join(lines) + "\n")
    return path


def export_from_checkpoint(src, out_dir) -> Path:
    """Write the weights of a meshtron checkpoint (a step_N folder, or a checkpoint.dir: its
    newest) as a Hugging Face folder loadable by `AutoModelForCausalLM.from_pretrained`."""

    path = resolve_resume(None, str(src))
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    saved = read_meta(path)["model"]
    cfg = GPTConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in fields})
    hf_family(cfg)  # fails early, naming the field, for models transformers cannot hold
    mesh = single_process_mesh()
    model = GPT(cfg, mesh)
    load_checkpoint(path, [model], None, mesh, weights_only=True)
    return save_hf_folder(export_hf_state_dict(model, mesh), hf_config_from_gpt(cfg), out_dir)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="meshtron-hf", description="Hugging Face folder <-> meshtron checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face folder -> meshtron checkpoint (weights only)")
    imp.add_argument("--src", required=True, help="a save_pretrained folder (config.json + *.safetensors)")
    imp.add_argument("--out", required=True, help="checkpoint directory to create")
    imp.add_argument("--seq-len", type=int, default=None, help="training sequence length (default: the "
                                                               "model's maximum positions)")
    exp = sub.add_parser("export", help="meshtron checkpoint -> Hugging Face folder")
    exp.add_argument("--src", required=True, help="a step_N checkpoint folder or a checkpoint.dir (newest)")
    exp.add_argument("--out", required=True, help="folder to write config.json + model.safetensors into")
    args = parser.parse_args(argv)

    try:
        if args.command == "import":
            path = import_to_checkpoint(args.src, args.out, args.seq_len)
            print(f"meshtron: wrote {path}; train from it with\n  python train.py --config-dir {Path(args.out)} "
                  f"+model=imported checkpoint.init_from={path}")
        else:
            out = export_from_checkpoint(args.src, args.out)
            print(f"meshtron: wrote {out} (transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    except (HFConversionError, CheckpointError, OSError) as err:  # bad input files, unwritable --out
        print(f"meshtron: {args.command} failed: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
