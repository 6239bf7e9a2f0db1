"""Hugging Face interop across processes: every rank builds the same tiny random HF model
(fixed seed), loads the full state dict into its shards of a parallel meshtron model, and
checks that the gathered logits equal HF's (max abs error <= 1e-5, fp32; measured <= 2.4e-7)
and that `export_hf_state_dict` gives back the original state dict bitwise on global rank 0.
Under context parallelism each rank compares the logits of its own cp shard of the sequence.

Layouts: GPT-2 / Llama / Mistral / Llama 3.1 RoPE / Qwen2 / Qwen3 / Mixtral at tp=2, Mixtral at
ep=2, Mistral / Llama 3.1 / Qwen2 at pp=2, Mistral / Llama 3.1 / Qwen2 / Qwen3 at cp=2 (ring
and a2a alternating) (world 2); GPT-2 / Llama / Qwen3 at pp=2 x tp=2 and Mixtral at pp=2 x
ep=2 (world 4), the pipeline forward run stage by stage with point-to-point sends.

Training fidelity (`mixtral_train_ep2`): a two-layer Mixtral imported from transformers and
trained by meshtron at ep=2 (dp=2, one microbatch per rank and step) gives, step by step, the
total objective (LM loss + router_aux_loss_coef x aux pooled over layers) of transformers
trained with gradient accumulation over the same per-rank microbatches, and the same weights
after the steps. The issue-39 families train the same way (`train_like_transformers`): Qwen3
at tp=2 and at cp=2 (ring), Llama 3.1 at pp=2 (1F1B over two microbatches), Mistral at cp=2
(ring), Qwen2 at cp=2 (a2a); each step's objective to STEP_RTOL (measured <= 1.8e-7), the
weights after 4 steps to 1e-5 (measured <= 7.2e-6, Qwen3's embedding at cp=2; 6.0e-6 at dp=2:
fp32 summation order through AdamW, see TRAIN_EPS). The single-process version is
tests/test_hf.py::test_mixtral_trains_like_transformers; the helpers (`tiny_mixtral`,
`hf_train_step`, `meshtron_trainer`, ...) serve both, and `pooling_gap` measures how far
meshtron's per-layer aux_loss_layers="sum" is from transformers (numbers in models/hf/).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from meshtron.models.gpt import build_model_chunks
from meshtron.mpu.context_parallel import shard_sequence
from meshtron.mpu.mesh import ParallelConfig, build_mesh, single_process_mesh
from meshtron.pipeline.executor import activation_shape
from meshtron.training.step import StepResult

ATOL = 1e-5
VOCAB = 300  # padded to 128*tp: padding rows are exercised
SEQ = 16
SEED = 0


# Llama 3.1's rope scaling (original context 32 of hf_config's 64 positions, theta 100): the
# tiny head's 8 frequencies fall in all three bands (kept, interpolated, divided by factor).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 100.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def hf_config(family: str, **kw):
    """A tiny transformers config: hidden 64, 2 layers, vocab 300 (Llama-like families and
    Mixtral with GQA; "llama3": Llama with LLAMA3_ROPE)."""
    import transformers

    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=32, **{**common, **kw})
    llama = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=32,
        **common,
    )
    if family == "llama":
        return transformers.LlamaConfig(**{**llama, **kw})
    if family == "llama3":  # Llama 3.1 / 3.2 RoPE scaling, stretched within the tiny context
        return transformers.LlamaConfig(
            **{**llama, "max_position_embeddings": 64, "rope_parameters": dict(LLAMA3_ROPE), **kw}
        )
    if family == "mistral":
        return transformers.MistralConfig(**{**llama, "sliding_window": None, **kw})
    if family == "qwen2":
        return transformers.Qwen2Config(**{**llama, **kw})
    if family == "qwen3":  # QK-norm, and heads 24 wide at hidden 64 / 4 heads (model.kv_channels)
        return transformers.Qwen3Config(**{**llama, "head_dim": 24, **kw})
    # Fine-grained MoE (issue 40): 3 layers, the middle one dense (mlp_only_layers), 8 experts of
    # width 32, top-3, the router losses trained (output_router_logits).
    qwen_moe = dict(
        llama,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        mlp_only_layers=[1],
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    )
    if family == "qwen3_moe":  # + Qwen3's QK-norm and 24-wide heads, top-k renormalized
        return transformers.Qwen3MoeConfig(**{**qwen_moe, "head_dim": 24, "norm_topk_prob": True, **kw})
    if family == "qwen2_moe":  # + a shared expert of width 48 behind a sigmoid gate, q/k/v biases, raw top-k
        return transformers.Qwen2MoeConfig(**{**qwen_moe, "shared_expert_intermediate_size": 48, **kw})
    if family == "deepseek_v3":  # MLA, the first layer dense, sigmoid top-4 of 8 in the best 2 of 4 groups
        deepseek = dict(
            vocab_size=VOCAB,
            bos_token_id=0,
            eos_token_id=1,
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=96,
            max_position_embeddings=32,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
        )
        return transformers.DeepseekV3Config(**{**deepseek, **kw})
    return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **{**llama, **kw})


def hf_model(family: str, seed: int = SEED, **kw):
    """The randomly initialized HF causal LM of `hf_config(family)`, the same in every process."""
    import transformers

    torch.manual_seed(seed)
    cls = {
        "gpt2": transformers.GPT2LMHeadModel,
        "llama": transformers.LlamaForCausalLM,
        "llama3": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "qwen2_moe": transformers.Qwen2MoeForCausalLM,
        "deepseek_v3": transformers.DeepseekV3ForCausalLM,
        "mixtral": transformers.MixtralForCausalLM,
    }[family]
    model = cls(hf_config(family, **kw)).eval()
    with torch.no_grad():  # transformers starts DeepSeek's expert-choice biases at 0: make them matter
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.05)
    return model


def _forward(chunks, mesh, ids: torch.Tensor) -> torch.Tensor | None:
    """Logits [b, s/cp, vocab] of this rank's cp shard of the full sequences `ids` [b, s]
    (`shard_sequence`'s load-balanced chunks) on the last pipeline stage (None on the others)."""
    seq = ids.shape[1]
    if mesh.cp_size > 1:
        ids = shard_sequence(ids, 1, mesh.cp_size, mesh.cp_rank)
    if mesh.pp_size == 1:
        (model,) = chunks
        return model.full_logits(model(ids))
    (chunk,) = chunks
    stage_ranks = dist.get_process_group_ranks(mesh.pp)
    if mesh.pp_rank == 0:
        x = chunk(ids)
    else:
        x = torch.empty(activation_shape(mesh, seq, ids.shape[0], chunk.cfg.hidden_size))
        dist.recv(x, src=stage_ranks[mesh.pp_rank - 1])
        x = chunk(x)
    if mesh.pp_rank < mesh.pp_size - 1:
        dist.send(x.contiguous(), dst=stage_ranks[mesh.pp_rank + 1])
        return None
    return chunk.full_logits(x)


def check(family: str, par: ParallelConfig, **hf_kw) -> None:
    from meshtron.models import hf as mhf

    hf = hf_model(family, **hf_kw)
    state = hf.state_dict()
    cfg = mhf.config_from_hf(hf.config)
    if par.pp > 1 and cfg.is_moe:  # the aux pooled across layers needs one stage (forward only here)
        cfg = dataclasses.replace(cfg, aux_loss_layers="sum")
    mesh = build_mesh(par, cfg)
    chunks = [c.eval() for c in build_model_chunks(cfg, mesh)]
    mhf.load_hf_state_dict(chunks, state)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    problem = None
    with torch.no_grad():
        got = _forward(chunks, mesh, ids)
        if got is not None:
            want = shard_sequence(hf(ids).logits, 1, mesh.cp_size, mesh.cp_rank)
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
        raise AssertionError(
            f"exported keys differ: missing {sorted(set(state) - set(exported))}, "
            f"extra {sorted(set(exported) - set(state))}"
        )
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


def mistral_tp2() -> None:
    check("mistral", ParallelConfig(tp=2))


def llama3_tp2() -> None:
    check("llama3", ParallelConfig(tp=2))


def qwen2_tp2() -> None:  # the q/k/v biases split like the fused QKV rows
    check("qwen2", ParallelConfig(tp=2))


def qwen3_tp2() -> None:  # the heads (24 wide) split over tp, the q/k norms replicated
    check("qwen3", ParallelConfig(tp=2))


def qwen3_train_tp2() -> None:
    """Qwen3 at tp=2: every rank norms only its own heads' q and k, so the q/k norm weights'
    gradients are partial sums that must be summed over tp; 4 AdamW steps from the imported
    weights follow transformers' losses, and every weight (the norms' included) after them."""
    train_like_transformers(hf_model("qwen3", vocab_size=TRAIN_VOCAB).train(), ParallelConfig(tp=2))


def qwen2_moe_tp2() -> None:  # the shared expert split over tp like an MLP, its sigmoid gate replicated
    check("qwen2_moe", ParallelConfig(tp=2))


def qwen3_moe_ep2() -> None:  # 8 experts over ep=2, the middle layer dense
    check("qwen3_moe", ParallelConfig(tp=1, ep=2))


def qwen2_moe_train_tp2_ep2() -> None:
    """Qwen2-MoE at tp=2 x ep=2: each tp rank scores its own sequence shard through the shared
    expert's gate, so the gate's gradient is a partial sum that must be summed over tp; 4 AdamW
    steps with the pooled router aux follow transformers."""
    hf = hf_model("qwen2_moe", vocab_size=TRAIN_VOCAB).train()
    train_like_transformers(hf, ParallelConfig(tp=2, ep=2), loose=("k_proj.bias",))


def qwen3_moe_train_ep2() -> None:
    """Qwen3-MoE at ep=2 (dp=2): top-3 of 8 renormalized, QK-norm, a dense middle layer."""
    train_like_transformers(hf_model("qwen3_moe", vocab_size=TRAIN_VOCAB).train(), ParallelConfig(tp=1, ep=2))


def deepseek_v3_tp2_ep2() -> None:
    """MLA heads split over tp (latents, norms and the rope key replicated), 8 sigmoid-routed
    experts over ep with group limits and the expert-choice bias, a shared expert over tp."""
    check("deepseek_v3", ParallelConfig(tp=2, ep=2))


def deepseek_v3_train_tp2_ep2() -> None:
    train_like_transformers(hf_model("deepseek_v3", vocab_size=TRAIN_VOCAB).train(), ParallelConfig(tp=2, ep=2))


def deepseek_v3_pp2_tp2() -> None:  # 4 layers (the first dense) over two stages of tp=2
    check("deepseek_v3", ParallelConfig(tp=2, pp=2), num_hidden_layers=4)


def mistral_window_cp2_a2a() -> None:
    """A sliding window of 5 over 16 tokens under the all-to-all cp (each rank attends over whole
    sequences for its heads): transformers' logits."""
    check("mistral", ParallelConfig(tp=1, cp=2, cp_comm="a2a"), sliding_window=5)


def mistral_window_tp2() -> None:  # the window mask per position, the heads split over tp
    check("mistral", ParallelConfig(tp=2), sliding_window=5)


def mistral_window_pp2() -> None:
    check("mistral", ParallelConfig(tp=1, pp=2), sliding_window=5)


def mistral_window_train_cp2_ring() -> None:
    """The ring's score tiles mask the window (query i sees keys i-5 < j): 4 AdamW steps like
    transformers, the load-balanced chunks passing keys far outside the window around."""
    hf = hf_model("mistral", vocab_size=TRAIN_VOCAB, sliding_window=5).train()
    train_like_transformers(hf, ParallelConfig(tp=1, cp=2, cp_comm="ring"))


def mistral_window_train_cp2_a2a() -> None:
    hf = hf_model("mistral", vocab_size=TRAIN_VOCAB, sliding_window=5).train()
    train_like_transformers(hf, ParallelConfig(tp=1, cp=2, cp_comm="a2a"))


def llama3_train_pp2() -> None:
    """Llama 3.1 RoPE through two pipeline stages: 2 microbatches per step under 1F1B."""
    train_like_transformers(hf_model("llama3", vocab_size=TRAIN_VOCAB).train(), ParallelConfig(tp=1, pp=2), None, 2)


def mistral_train_cp2_ring() -> None:
    train_like_transformers(hf_model("mistral", vocab_size=TRAIN_VOCAB).train(), ParallelConfig(tp=1, cp=2))


def qwen2_train_cp2_a2a() -> None:
    """q/k/v biases under Ulysses cp; k_proj biases to 1e-4 (test_hf_families.py says why)."""
    train_like_transformers(
        hf_model("qwen2", vocab_size=TRAIN_VOCAB).train(),
        ParallelConfig(tp=1, cp=2, cp_comm="a2a"),
        loose=("k_proj.bias",),
    )


def qwen3_train_cp2_ring() -> None:
    """The q/k norm weights replicated over cp: their gradients summed over the sequence shards."""
    train_like_transformers(hf_model("qwen3", vocab_size=TRAIN_VOCAB).train(), ParallelConfig(tp=1, cp=2))


def mistral_pp2() -> None:
    check("mistral", ParallelConfig(tp=1, pp=2))


def llama3_pp2() -> None:  # the scaled inverse frequencies on each stage
    check("llama3", ParallelConfig(tp=1, pp=2))


def qwen2_pp2() -> None:
    check("qwen2", ParallelConfig(tp=1, pp=2))


# cp=2: each rank holds chunks (r, 3 - r) of 4, so RoPE (llama3's scaled frequencies included)
# sees positions that are not 0..s/2-1; ring and a2a (Ulysses: 4 heads / 2 kv heads split
# over cp, Qwen3's 24-wide heads) alternate over the families.


def mistral_cp2_ring() -> None:
    check("mistral", ParallelConfig(tp=1, cp=2, cp_comm="ring"))


def llama3_cp2_a2a() -> None:
    check("llama3", ParallelConfig(tp=1, cp=2, cp_comm="a2a"))


def qwen2_cp2_ring() -> None:
    check("qwen2", ParallelConfig(tp=1, cp=2, cp_comm="ring"))


def qwen3_cp2_a2a() -> None:
    check("qwen3", ParallelConfig(tp=1, cp=2, cp_comm="a2a"))


def qwen3_pp2_tp2() -> None:  # QK-norm and 24-wide heads through two stages of tp=2
    check("qwen3", ParallelConfig(tp=2, pp=2))


def gpt2_pp2_tp2() -> None:
    check("gpt2", ParallelConfig(tp=2, pp=2))


def llama_pp2_tp2() -> None:
    check("llama", ParallelConfig(tp=2, pp=2))


def mixtral_pp2_ep2() -> None:
    check("mixtral", ParallelConfig(tp=1, pp=2, ep=2))


# ------------------------------------------------------------------ training fidelity

TRAIN_VOCAB = 200
TRAIN_BATCH = 4  # sequences per global batch
TRAIN_STEPS = 4
TRAIN_LR, TRAIN_BETAS, TRAIN_WD = 1e-3, (0.9, 0.95), 0.1
# AdamW eps 1e-6: at 1e-8, rarely seen embedding rows turn fp32 summation-order noise into
# 2e-5 weight differences (2 layers, 2 microbatches, one process vs transformers); 7e-7 at 1e-6.
TRAIN_EPS = 1e-6
AUX_COEF = 0.02  # Mixtral-8x7B's router_aux_loss_coef
TRAIN_RTOL = 1e-5  # tests/test_hf.py's one-process Mixtral
STEP_RTOL = 1e-6  # each step's objective in train_like_transformers and test_hf_families.py


def tiny_mixtral(output_router_logits: bool, coef: float = AUX_COEF, layers: int = 1, seed: int = SEED):
    """A tiny random transformers Mixtral in train mode (fp32): `layers` layers, hidden 64,
    4 experts top-2, vocab 200, with the given router loss fields."""
    return hf_model(
        "mixtral",
        seed,
        num_hidden_layers=layers,
        vocab_size=TRAIN_VOCAB,
        output_router_logits=output_router_logits,
        router_aux_loss_coef=coef,
    ).train()


def train_batch(step: int, batch: int = TRAIN_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) [batch, SEQ] of training step `step`: targets are inputs shifted by one."""
    tokens = torch.randint(0, TRAIN_VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(1000 + step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def split_rows(batch: tuple[torch.Tensor, torch.Tensor], parts: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`batch` cut into `parts` equal microbatches of consecutive rows."""
    inputs, targets = batch
    rows = inputs.shape[0] // parts
    return [(inputs[i * rows : (i + 1) * rows], targets[i * rows : (i + 1) * rows]) for i in range(parts)]


def hf_adamw(hf) -> torch.optim.AdamW:
    """torch AdamW over the HF model with meshtron's grouping (training/optim.py): weight decay
    on parameters with ndim >= 2 only."""
    params = [p for p in hf.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": TRAIN_WD},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=TRAIN_LR, betas=TRAIN_BETAS, eps=TRAIN_EPS)


def hf_train_step(hf, optimizer, microbatches) -> float:
    """One transformers step over `microbatches`; returns the total objective it trained.

    One microbatch: `outputs.loss` itself (mean LM loss, plus router_aux_loss_coef x aux when
    output_router_logits). Several (gradient accumulation): each microbatch contributes
    sum(LM loss)/global tokens + coef x aux_mb / num_microbatches, so the objective is the
    global mean LM loss plus coef x the mean over microbatches of their aux."""
    optimizer.zero_grad(set_to_none=True)
    tokens = sum(y.numel() for _, y in microbatches)
    total = 0.0
    for inputs, targets in microbatches:
        if len(microbatches) == 1:
            objective = hf(input_ids=inputs, labels=targets, shift_labels=targets).loss
        else:
            out = hf(input_ids=inputs)
            objective = (
                torch.nn.functional.cross_entropy(
                    out.logits.reshape(-1, out.logits.shape[-1]).float(), targets.reshape(-1), reduction="sum"
                )
                / tokens
            )
            if getattr(out, "aux_loss", None) is not None:  # MoE models only
                objective = objective + hf.config.router_aux_loss_coef * out.aux_loss / len(microbatches)
        objective.backward()
        total += objective.item()
    optimizer.step()
    return total


def meshtron_trainer(hf, par: ParallelConfig | None = None, **overrides):
    """(model, reducer, optimizer, mesh): meshtron at layout `par` (None: one process)
    holding `hf`'s current weights, with the AdamW settings of `hf_adamw`; `overrides`
    replace fields of the imported config."""
    from meshtron.dp.grad_reduce import DataParallelGradReducer
    from meshtron.models import hf as mhf
    from meshtron.training.optim import build_optimizer

    cfg = dataclasses.replace(mhf.config_from_hf(hf.config, seq_len=SEQ), **overrides)
    mesh = single_process_mesh() if par is None else build_mesh(par, cfg)
    (model,) = build_model_chunks(cfg, mesh)
    mhf.load_hf_state_dict(model, hf.state_dict())
    reducer = DataParallelGradReducer(list(model.named_parameters()), mesh, bucket_mb=0.01)
    optimizer = build_optimizer(model, lr=TRAIN_LR, weight_decay=TRAIN_WD, betas=TRAIN_BETAS, eps=TRAIN_EPS)
    return model, reducer, optimizer, mesh


def meshtron_objective(out: StepResult, cfg) -> float:
    """The total objective of a `train_step` result: its `loss` is the LM loss alone and its
    `aux_loss` the unweighted aux (summed over MoE layers), so add aux_loss_coef x aux."""
    total = out.loss
    if cfg.is_moe and cfg.aux_loss_coef > 0:
        total = total + cfg.aux_loss_coef * out.aux_loss
    return float(total)


def relative(got: float, want: float) -> float:
    return abs(got - want) / max(abs(want), 1e-12)


def compare_trained_weights(exported: dict, hf, rtol: float, loose=(), loose_rtol: float = 1e-4) -> str | None:
    """The first HF tensor whose exported meshtron value differs by more than `rtol`
    (tensor-level relative error; `loose_rtol` for names ending with one of `loose`), or None."""
    for key, want in hf.state_dict().items():
        tol = loose_rtol if key.endswith(tuple(loose)) else rtol
        err = ((exported[key].double() - want.double()).norm() / want.double().norm().clamp(min=1e-12)).item()
        if not err <= tol:
            return f"weight {key}: relative error {err:.3e} > {tol:.0e}"
    return None


def pooling_gap(layers: int = 2, coef: float = AUX_COEF, steps: int = 1, aux_loss_layers: str = "sum") -> dict:
    """How far meshtron with `aux_loss_layers` is from transformers' cross-layer pooled aux on
    `tiny_mixtral(True, coef, layers)` trained `steps` steps on both sides (one process).

    transformers' aux pools all layers' router statistics into one f, P pair; "sum" adds
    per-layer aux values (imported aux_loss_coef = coef x top_k is exact for one layer),
    "pooled" (the import's choice) reproduces transformers.
    Returns per-step lists: `pooled` (transformers' aux / top_k), `layers` (meshtron's
    per-layer aux values), `lm_hf` / `lm_mt` (LM losses) and `total_hf` / `total_mt`
    (objectives), plus `router_grad_err` (per layer, relative error of meshtron's router
    weight gradient vs transformers' at the initial weights on step 0's batch)."""
    from meshtron.training.step import train_step

    hf = tiny_mixtral(True, coef, layers)
    model, reducer, optimizer, mesh = meshtron_trainer(hf, aux_loss_layers=aux_loss_layers)
    k = hf.config.num_experts_per_tok
    inputs, targets = train_batch(0)
    hf(input_ids=inputs, labels=targets, shift_labels=targets).loss.backward()
    (model.loss_per_token(model(inputs), targets).mean() + model.aux_loss()).backward()
    grad_err = []
    for i in range(layers):
        got, want = model.layers[str(i)].mlp.router.weight.grad, hf.model.layers[i].mlp.gate.weight.grad
        grad_err.append(((got - want).norm() / want.norm()).item())
    model.zero_grad(set_to_none=True)
    out = {
        "pooled": [],
        "layers": [],
        "lm_hf": [],
        "lm_mt": [],
        "total_hf": [],
        "total_mt": [],
        "router_grad_err": grad_err,
    }
    hf_opt = hf_adamw(hf)
    for step in range(steps):
        inputs, targets = train_batch(step)
        with torch.no_grad():
            ref = hf(input_ids=inputs, labels=targets, shift_labels=targets)
        lm_hf = ref.loss.item() - coef * ref.aux_loss.item()
        result = train_step(model, reducer, optimizer, [(inputs, targets)], mesh, lr=TRAIN_LR, max_grad_norm=0.0)
        out["total_hf"].append(hf_train_step(hf, hf_opt, [(inputs, targets)]))
        out["pooled"].append(ref.aux_loss.item() / k)
        out["layers"].append([float(s.aux_loss) for s in result.moe_layers])
        out["lm_hf"].append(lm_hf)
        out["lm_mt"].append(float(result.loss))
        out["total_mt"].append(meshtron_objective(result, model.cfg))
    reducer.remove_hooks()
    return out


def mixtral_train_ep2() -> None:
    """meshtron at ep=2 (dp=2: rank r trains rows [2r, 2r+2) of each global batch) vs
    transformers accumulating over the same two microbatches, output_router_logits=True, two
    MoE layers: needs the per-rank-microbatch statistics (model.aux_loss_scope="microbatch")
    pooled across layers (model.aux_loss_layers="pooled")."""
    hf = tiny_mixtral(output_router_logits=True, layers=2)

    def check_mesh(mesh) -> None:
        if mesh.dp_size != 2 or mesh.par.ep != 2:
            raise AssertionError(f"expected dp=2 x ep=2, got dp={mesh.dp_size}, ep={mesh.par.ep}")

    train_like_transformers(hf, ParallelConfig(tp=1, ep=2), check_mesh)


def train_like_transformers(hf, par: ParallelConfig | None, check_mesh=None, micro_per_rank: int = 1, loose=()) -> None:
    """`TRAIN_STEPS` AdamW steps of `hf` imported at layout `par` beside transformers
    accumulating over the same microbatches: each global batch is cut into dp x
    `micro_per_rank` microbatches of consecutive rows, dp rank r trains the r-th
    `micro_per_rank` of them (through the 1F1B pipeline schedule when pp > 1; every cp rank
    its shard of each sequence; par None: one process). The total objective of every step to
    STEP_RTOL, every weight afterwards to 1e-5 relative (1e-4 for the tensors whose names end
    with one of `loose`)."""
    from meshtron.models import hf as mhf
    from meshtron.pipeline.executor import PipelineExecutor
    from meshtron.training.step import pipeline_train_step, train_step

    model, reducer, optimizer, mesh = meshtron_trainer(hf, par)
    if check_mesh is not None:
        check_mesh(mesh)
    rows = TRAIN_BATCH // (mesh.dp_size * micro_per_rank)
    executor = None
    if mesh.pp_size > 1:
        shape = activation_shape(mesh, SEQ, rows, model.cfg.hidden_size)
        executor = PipelineExecutor([model], mesh, shape, torch.float32, torch.device("cpu"), tags=False)
    hf_opt = hf_adamw(hf)
    problems = []
    for step in range(TRAIN_STEPS):
        micro = split_rows(train_batch(step), mesh.dp_size * micro_per_rank)
        mine = micro[mesh.dp_rank * micro_per_rank : (mesh.dp_rank + 1) * micro_per_rank]
        kw = dict(lr=TRAIN_LR, max_grad_norm=0.0)
        if executor is None:
            out = train_step(model, reducer, optimizer, mine, mesh, **kw)
        else:
            out = pipeline_train_step([model], reducer, optimizer, mine, mesh, executor, schedule="1f1b", **kw)
        got = meshtron_objective(out, model.cfg)
        want = hf_train_step(hf, hf_opt, micro)
        if not relative(got, want) <= STEP_RTOL:
            problems.append(
                f"step {step}: meshtron objective {got:.7f} vs transformers {want:.7f} "
                f"(relative {relative(got, want):.2e} > {STEP_RTOL:.0e})"
            )
    exported = mhf.export_hf_state_dict(model, mesh)  # collective: before any rank raises
    reducer.remove_hooks()
    if problems:
        raise AssertionError("; ".join(problems))
    if mesh.rank == 0 and (problem := compare_trained_weights(exported, hf, 1e-5, loose)):
        raise AssertionError(f"after {TRAIN_STEPS} steps: {problem}")


def cases_for_world(world_size: int) -> list[str]:
    if world_size == 2:
        return [
            "gpt2_tp2",
            "llama_tp2",
            "mistral_tp2",
            "llama3_tp2",
            "qwen2_tp2",
            "qwen3_tp2",
            "qwen3_train_tp2",
            "qwen2_moe_tp2",
            "qwen3_moe_ep2",
            "qwen2_moe_train_tp2_ep2",
            "qwen3_moe_train_ep2",
            "mistral_window_cp2_a2a",
            "mistral_window_train_cp2_a2a",
            "mistral_window_train_cp2_ring",
            "mistral_window_tp2",
            "mistral_window_pp2",
            "deepseek_v3_tp2_ep2",
            "deepseek_v3_train_tp2_ep2",
            "mistral_pp2",
            "llama3_pp2",
            "qwen2_pp2",
            "mistral_cp2_ring",
            "llama3_cp2_a2a",
            "qwen2_cp2_ring",
            "qwen3_cp2_a2a",
            "llama3_train_pp2",
            "mistral_train_cp2_ring",
            "qwen2_train_cp2_a2a",
            "qwen3_train_cp2_ring",
            "mixtral_tp2",
            "mixtral_ep2",
            "mixtral_train_ep2",
        ]
    if world_size == 4:
        return ["gpt2_pp2_tp2", "llama_pp2_tp2", "qwen3_pp2_tp2", "mixtral_pp2_ep2", "deepseek_v3_pp2_tp2"]
    return []
