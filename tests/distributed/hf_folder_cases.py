"""Hugging Face folders read straight into a layout (`checkpoint.init_from=hf:FOLDER`'s load):
every rank memory-maps the folder's safetensors and reads only the slices of its own shards.

Each case has rank 0 save a tiny random transformers model into a folder all ranks share
(several safetensors shards with an index, or hand-written per-expert Mixtral tensors), then
every rank loads it with `open_hf_weights` + `load_hf_weights` and checks:
- the bytes it read are exactly its shards' elements (vocabulary padding excluded) times the
  file's element size: nothing else was read;
- its parameters equal the one-process import path's shards (`load_hf_state_dict` of the full
  dict), bitwise;
- the logits equal transformers' (fp32; a bf16 folder: transformers' model of the same bf16
  values in fp32).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron.models import hf as mhf
from meshtron.models.gpt import build_model_chunks
from meshtron.mpu.init import local_offsets
from meshtron.mpu.mesh import ParallelConfig, build_mesh
from tests.distributed.hf_cases import ATOL, SEQ, VOCAB, _forward, hf_model

SHARD_SIZE = "40KB"  # several safetensors files with an index, even for the tiny models


def _shared_folder(write) -> Path:
    """A folder rank 0 fills with `write(path)`, the same path on every rank (after it is written)."""
    holder = [tempfile.mkdtemp(prefix="hf_folder_") if dist.get_rank() == 0 else None]
    if dist.get_rank() == 0:
        write(Path(holder[0]))
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def _remove(folder: Path) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)


def _shard_bytes(chunks, mesh, itemsize: int) -> int:
    """Bytes of this rank's shards as stored in the folder: vocabulary padding rows are not read."""
    total = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            rows = param.shape[0]
            if name in ("embed.weight", "head.weight"):
                rows = max(0, min(rows, chunk.cfg.vocab_size - local_offsets(param, mesh)[0]))
            total += rows * (param.numel() // max(param.shape[0], 1)) * itemsize
    return total


def _load_and_compare(hf, folder: Path, par: ParallelConfig, itemsize: int, **overrides) -> None:
    """Load `folder` at layout `par` and check bytes read, equality with the dict import and
    transformers' logits (`hf` in fp32)."""
    cfg = mhf.config_from_hf(hf.config, **overrides)
    mesh = build_mesh(par, cfg)
    chunks = [c.eval() for c in build_model_chunks(cfg, mesh)]
    with mhf.open_hf_weights(folder, mhf.hf_family(cfg)) as source:
        mhf.load_hf_weights(chunks, source)
        read = source.bytes_read
    want_bytes = _shard_bytes(chunks, mesh, itemsize)
    if read != want_bytes:
        raise AssertionError(f"rank {mesh.rank} read {read} bytes, its shards hold {want_bytes}")
    reference = [c.eval() for c in build_model_chunks(cfg, mesh)]
    mhf.load_hf_state_dict(reference, {k: v.float() for k, v in hf.state_dict().items()})
    for chunk, ref in zip(chunks, reference):
        for (name, got), (_, want) in zip(chunk.named_parameters(), ref.named_parameters()):
            if not torch.equal(got, want):
                raise AssertionError(f"rank {mesh.rank}: {name} differs from the dict import's shard")
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = _forward(chunks, mesh, ids)
        if got is not None:
            err = (got - hf(ids).logits).abs().max().item()
            if not err <= ATOL:
                raise AssertionError(f"logits max abs error {err:.3e} > {ATOL:.0e} on rank {mesh.rank}")


def qwen3_tp2_bf16_folder() -> None:
    """A bf16 Qwen3 in several shards: the slices come back in bf16 (2 bytes each)."""
    hf = hf_model("qwen3")
    bf16 = hf_model("qwen3").to(torch.bfloat16)
    folder = _shared_folder(lambda path: bf16.save_pretrained(path, max_shard_size=SHARD_SIZE))
    # the reference: transformers in fp32 with the bf16 weights (its RoPE buffers stay fp32)
    hf.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    try:
        if not (folder / "model.safetensors.index.json").is_file():
            raise AssertionError("the bf16 folder was expected in several shards with an index")
        _load_and_compare(hf, folder, ParallelConfig(tp=2), itemsize=2)
    finally:
        _remove(folder)


def gpt2_tp2_short_seq_folder() -> None:
    """A tied GPT-2 trained at seq_len 16 < n_positions 32: the first 16 positions are read."""
    hf = hf_model("gpt2")
    folder = _shared_folder(lambda path: hf.save_pretrained(path, max_shard_size=SHARD_SIZE))
    try:
        _load_and_compare(hf, folder, ParallelConfig(tp=2), itemsize=4, seq_len=SEQ)
    finally:
        _remove(folder)


def _write_per_expert(hf, path: Path, qwen: bool = False) -> None:
    """`hf`'s weights under the original per-expert names: Mixtral's
    block_sparse_moe.experts.<e>.w1/w2/w3, or (`qwen`) Qwen-MoE's mlp.experts.<e>.gate_proj/
    down_proj/up_proj (the Hub checkpoints' layout; transformers 5 fuses them on load)."""
    import safetensors.torch

    block, (gate_name, up_name, down_name) = (
        ("mlp", ("gate_proj", "up_proj", "down_proj"))
        if qwen
        else (
            "block_sparse_moe",
            ("w1", "w3", "w2"),
        )
    )
    tensors = {}
    for key, value in hf.state_dict().items():
        if ".mlp.experts.gate_up_proj" in key:
            layer = key.split(".mlp.")[0]
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                tensors[f"{layer}.{block}.experts.{e}.{gate_name}.weight"] = gate[e].clone()
                tensors[f"{layer}.{block}.experts.{e}.{up_name}.weight"] = up[e].clone()
        elif ".mlp.experts.down_proj" in key:
            layer = key.split(".mlp.")[0]
            for e in range(value.shape[0]):
                tensors[f"{layer}.{block}.experts.{e}.{down_name}.weight"] = value[e].clone()
        else:
            tensors[key.replace(".mlp.gate.", f".{block}.gate.")] = value.clone()
    hf.config.save_pretrained(path)
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def mixtral_ep2_per_expert_folder() -> None:
    """Original-format Mixtral experts: each rank reads only its experts' tensors."""
    hf = hf_model("mixtral")
    folder = _shared_folder(lambda path: _write_per_expert(hf, path))
    try:
        _load_and_compare(hf, folder, ParallelConfig(tp=1, ep=2), itemsize=4)
    finally:
        _remove(folder)


def qwen3_moe_ep2_per_expert_folder() -> None:
    """Qwen3-MoE in the Hub's per-expert layout (mlp.experts.<e>.gate_proj...): each rank reads
    only its experts' tensors; the dense middle layer's MLP is read like Llama's."""
    hf = hf_model("qwen3_moe")
    folder = _shared_folder(lambda path: _write_per_expert(hf, path, qwen=True))
    try:
        _load_and_compare(hf, folder, ParallelConfig(tp=1, ep=2), itemsize=4)
    finally:
        _remove(folder)


def llama3_pp2_tp2_folder() -> None:
    """Llama 3.1 RoPE scaling through two stages of tp=2, from an indexed multi-file folder."""
    hf = hf_model("llama3")
    folder = _shared_folder(lambda path: hf.save_pretrained(path, max_shard_size=SHARD_SIZE))
    try:
        _load_and_compare(hf, folder, ParallelConfig(tp=2, pp=2), itemsize=4)
    finally:
        _remove(folder)


def cases_for_world(world_size: int) -> list[str]:
    if world_size == 2:
        return [
            "qwen3_tp2_bf16_folder",
            "gpt2_tp2_short_seq_folder",
            "mixtral_ep2_per_expert_folder",
            "qwen3_moe_ep2_per_expert_folder",
        ]
    if world_size == 4:
        return ["llama3_pp2_tp2_folder"]
    return []
