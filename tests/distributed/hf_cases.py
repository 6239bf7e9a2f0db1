"""Hugging Face interop across processes: every rank builds the same tiny random HF model
(fixed seed), loads the full state dict into its shards of a parallel meshtron model, and
checks that the gathered logits equal HF's (max abs error <= 1e-4, fp32) and that
`export_hf_state_dict` gives back the original state dict bitwise on global rank 0.

Layouts: GPT-2 / Llama / Mixtral at tp=2, Mixtral at ep=2 (world 2); GPT-2 / Llama at
pp=2 x tp=2 and Mixtral at pp=2 x ep=2 (world 4), the pipeline forward run stage by stage
with point-to-point sends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.gpt import build_model_chunks
from mpu.mesh import ParallelConfig, build_mesh
from mpu.pipeline import activation_shape

ATOL = 1e-4
VOCAB = 300  # padded to 128*tp: padding rows are exercised
SEQ = 16
SEED = 0


def hf_config(family: str, **kw):
    """A tiny transformers config: hidden 64, 2 layers, vocab 300 (Llama/Mixtral with GQA)."""
    import transformers
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=32, **{**common, **kw})
    llama = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, max_position_embeddings=32, **common)
    if family == "llama":
        return transformers.LlamaConfig(**{**llama, **kw})
    return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **{**llama, **kw})


def hf_model(family: str, seed: int = SEED, **kw):
    """The randomly initialized HF causal LM of `hf_config(family)`, the same in every process."""
    import transformers
    torch.manual_seed(seed)
    cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
           "mixtral": transformers.MixtralForCausalLM}[family]
    return cls(hf_config(family, **kw)).eval()


def _forward(chunks, mesh, ids: torch.Tensor) -> torch.Tensor | None:
    """Full logits [b, s, vocab] on the last pipeline stage (None on the others)."""
    if mesh.pp_size == 1:
        (model,) = chunks
        return model.full_logits(model(ids))
    (chunk,) = chunks
    stage_ranks = dist.get_process_group_ranks(mesh.pp)
    if mesh.pp_rank == 0:
        x = chunk(ids)
    else:
        x = torch.empty(activation_shape(mesh, ids.shape[1], ids.shape[0], chunk.cfg.hidden_size))
        dist.recv(x, src=stage_ranks[mesh.pp_rank - 1])
        x = chunk(x)
    if mesh.pp_rank < mesh.pp_size - 1:
        dist.send(x.contiguous(), dst=stage_ranks[mesh.pp_rank + 1])
        return None
    return chunk.full_logits(x)


def check(family: str, par: ParallelConfig) -> None:
    from models import hf as mhf
    hf = hf_model(family)
    state = hf.state_dict()
    cfg = mhf.config_from_hf(hf.config)
    mesh = build_mesh(par, cfg)
    chunks = [c.eval() for c in build_model_chunks(cfg, mesh)]
    mhf.load_hf_state_dict(chunks, state)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    problem = None
    with torch.no_grad():
        got = _forward(chunks, mesh, ids)
        if got is not None:
            want = hf(ids).logits
            if got.shape != want.shape:
                problem = f"logits shape {tuple(got.shape)} != HF {tuple(want.shape)}"
            elif not (err := (got - want).abs().max().item()) <= ATOL:
                problem = f"logits max abs error {err:.3e} > {ATOL:.0e} on rank {mesh.rank}"
    exported = mhf.export_hf_state_dict(chunks, mesh)  # collective: before any rank raises
    if problem:
        raise AssertionError(problem)
    if mesh.rank != 0:
        if exported is not None:
            raise AssertionError(f"rank {mesh.rank} got an exported state dict; only rank 0 should")
        return
    if sorted(exported) != sorted(state):
        raise AssertionError(f"exported keys differ: missing {sorted(set(state) - set(exported))}, "
                             f"extra {sorted(set(exported) - set(state))}")
    for key, value in state.items():
        if exported[key].dtype != value.dtype or not torch.equal(exported[key], value):
            raise AssertionError(f"exported {key} differs from the original")


def gpt2_tp2() -> None:
    check("gpt2", ParallelConfig(tp=2))


def llama_tp2() -> None:
    check("llama", ParallelConfig(tp=2))


def mixtral_tp2() -> None:
    check("mixtral", ParallelConfig(tp=2))


def mixtral_ep2() -> None:
    check("mixtral", ParallelConfig(tp=1, ep=2))


def gpt2_pp2_tp2() -> None:
    check("gpt2", ParallelConfig(tp=2, pp=2))


def llama_pp2_tp2() -> None:
    check("llama", ParallelConfig(tp=2, pp=2))


def mixtral_pp2_ep2() -> None:
    check("mixtral", ParallelConfig(tp=1, pp=2, ep=2))


def cases_for_world(world_size: int) -> list[str]:
    if world_size == 2:
        return ["gpt2_tp2", "llama_tp2", "mixtral_tp2", "mixtral_ep2"]
    if world_size == 4:
        return ["gpt2_pp2_tp2", "llama_pp2_tp2", "mixtral_pp2_ep2"]
    return []
