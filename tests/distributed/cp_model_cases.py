"""Context parallelism in the whole model equals one process: cp in {2, 4} x ring/a2a, alone and
with tp/sp, pp, dp, ep, packed documents and recomputation.

Each case trains the layout and, in the same process, the serial model (world of one) on the
same microbatches (the serial run takes every dp rank's microbatches one after the other, which
MoE's per-microbatch routing statistics need), and compares the logits of this rank's cp shard,
the loss, the gradient norm (and MoE aux/z-loss), every gradient after the first step, every
weight after three AdamW steps, and the evaluation loss, at 1e-5 (dense_cases.py explains the
tolerance and the AdamW eps).
"""

from __future__ import annotations

import dataclasses

import torch

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.context_parallel import shard_sequence
from meshtron.mpu.mesh import ParallelConfig, build_mesh, single_process_mesh
from meshtron.training.config import OptimConfig
from meshtron.training.optim import build_reducer_and_optimizer
from meshtron.training.packing import local_microbatch
from meshtron.training.step import evaluate, pipeline_train_step, train_step
from tests.distributed.dense_cases import (
    ADAM_EPS,
    LR,
    SEED,
    STEPS,
    UNFUSED,
    assert_close,
    build,
    compare_parameters,
    model_config,
)
from tests.distributed.moe_cases import moe_config
from tests.distributed.pipeline_cases import build_pipeline, pipeline_config

EOS = 7
MICRO = 2  # samples per microbatch
MICRO_PER_RANK = 2  # microbatches per dp rank and step


def _config(arch: str, moe: bool, pp: int, capacity=None, scope: str = "microbatch") -> GPTConfig:
    if pp > 1:
        return pipeline_config(arch, moe)
    if moe:
        return moe_config(arch, 2, "softmax", capacity, scope)
    return model_config(arch)


def _global_batch(cfg: GPTConfig, step: int, batch: int, docs: bool):
    """Random tokens; with `docs`, end-of-document tokens at fixed places (documents that
    cross cp chunk borders, one of a single token) and nowhere else."""
    gen = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    tokens[tokens == EOS] = EOS + 1
    if docs:
        tokens[0::2, [2, 3, 9]] = EOS
        tokens[1::2, [6]] = EOS
    return tokens[:, :-1], tokens[:, 1:]


def _microbatches(inputs, targets, first_row: int, count: int):
    return [(inputs[r : r + MICRO], targets[r : r + MICRO]) for r in range(first_row, first_row + count * MICRO, MICRO)]


def check_cp_layout(
    arch: str,
    cp: int,
    comm: str,
    *,
    tp: int = 1,
    sp: bool = False,
    pp: int = 1,
    ep: int = 1,
    moe: bool = False,
    docs: bool = False,
    recompute: str = "none",
    zero: int = 0,
    capacity: float | None = None,
    scope: str = "microbatch",
) -> None:
    cfg = _config(arch, moe, pp, capacity, scope)
    mesh = build_mesh(ParallelConfig(tp=tp, sp=sp, pp=pp, ep=ep, cp=cp, cp_comm=comm), cfg)
    eos = EOS if docs else None
    execution = ExecutionConfig(recompute=recompute)
    dp = mesh.dp_size
    batch = dp * MICRO * MICRO_PER_RANK
    serial_mesh = single_process_mesh()
    ref, ref_reducer, ref_optimizer = build(cfg, serial_mesh, UNFUSED)
    ref_params = dict(ref.named_parameters())
    executor = None
    if pp > 1:
        assert not zero, "pipeline cases here use the replicated optimizer"
        chunks, named, reducer, optimizer, executor = build_pipeline(cfg, mesh, MICRO, execution)
    elif zero:  # the run's own builder: AdamW state (and grads, params) sharded over dp x cp
        chunks = init_model_chunks(cfg, mesh, SEED, execution=execution)
        reducer, optimizer = build_reducer_and_optimizer(
            OptimConfig(zero=zero, lr=LR, weight_decay=0.1, eps=ADAM_EPS), chunks, mesh
        )
        named = list(chunks[0].named_parameters())
    else:
        model, reducer, optimizer = build(cfg, mesh, execution)
        chunks, named = [model], list(model.named_parameters())
    if pp == 1 and not zero:
        # Forward: the logits of this rank's cp shard equal the serial logits at those positions.
        model = chunks[0]
        inputs, targets = _global_batch(cfg, 0, batch, docs)
        mine = local_microbatch(inputs, targets, mesh, eos)
        full = local_microbatch(inputs, targets, serial_mesh, eos)
        with torch.no_grad():
            got = model.full_logits(model(mine.inputs, **mine.forward_kwargs))
            want = shard_sequence(ref.full_logits(ref(full.inputs, **full.forward_kwargs)), 1, cp, mesh.cp_rank)
        assert_close("logits", got, want)

    first = mesh.dp_rank * MICRO * MICRO_PER_RANK
    for step in range(STEPS):
        inputs, targets = _global_batch(cfg, step, batch, docs)
        mine = _microbatches(inputs, targets, first, MICRO_PER_RANK)
        serial = _microbatches(inputs, targets, 0, dp * MICRO_PER_RANK)
        if executor is None:
            out = train_step(chunks[0], reducer, optimizer, mine, mesh, lr=LR, max_grad_norm=1.0, eos_id=eos)
        else:
            out = pipeline_train_step(
                chunks, reducer, optimizer, mine, mesh, executor, schedule="1f1b", lr=LR, max_grad_norm=1.0, eos_id=eos
            )
        ref_out = train_step(ref, ref_reducer, ref_optimizer, serial, serial_mesh, lr=LR, max_grad_norm=1.0, eos_id=eos)
        for key in ("loss", "grad_norm") + (("aux_loss", "z_loss") if moe else ()):
            assert_close(f"step {step} {key}", getattr(out, key), getattr(ref_out, key))
        for i, (a, b) in enumerate(zip(out.moe_layers, ref_out.moe_layers)):
            assert_close(f"step {step} layer {i} tokens per expert", a.tokens_per_expert, b.tokens_per_expert)
            assert_close(f"step {step} layer {i} dropped", a.dropped_fraction + 1, b.dropped_fraction + 1)
            assert capacity is None or a.dropped_fraction > 0, "the capacity case must drop tokens"
        # Gradients after the step, without ZeRO only: ZeRO-2/3 keep reduce-scattered shards, and
        # ZeRO-1's fused shard AdamW folds the clip coefficient into its update and writes the
        # clipped gradient back into its own shard only (dp/adamw.py dividing_gradients), so
        # the rest of each rank's full gradients stays unclipped. The grad norm (every step) and
        # the weights after the steps cover them.
        if step == 0 and zero == 0:
            compare_parameters(named, ref_params, mesh, cfg, "grad")
    if zero == 3:
        from meshtron.dp import zero3

        with zero3.gathered(chunks):
            compare_parameters(named, ref_params, mesh, cfg, f"weight after {STEPS} steps")
    else:
        compare_parameters(named, ref_params, mesh, cfg, f"weight after {STEPS} steps")
    assert_close(
        "eval loss",
        evaluate(chunks, mine, mesh, executor, eos_id=eos),
        evaluate([ref], serial, serial_mesh, eos_id=eos),
    )
    reducer.remove_hooks()


def hidden_dropout_under_cp_differs_per_shard_and_recomputes() -> None:
    """Hidden dropout (model.dropout=0.1, attention dropout 0) at cp=2 x tp=world/2 with SP:
    each cp rank draws its own masks (the default and tensor-parallel streams are seeded per
    cp rank), and full / selective recomputation replay them exactly (gradients equal the run
    without recomputation, 1e-6), the ring's collectives included."""
    import torch.distributed as dist

    world = dist.get_world_size()
    grads = {}
    for mode in ("none", "selective", "full"):
        cfg = dataclasses.replace(model_config("llama"), dropout=0.1, attention_dropout=0.0)
        mesh = build_mesh(ParallelConfig(cp=2, tp=world // 2, sp=world > 2), cfg)
        (model,) = init_model_chunks(cfg, mesh, SEED, execution=ExecutionConfig(recompute=mode))
        inputs, targets = _global_batch(cfg, 0, 2, docs=False)
        mb = local_microbatch(inputs, targets, mesh)
        model.loss_per_token(model(mb.inputs), mb.targets).mean().backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for mode in ("selective", "full"):
        for name, grad in grads["none"].items():
            if not torch.allclose(grads[mode][name], grad, rtol=1e-6, atol=1e-8):
                raise AssertionError(f"recompute={mode}: gradient of {name} differs under cp with dropout")
    # The streams differ between the cp ranks of one tp position (freshly seeded, as a run starts).
    init_model_chunks(cfg, mesh, SEED)
    draws = [torch.zeros(2, 4) for _ in range(world)]
    mine = torch.stack([torch.rand(4), _tracker_rand()])
    dist.all_gather(draws, mine)
    peer = draws[mesh.rank + mesh.tp_size if mesh.cp_rank == 0 else mesh.rank - mesh.tp_size]
    if torch.equal(peer[0], mine[0]) or torch.equal(peer[1], mine[1]):
        raise AssertionError("cp ranks draw the same dropout masks")


def _tracker_rand() -> torch.Tensor:
    from meshtron.mpu.random import get_rng_tracker

    with get_rng_tracker().fork():
        return torch.rand(4)


# name: (arch, cp, comm, keyword arguments), per world size
LAYOUTS = {
    2: {
        "gpt2_cp2_ring": ("gpt2", 2, "ring", {}),
        "llama_cp2_a2a": ("llama", 2, "a2a", {}),
        "llama_cp2_ring_docs": ("llama", 2, "ring", {"docs": True}),
        "gpt2_cp2_a2a_docs": ("gpt2", 2, "a2a", {"docs": True}),
        "llama_cp2_ring_selective_recompute": ("llama", 2, "ring", {"recompute": "selective"}),
        "gpt2_moe_cp2_ring_ep2": ("gpt2", 2, "ring", {"moe": True, "ep": 2}),
        "qwen3_cp2_ring_docs_selective_recompute": ("qwen3", 2, "ring", {"docs": True, "recompute": "selective"}),
        "llama3_cp2_a2a_docs": ("llama3", 2, "a2a", {"docs": True}),
        "mla_cp2_ring_docs": ("mla", 2, "ring", {"docs": True}),
        "mla_cp2_a2a_selective_recompute": ("mla", 2, "a2a", {"recompute": "selective"}),
        "gpt2_moe_cp2_a2a_capacity_sequence_scope": (
            "gpt2",
            2,
            "a2a",
            {"moe": True, "capacity": 1.0, "scope": "sequence"},
        ),
    },
    4: {
        "gpt2_cp4_ring": ("gpt2", 4, "ring", {}),
        "gpt2_cp4_a2a_docs": ("gpt2", 4, "a2a", {"docs": True}),
        "llama_cp2_ring_tp2_sp": ("llama", 2, "ring", {"tp": 2, "sp": True}),
        "gpt2_cp2_a2a_tp2": ("gpt2", 2, "a2a", {"tp": 2}),
        "llama_cp2_a2a_dp2_docs": ("llama", 2, "a2a", {"docs": True}),
        "gpt2_cp2_ring_pp2": ("gpt2", 2, "ring", {"pp": 2}),
        "llama_cp2_a2a_pp2_docs": ("llama", 2, "a2a", {"pp": 2, "docs": True}),
        "llama_moe_cp2_ring_dp2_ep4": ("llama", 2, "ring", {"moe": True, "ep": 4}),
        "gpt2_cp2_ring_dp2_zero1": ("gpt2", 2, "ring", {"zero": 1}),
        "llama_moe_cp2_ring_tp2_sp_ep2_capacity": (
            "llama",
            2,
            "ring",
            {"moe": True, "tp": 2, "sp": True, "ep": 2, "capacity": 1.25},
        ),
        "llama_cp2_a2a_dp2_zero3": ("llama", 2, "a2a", {"zero": 3}),
        "qwen2_cp2_ring_pp2_docs": ("qwen2", 2, "ring", {"pp": 2, "docs": True}),
    },
    8: {
        "llama_cp4_ring_tp2_sp": ("llama", 4, "ring", {"tp": 2, "sp": True}),
        "gpt2_moe_cp2_a2a_tp2_pp2_ep2_docs": ("gpt2", 2, "a2a", {"moe": True, "tp": 2, "pp": 2, "ep": 2, "docs": True}),
    },
}


def _make(name: str, layout):
    arch, cp, comm, kwargs = layout

    def case() -> None:
        check_cp_layout(arch, cp, comm, **kwargs)

    case.__name__ = name
    return case


for _layouts in LAYOUTS.values():
    for _name, _layout in _layouts.items():
        globals()[_name] = _make(_name, _layout)


def cases_for_world(world_size: int) -> list[str]:
    extra = ["hidden_dropout_under_cp_differs_per_shard_and_recomputes"] if world_size in (2, 4) else []
    return list(LAYOUTS.get(world_size, {})) + extra
