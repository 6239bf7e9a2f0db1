"""Parallel == serial for MoE GPTs: expert parallelism (ep), expert tensor parallelism (etp),
folded independently of the dense tp x dp (x sp) layout, against the single-process model.

Each case compares logits, LM loss, aux and z-loss values, routing load and dropped fraction,
every gradient (experts all-gathered over etp and ep) after the first step, and every weight
(and the aux-free expert bias) after three AdamW steps. Tolerances as in dense_cases. The
serial run takes the microbatches that the case's aux-loss scope says it must equal
(moe/scope.py): the same microbatches (microbatch), the whole batch at once (sequence), or
microbatch j of every dp rank concatenated (global). Some layouts train with their MoE tokens
dispatched in two chunks (trainer.moe_dispatch_chunks); the pipeline cases run each scope
through pp=2 stages.
"""

from __future__ import annotations

import dataclasses

import torch

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.mpu.mesh import ParallelConfig, build_mesh, single_process_mesh
from meshtron.training.step import StepResult, pipeline_train_step, train_step
from tests.distributed.dense_cases import (
    LR,
    STEPS,
    UNFUSED,
    assert_close,
    build,
    compare_parameters,
    global_batch,
    microbatches,
)
from tests.distributed.pipeline_cases import build_pipeline

# (arch, tp, sp, ep, etp, top_k, score, capacity_factor, aux_loss_scope, router variant, dispatch chunks)
# router variant: "plain", "grouped" (group-limited routing) or "pooled" (aux_loss_layers=pooled);
# dispatch chunks: trainer.moe_dispatch_chunks (each MoE layer's tokens dispatched in that many chunks)
LAYOUTS = {
    2: [
        ("gpt2", 1, False, 2, 1, 2, "softmax", None, "microbatch", "plain", 2),
        ("llama", 1, False, 2, 1, 1, "sigmoid", None, "sequence", "plain", 1),
        ("gpt2", 2, True, 2, 1, 2, "softmax", None, "microbatch", "grouped", 1),
        ("llama", 2, False, 1, 2, 2, "softmax", None, "microbatch", "plain", 1),
        ("gpt2", 2, False, 2, 1, 2, "softmax", None, "microbatch", "pooled", 1),
        ("gpt2", 1, False, 1, 2, 1, "softmax", 1.0, "global", "plain", 1),
        ("llama", 2, True, 2, 1, 2, "softmax", 1.0, "sequence", "plain", 2),
        ("llama", 1, False, 2, 1, 2, "sigmoid", None, "microbatch", "grouped", 1),
    ],
    4: [
        ("gpt2", 1, False, 4, 1, 2, "softmax", None, "microbatch", "pooled", 1),
        ("llama", 2, True, 2, 2, 2, "sigmoid", None, "microbatch", "grouped", 2),
        ("gpt2", 2, False, 4, 1, 1, "softmax", None, "sequence", "plain", 1),
        ("llama", 1, False, 2, 2, 1, "softmax", None, "global", "plain", 1),
        ("gpt2", 2, True, 4, 1, 2, "softmax", 1.0, "microbatch", "plain", 2),
    ],
    8: [
        ("llama", 4, False, 8, 1, 2, "softmax", None, "microbatch", "plain", 1),
        ("gpt2", 2, True, 8, 1, 2, "sigmoid", None, "sequence", "grouped", 1),
        ("llama", 2, True, 4, 2, 1, "softmax", None, "microbatch", "plain", 2),
        ("gpt2", 2, False, 2, 2, 2, "softmax", 1.0, "global", "pooled", 2),
        ("llama", 2, False, 2, 1, 2, "sigmoid", None, "microbatch", "plain", 1),
        ("gpt2", 1, False, 8, 1, 1, "softmax", None, "microbatch", "plain", 1),
    ],
}
MICRO = 2  # samples per microbatch on every rank
MICRO_PER_RANK = 2  # microbatches per rank and step


def moe_config(
    arch: str, top_k: int, score: str, capacity_factor, scope: str = "microbatch", variant: str = "plain"
) -> GPTConfig:
    common = dict(
        num_experts=8,
        top_k=top_k,
        router_score=score,
        capacity_factor=capacity_factor,
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
        router_bias_update_rate=0.01 if score == "sigmoid" else 0.0,
        vocab_size=200,
        seq_len=16,
        aux_loss_scope=scope,
    )
    if variant == "grouped":  # 4 groups of 2 experts, each token's top_k inside its best group
        # (with top_k 2 a group scores by its two experts, so the limit binds; see
        # tests/test_moe_balance.py::test_group_limited_routing_matches_per_token_rule)
        common.update(router_groups=4, router_topk_groups=1)
    elif variant == "pooled":
        common.update(aux_loss_layers="pooled")
    if arch == "llama":
        return GPTConfig(
            arch="llama",
            num_layers=2,
            hidden_size=64,
            num_heads=8,
            num_kv_heads=4,
            ffn_hidden_size=48,
            moe_ffn_hidden_size=32,
            moe_every=2,
            shared_experts=1,
            tie_embeddings=False,
            **common,
        )
    return GPTConfig(
        arch="gpt2",
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        moe_ffn_hidden_size=24,
        moe_every=1,
        **common,
    )


def _case_name(layout) -> str:
    arch, tp, sp, ep, etp, k, score, cf, scope, variant, chunks = layout
    return (
        f"{arch}_tp{tp}{'sp' if sp else ''}_ep{ep}_etp{etp}_top{k}_{score}_{'cap' if cf else 'dropless'}"
        f"_{scope}{'' if variant == 'plain' else '_' + variant}{'' if chunks == 1 else f'_chunks{chunks}'}"
    )


def serial_microbatches(cfg: GPTConfig, step: int, dp: int, batch: int, scope: str):
    """The single-process microbatches that the scope's invariance rule (moe/scope.py) says
    reproduce a dp-rank run whose ranks each take MICRO_PER_RANK microbatches of MICRO samples."""
    per_rank = [microbatches(cfg, step, r, dp, MICRO, batch) for r in range(dp)]
    if scope == "microbatch":  # the same microbatches, one after the other
        return [mb for rank in per_rank for mb in rank]
    if scope == "sequence":  # any micro batch size: the whole global batch at once
        return microbatches(cfg, step, 0, 1, batch, batch)
    # global: serial microbatch j holds microbatch j of every dp rank
    return [tuple(torch.cat([per_rank[r][j][i] for r in range(dp)]) for i in range(2)) for j in range(MICRO_PER_RANK)]


def count_group_limited_choices(model) -> list[int]:
    """Make every router of `model` also route without its group limit and count, in the
    returned one-element list, the tokens whose choice the limit changed (a grouped case whose
    limit never binds would route exactly as an ungrouped one)."""
    changed = [0]
    for layer in model.moe_layers():
        router, route = layer.router, layer.router.route

        def counting_route(x, router=router, route=route):
            routing = route(x)
            groups, router.groups = router.groups, 0
            try:
                free = route(x)
            finally:
                router.groups = groups
            changed[0] += int((routing.topk_idx != free.topk_idx).any(-1).sum())
            return routing

        router.route = counting_route
    return changed


def compare_step(step: int, out: StepResult, ref_out: StepResult) -> None:
    """One training step's loss, gradient norm, aux and z-loss and per-layer load equal serial."""
    for key in ("loss", "grad_norm", "aux_loss", "z_loss"):
        assert_close(f"step {step} {key}", getattr(out, key), getattr(ref_out, key))
    for i, (a, b) in enumerate(zip(out.moe_layers, ref_out.moe_layers, strict=True)):
        assert_close(f"step {step} layer {i} tokens per expert", a.tokens_per_expert, b.tokens_per_expert)
        assert_close(f"step {step} layer {i} dropped", a.dropped_fraction + 1, b.dropped_fraction + 1)


def compare_expert_bias(chunks, ref) -> None:
    """The aux-free expert bias of every router on this rank is bit-equal to the serial one."""
    ref_buffers = dict(ref.named_buffers())
    biases = [(n, b) for chunk in chunks for n, b in chunk.named_buffers() if n.endswith("expert_bias")]
    if not biases and any(True for chunk in chunks for _ in chunk.moe_layers()):
        raise AssertionError("no expert_bias buffer found beside the MoE layers")
    for name, bias in biases:
        if not torch.equal(bias, ref_buffers[name]):
            raise AssertionError(f"{name} {bias} != serial {ref_buffers[name]}")


def train_against_serial(
    cfg: GPTConfig, mesh, scope: str, chunks, named, train, serial, *, bias_every_step: bool = False
) -> list:
    """STEPS steps of `train` (this rank's microbatches -> the step's output) beside the serial
    model (`serial`: build()'s model, reducer and optimizer) taking the microbatches the scope
    names: each step's values (`compare_step`), every gradient after the first step, and the
    weights and expert bias of `chunks` (their `named` parameters) after the last (the bias
    after every step with `bias_every_step`). Returns every step's (output, serial output)."""
    ref, ref_reducer, ref_optimizer = serial
    ref_params = dict(ref.named_parameters())
    batch = mesh.dp_size * MICRO * MICRO_PER_RANK
    results = []
    for step in range(STEPS):
        out = train(microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, MICRO, batch))
        ref_out = train_step(
            ref,
            ref_reducer,
            ref_optimizer,
            serial_microbatches(cfg, step, mesh.dp_size, batch, scope),
            single_process_mesh(),
            lr=LR,
            max_grad_norm=1.0,
        )
        compare_step(step, out, ref_out)
        if step == 0:
            compare_parameters(named, ref_params, mesh, cfg, "grad")
        if bias_every_step:
            try:
                compare_expert_bias(chunks, ref)
            except AssertionError as err:
                raise AssertionError(f"step {step}: {err}") from None
        results.append((out, ref_out))
    compare_parameters(named, ref_params, mesh, cfg, f"weight after {STEPS} steps")
    compare_expert_bias(chunks, ref)
    return results


def check_moe_layout(layout, kernel_backend: str = "torch") -> None:
    arch, tp, sp, ep, etp, top_k, score, cf, scope, variant, chunks = layout
    cfg = moe_config(arch, top_k, score, cf, scope, variant)
    mesh = build_mesh(ParallelConfig(tp=tp, sp=sp, ep=ep, etp=etp), cfg)
    model, reducer, optimizer = build(
        cfg, mesh, ExecutionConfig(kernel_backend=kernel_backend, moe_dispatch_chunks=chunks)
    )
    if chunks > 1:
        assert all(m.dispatch_chunk_count(2) == chunks for m in model.moe_layers())
    serial = build(cfg, single_process_mesh(), UNFUSED)
    ref = serial[0]
    group_limited = count_group_limited_choices(ref) if variant == "grouped" else None

    batch = mesh.dp_size * MICRO * MICRO_PER_RANK
    inputs, _ = microbatches(cfg, 0, mesh.dp_rank, mesh.dp_size, batch, batch)[0]
    full_inputs, _ = global_batch(cfg, 0, batch)
    with torch.no_grad():
        got = model.full_logits(model(inputs))
        want = ref.full_logits(ref(full_inputs))
    rows = slice(mesh.dp_rank * inputs.shape[0], (mesh.dp_rank + 1) * inputs.shape[0])
    assert_close("logits", got, want[rows])

    train_against_serial(
        cfg,
        mesh,
        scope,
        [model],
        list(model.named_parameters()),
        lambda mine: train_step(model, reducer, optimizer, mine, mesh, lr=LR, max_grad_norm=1.0),
        serial,
    )
    if group_limited is not None and group_limited[0] == 0:
        raise AssertionError("the group limit changed no token's choice: the grouped case tests nothing")
    reducer.remove_hooks()


def _register(layouts: dict, name, check) -> None:
    """One module-level case per layout of `layouts`, named name(layout), running check(layout)."""
    for rows in layouts.values():
        for layout in rows:

            def case(layout=layout) -> None:
                check(layout)

            case.__name__ = name(layout)
            globals()[case.__name__] = case


_register(LAYOUTS, _case_name, check_moe_layout)


def triton_kernels_gpt2_ep2_etp1() -> None:
    """Triton grouped GEMM (and the other kernels, interpreter set by the harness) under ep=2
    equal the serial torch run."""
    check_moe_layout(("gpt2", 1, False, 2, 1, 2, "softmax", None, "microbatch", "plain", 1), kernel_backend="triton")


def full_recompute_moe_matches() -> None:
    """trainer.recompute=full with MoE layers (ep = world, also with two dispatch chunks, and
    tp = world with SP; aux per layer and pooled across layers): the loss, every gradient
    (aux/z-loss terms included, dropout 0.1) and the aux-free expert bias after one step equal
    the run without recomputation; the load is counted once."""
    world = torch.distributed.get_world_size()
    for par, variant, chunks in (
        (ParallelConfig(ep=world), "plain", 1),
        (ParallelConfig(ep=world), "plain", 2),
        (ParallelConfig(tp=world, sp=True), "plain", 1),
        (ParallelConfig(ep=world), "pooled", 1),
    ):
        results = {}
        for mode in ("none", "full"):
            cfg = dataclasses.replace(
                moe_config("llama", 2, "sigmoid", None, variant=variant), dropout=0.1, moe_every=1
            )
            mesh = build_mesh(par, cfg)
            model, reducer, optimizer = build(cfg, mesh, ExecutionConfig(recompute=mode, moe_dispatch_chunks=chunks))
            out = train_step(
                model,
                reducer,
                optimizer,
                microbatches(cfg, 0, mesh.dp_rank, mesh.dp_size, 1),
                mesh,
                lr=LR,
                max_grad_norm=0.0,
            )
            reducer.remove_hooks()
            results[mode] = (
                out,
                {n: p.grad.clone() for n, p in model.named_parameters()},
                [m.router.expert_bias.clone() for m in model.moe_layers()],
            )
        (out_a, grads_a, bias_a), (out_b, grads_b, bias_b) = results["none"], results["full"]
        assert_close(f"{par} {variant}: loss", out_b.loss, out_a.loss, rtol=1e-6)
        assert_close(f"{par} {variant}: aux loss", out_b.aux_loss, out_a.aux_loss, rtol=1e-6)
        for name, grad in grads_a.items():
            assert_close(f"{par} {variant} recompute=full: gradient of {name}", grads_b[name], grad, rtol=1e-6)
        for a, b in zip(bias_a, bias_b):
            if not torch.equal(a, b):
                raise AssertionError(f"{par}: expert bias after the step differs with recomputation")


# (arch, pp, tp, sp, ep, etp, aux_loss_scope, dispatch chunks): the scopes' rules through
# pipeline stages (1f1b), with the sigmoid router's expert-bias updates and microbatches of MICRO
# sequences, so that `microbatch` and `sequence` pool different token sets. llama's one MoE
# layer sits on stage 1.
PIPELINE_LAYOUTS = {
    4: [
        ("gpt2", 2, 1, False, 2, 1, "microbatch", 1),
        ("llama", 2, 1, False, 1, 2, "sequence", 2),
        ("gpt2", 2, 1, False, 2, 1, "global", 1),
    ],
    8: [
        ("llama", 2, 2, True, 2, 2, "microbatch", 2),
        ("gpt2", 2, 2, True, 4, 1, "sequence", 1),
    ],
}


def _pipeline_case_name(layout) -> str:
    arch, pp, tp, sp, ep, etp, scope, chunks = layout
    return (
        f"{arch}_pp{pp}_tp{tp}{'sp' if sp else ''}_ep{ep}_etp{etp}_sigmoid_{scope}"
        f"{'' if chunks == 1 else f'_chunks{chunks}'}"
    )


def check_moe_pipeline_layout(layout) -> None:
    """An MoE model over pipeline stages equals one process taking the microbatches the
    aux-loss scope names: loss, aux/z-loss, load, every gradient, the weights and the expert
    bias after STEPS steps."""
    arch, pp, tp, sp, ep, etp, scope, dispatch_chunks = layout
    cfg = moe_config(arch, 2, "sigmoid", None, scope)
    mesh = build_mesh(ParallelConfig(pp=pp, tp=tp, sp=sp, ep=ep, etp=etp, schedule="1f1b"), cfg)
    chunks, named, reducer, optimizer, executor = build_pipeline(
        cfg, mesh, MICRO, ExecutionConfig(moe_dispatch_chunks=dispatch_chunks)
    )
    serial = build(cfg, single_process_mesh(), UNFUSED)
    ref = serial[0]
    train_against_serial(
        cfg,
        mesh,
        scope,
        chunks,
        named,
        lambda mine: pipeline_train_step(
            chunks, reducer, optimizer, mine, mesh, executor, schedule="1f1b", lr=LR, max_grad_norm=1.0
        ),
        serial,
    )
    if not any(bool(b.any()) for _, b in ref.named_buffers() if _.endswith("expert_bias")):
        raise AssertionError("the serial expert bias never moved: the case does not test its updates")
    reducer.remove_hooks()


_register(PIPELINE_LAYOUTS, _pipeline_case_name, check_moe_pipeline_layout)


def cases_for_world(world_size: int) -> list[str]:
    extra = ["triton_kernels_gpt2_ep2_etp1", "full_recompute_moe_matches"] if world_size == 2 else []
    return (
        [_case_name(layout) for layout in LAYOUTS.get(world_size, [])]
        + extra
        + [_pipeline_case_name(layout) for layout in PIPELINE_LAYOUTS.get(world_size, [])]
    )
