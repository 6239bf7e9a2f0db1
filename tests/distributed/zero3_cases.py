"""ZeRO-3 (optim.zero=3, dp/zero3.py): parameters sharded over their replica groups and
gathered per unit give the weights, AdamW moments, gradient norms and losses of replicated
AdamW (zero=0) to 1e-6 — dense dp with two microbatches, tp x dp with and without SP, MoE
experts over edp (ep=1 and ep=2), pipeline 1F1B (tied embedding) and interleaved, full and
selective recompute, bf16 autocast, CPU offload, evaluation — and checkpoints move between
zero=3 and zero=0 (asynchronous save included). Between steps a rank holds 1/replicas of the
parameters, gradients and optimizer state; during a step at most two units of parameters
(and about two of gradients) in full, as the planner computes."""

from __future__ import annotations

import dataclasses

import torch

from meshtron.dp import zero3
from meshtron.dp.grad_reduce import GRAD_GROUPS, replica_group
from meshtron.models.config import ExecutionConfig
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.mesh import ParallelConfig, build_mesh, group_size
from meshtron.pipeline.executor import PipelineExecutor, activation_shape
from meshtron.planning.plan import zero3_gathered_bytes, zero3_grad_buffer_bytes
from meshtron.training.checkpoint import (
    AsyncCheckpointer,
    TrainState,
    load_checkpoint,
    new_checkpoint_group,
    save_checkpoint,
)
from meshtron.training.config import OptimConfig
from meshtron.training.optim import build_reducer_and_optimizer
from meshtron.training.precision import Precision
from meshtron.training.step import evaluate, pipeline_train_step, train_step
from tests.distributed.checkpoint_cases import remove_shared_tmpdir, shared_tmpdir
from tests.distributed.dense_cases import (
    ADAM_EPS,
    GLOBAL_BATCH,
    LR,
    SEED,
    assert_close,
    full_tensor,
    microbatches,
    model_config,
    trim_vocab,
)
from tests.distributed.moe_cases import moe_config
from tests.distributed.pipeline_cases import pipeline_config

STEPS = 3


def _run(
    cfg,
    par,
    zero: int,
    *,
    recompute: str = "none",
    precision: str = "fp32",
    micro: int = GLOBAL_BATCH,
    probe=None,
    steps: int = STEPS,
    offload: bool = False,
):
    """Train STEPS steps through the run's own builder (training/optim.py); return (model
    chunks, reducer, optimizer, grad norms, losses). `probe(model, reducer, optimizer)` runs
    after each step (pp = 1). `micro` is the microbatch size (default: one microbatch per
    rank); under pp > 1 two microbatches of one sequence per rank go through the schedule."""
    mesh = build_mesh(par, cfg)
    chunks = init_model_chunks(cfg, mesh, SEED, execution=ExecutionConfig(recompute=recompute))
    o = OptimConfig(lr=LR, weight_decay=0.1, eps=ADAM_EPS, zero=zero, offload=offload)
    reducer, optimizer = build_reducer_and_optimizer(o, chunks, mesh)
    prec = Precision(precision, "cpu")
    executor = None
    if mesh.pp_size > 1:
        executor = PipelineExecutor(
            chunks, mesh, activation_shape(mesh, cfg.seq_len, 1, cfg.hidden_size), torch.float32, torch.device("cpu")
        )
    norms, losses = [], []
    for step in range(steps):
        if executor is not None:
            micro_batches = microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1, batch=mesh.dp_size * 2)
            out = pipeline_train_step(
                chunks,
                reducer,
                optimizer,
                micro_batches,
                mesh,
                executor,
                schedule=par.schedule,
                lr=LR,
                max_grad_norm=1.0,
                precision=prec,
            )
        else:
            out = train_step(
                chunks[0],
                reducer,
                optimizer,
                microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, micro),
                mesh,
                lr=LR,
                max_grad_norm=1.0,
                precision=prec,
            )
        norms.append(out.grad_norm)
        losses.append(out.loss)
        if probe is not None:
            probe(chunks[0], reducer, optimizer)
    return chunks, reducer, optimizer, norms, losses


def _check(cfg, par, *, rtol: float = 1e-6, offload: bool = False, **kw) -> None:
    """zero=3 (with `offload`: AdamW on the host) against zero=0 under the same layout and
    precision: weights, AdamW moments, gradient norms and losses to `rtol`."""
    plain, plain_reducer, plain_opt, plain_norms, plain_losses = _run(cfg, par, 0, **kw)
    plain_reducer.remove_hooks()
    chunks, reducer, opt, norms, losses = _run(cfg, par, 3, offload=offload, **kw)
    moments, step = opt.param_moments()
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    plain_named = [(n, p) for c in plain for n, p in c.named_parameters()]
    with zero3.gathered(chunks):
        for (name, a), (_, b) in zip(named, plain_named):
            assert_close(f"zero=3 weight {name}", a, b, rtol=rtol)
            for got, key in zip(moments[a], ("exp_avg", "exp_avg_sq")):
                assert_close(f"zero=3 {key} {name}", got, plain_opt.state[b][key], rtol=rtol)
    if step != STEPS:
        raise AssertionError(f"zero=3: optimizer step count {step}, want {STEPS}")
    for i, (a, b) in enumerate(zip(norms, plain_norms)):
        assert_close(f"zero=3 step {i} grad norm", a, b, rtol=rtol)
    for i, (a, b) in enumerate(zip(losses, plain_losses)):
        assert_close(f"zero=3 step {i} loss", a, b, rtol=rtol)
    for z in zero3.sharders(chunks):
        if z.gathered_bytes() != 0:
            raise AssertionError(
                f"zero=3: {z.gathered_bytes()} B of full parameter buffers still allocated after the step"
            )
        z.remove_hooks()
    reducer.remove_hooks()


def zero3_dense_dp() -> None:
    """GPT-2 (tied embeddings) at dp=world, two microbatches per rank (gathered and freed per
    microbatch; gradients accumulate before the reduce-scatter)."""
    _check(model_config("gpt2"), ParallelConfig(tp=1), micro=1)


def zero3_llama_tp2_sp_dp() -> None:
    """Llama at tp=2 with SP: norms are replicated over tp x dp (their buckets shard over tp_dp)."""
    _check(model_config("llama"), ParallelConfig(tp=2, sp=True))


def zero3_qwen3_tp2_sp_dp_full_recompute() -> None:
    """Qwen3's features at tp=2 with SP x dp=2, full recompute: the q/k norm weights (replicated,
    sequence-parallel) shard over tp_dp and are gathered for the replayed block."""
    _check(model_config("qwen3"), ParallelConfig(tp=2, sp=True), recompute="full")


def zero3_gpt2_tp2_dp_selective() -> None:
    """GPT-2 (tied, vocab-parallel embedding) at tp=2 without SP x dp=2, selective recompute
    (the attention core replayed in backward)."""
    _check(model_config("gpt2"), ParallelConfig(tp=2), recompute="selective")


def zero3_moe_ep2_edp() -> None:
    """MoE with experts over ep=2: expert buckets shard over edp = world/2."""
    _check(moe_config("gpt2", 2, "softmax", None), ParallelConfig(tp=1, ep=2))


def zero3_moe_edp_recompute() -> None:
    """MoE at ep=1 (experts replicated over edp = world, sharded over it) with full recompute:
    the routers' aux terms leave the replayed block as outputs."""
    _check(moe_config("gpt2", 2, "softmax", None), ParallelConfig(tp=1, ep=1), recompute="full")


def zero3_recompute_full() -> None:
    """trainer.recompute=full replays each block in backward, after its gather."""
    _check(model_config("llama"), ParallelConfig(tp=1), recompute="full")


def zero3_bf16() -> None:
    """bf16 autocast on both sides. The tolerance stays 1e-6: both runs compute the same bf16
    products from the same fp32 weights (gathering moves values exactly), so only the order of
    fp32 sums may differ."""
    _check(model_config("gpt2"), ParallelConfig(tp=1), precision="bf16")


def zero3_gpt2_pp2_tied_1f1b() -> None:
    """pp=2 x dp=2, 1F1B with two microbatches per rank in flight: one sharder per chunk; the
    last stage's copy of the tied embedding is gathered with its head."""
    _check(pipeline_config("gpt2", False), ParallelConfig(tp=1, pp=2, schedule="1f1b"))


def zero3_llama_pp2_interleaved() -> None:
    """pp=2, vpp=2 (two chunks per rank, interleaved schedule) x dp=2."""
    _check(pipeline_config("llama", False), ParallelConfig(tp=1, pp=2, vpp=2, schedule="interleaved"))


def zero3_offload() -> None:
    """optim.offload: the host AdamW updates this rank's shard and copies it into the bucket's
    parameter shard (no all-gather; the next forward gathers)."""
    _check(model_config("gpt2"), ParallelConfig(tp=1), offload=True)


def zero3_eval_and_gathered() -> None:
    """evaluate() under ZeRO-3 equals zero=0, and frees what it gathers."""
    cfg = model_config("gpt2")
    results = []
    for zero in (0, 3):
        (model,), reducer, _, _, _ = _run(cfg, ParallelConfig(tp=1), zero)
        mesh = model.mesh
        results.append(evaluate([model], microbatches(cfg, 7, mesh.dp_rank, mesh.dp_size, 1), mesh))
        reducer.remove_hooks()
        if zero == 3 and model._zero3.gathered_bytes() != 0:
            raise AssertionError("zero=3: evaluate left parameters gathered")
    assert_close("zero=3 eval loss", results[1], results[0], rtol=1e-6)


def zero3_memory() -> None:
    """Between steps a rank holds exactly its shards: parameters, gradients and AdamW state are
    (4 + 4 + 8) bytes x padded bucket size / replicas, summed over buckets (the replicated run
    holds 16 bytes per parameter). During a step at most two adjacent units (in forward and
    backward order; the head counts with the tied embedding) are gathered beyond the shards,
    every unit but the first of forward and of backward was prefetched, and full gradient
    buffers exist for about two units (plus the tied embedding), as the planner says."""
    cfg = dataclasses.replace(model_config("gpt2"), num_layers=4)
    peaks, grad_peaks = [], []

    def probe(model, reducer, optimizer):
        z = model._zero3
        peaks.append(z.peak_gathered)
        grad_peaks.append(reducer.peak_buffer_bytes)
        reducer.peak_buffer_bytes = 0
        replicas = [group_size(b.group) for b in reducer.buckets]
        want = sum(16 * b.numel // r for b, r in zip(reducer.buckets, replicas))
        got = z.shard_bytes() + z.gathered_bytes() + reducer.grad_bytes() + optimizer.state_bytes()
        if got != want:
            raise AssertionError(
                f"zero=3: {got} B of parameters+gradients+state between steps, want {want} B "
                f"(parameters {z.shard_bytes() + z.gathered_bytes()}, gradients "
                f"{reducer.grad_bytes()}, state {optimizer.state_bytes()})"
            )
        full = sum(16 * p.numel() for p in model.parameters())
        if not got * max(replicas) <= full + 16 * sum(
            b.numel - sum(p.numel() for p in b.params) for b in reducer.buckets
        ):
            raise AssertionError(f"zero=3: {got} B is not 1/{max(replicas)} of the replicated {full} B")
        z.reset_peak()
        # One microbatch: forward acquires embed, 4 blocks, head; backward the head and 4 blocks.
        # All but the embedding (forward) and the head (backward) were prefetched by the unit before.
        layers = cfg.num_layers
        if (z.acquired, z.prefetched) != (2 * layers + 3, 2 * layers + 1):
            raise AssertionError(
                f"zero=3: {z.acquired} units gathered in a step ({z.prefetched} prefetched), "
                f"want {2 * layers + 3} ({2 * layers + 1} prefetched)"
            )
        z.acquired = z.prefetched = 0

    (model,), reducer, _, _, _ = _run(cfg, ParallelConfig(tp=1), 3, probe=probe)
    z = model._zero3
    sizes = [b for b in z.unit_bytes().values()]
    bound = max(a + b for a, b in zip(sizes, sizes[1:]))
    if not 0 < max(peaks) <= bound:
        raise AssertionError(
            f"zero=3: peak gathered parameters {max(peaks)} B, want at most two adjacent units "
            f"({bound} B; units {z.unit_bytes()})"
        )
    if max(peaks) < max(sizes):
        raise AssertionError(f"zero=3: peak {max(peaks)} B is below the largest unit {max(sizes)} B: not measured")
    replicas = {key: group_size(replica_group(model.mesh, key)) for key in GRAD_GROUPS}
    planned = zero3_gathered_bytes(model, replicas)
    if planned != max(peaks):
        raise AssertionError(f"zero=3: the planner's gathered units {planned} B, measured peak {max(peaks)} B")
    # Gradient buffers: about two blocks and the tied embedding, not the whole model.
    planned = zero3_grad_buffer_bytes(model, replicas)
    full = sum(4 * b.numel for b in reducer.buckets)
    if not max(grad_peaks) == planned < full / 2:
        raise AssertionError(
            f"zero=3: peak full gradient buffers {grad_peaks} B, planned {planned} B (all buckets: {full} B)"
        )
    reducer.remove_hooks()


def _continue(model, reducer, optimizer, cfg, step: int):
    mesh = model.mesh
    return train_step(
        model,
        reducer,
        optimizer,
        microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1),
        mesh,
        lr=LR,
        max_grad_norm=1.0,
    )


def zero3_checkpoint_roundtrip() -> None:
    """A checkpoint saved at zero=3 loads at zero=0 (and the reverse) into the same weights
    and moments (exactly), and the next step matches (1e-6). The zero=3 save is asynchronous
    (checkpoint.async): the saving run takes its next step while the write is in flight, and
    the checkpoint still holds the weights it had when `save` returned."""
    cfg = model_config("gpt2")
    par = ParallelConfig(tp=1)
    root = shared_tmpdir()
    writer = AsyncCheckpointer(new_checkpoint_group(60.0))
    try:
        for save_zero, load_zero in ((3, 0), (0, 3)):
            what = f"zero={save_zero} saved, zero={load_zero} loaded"
            (src,), src_reducer, src_opt, _, _ = _run(cfg, par, save_zero, steps=2)
            args = (root / f"from{save_zero}", TrainState(step=2, consumed_samples=8), [src], src_opt, src.mesh)
            if save_zero == 3:
                writer.save(*args, model_config=dataclasses.asdict(cfg))
            else:
                path = save_checkpoint(*args, model_config=dataclasses.asdict(cfg))
            moments, _ = src_opt.param_moments()
            with zero3.gathered([src]):
                saved = [
                    (name, p.detach().clone(), [m.clone() for m in moments[p]]) for name, p in src.named_parameters()
                ]
            want = _continue(src, src_reducer, src_opt, cfg, 2)
            if save_zero == 3:
                path = writer.wait()
            (dst,), dst_reducer, dst_opt, _, _ = _run(cfg, par, load_zero, steps=0)
            state = load_checkpoint(path, [dst], dst_opt, dst.mesh)
            if state.step != 2:
                raise AssertionError(f"{what}: loaded step {state.step}, want 2")
            dst_moments, _ = dst_opt.param_moments()
            with zero3.gathered([dst]):
                for (name, a), (_, b, b_moments) in zip(dst.named_parameters(), saved):
                    if not torch.equal(a, b):
                        raise AssertionError(f"{what}: {name} differs after the load")
                    for got, ref, key in zip(dst_moments[a], b_moments, ("exp_avg", "exp_avg_sq")):
                        if not torch.equal(got, ref):
                            raise AssertionError(f"{what}: {key} of {name} differs after the load")
            got = _continue(dst, dst_reducer, dst_opt, cfg, 2)
            assert_close(f"{what}: loss of the next step", got.loss, want.loss, rtol=1e-6)
            with zero3.gathered([src]), zero3.gathered([dst]):
                for (name, a), (_, b) in zip(dst.named_parameters(), src.named_parameters()):
                    assert_close(f"{what}: {name} after the next step", a, b, rtol=1e-6)
            for z in zero3.sharders([src, dst]):
                if z.gathered_bytes():
                    raise AssertionError(f"{what}: parameters left gathered after save/load")
            src_reducer.remove_hooks()
            dst_reducer.remove_hooks()
    finally:
        writer.close()
        remove_shared_tmpdir(root)


def zero3_checkpoint_reshard() -> None:
    """Saved at zero=3 under tp=2 x dp=2 (SP), loaded at zero=3 under tp=1 x dp=4: every
    full weight is the saved one (exactly), and the next step's loss matches the saving run's
    (1e-5: the two layouts sum the same products in different orders across tp)."""
    cfg = model_config("llama")
    root = shared_tmpdir()
    try:
        (src,), src_reducer, src_opt, _, _ = _run(cfg, ParallelConfig(tp=2, sp=True), 3, steps=2)
        path = save_checkpoint(
            root, TrainState(step=2, consumed_samples=8), [src], src_opt, src.mesh, model_config=dataclasses.asdict(cfg)
        )
        with zero3.gathered([src]):
            saved = {
                n: trim_vocab(n, full_tensor(p, getattr(p, "shards", ()), src.mesh), cfg).clone()
                for n, p in src.named_parameters()
            }  # copies: the storage is freed on exit
        want = _continue(src, src_reducer, src_opt, cfg, 2)
        (dst,), dst_reducer, dst_opt, _, _ = _run(cfg, ParallelConfig(tp=1), 3, steps=0)
        load_checkpoint(path, [dst], dst_opt, dst.mesh)
        with zero3.gathered([dst]):
            for name, p in dst.named_parameters():
                if not torch.equal(trim_vocab(name, p.detach(), cfg), saved[name]):
                    raise AssertionError(f"zero=3 tp=2 -> tp=1: {name} differs after the load")
        got = _continue(dst, dst_reducer, dst_opt, cfg, 2)
        assert_close("zero=3 tp=2 -> tp=1: loss of the next step", got.loss, want.loss, rtol=1e-5)
        src_reducer.remove_hooks()
        dst_reducer.remove_hooks()
    finally:
        remove_shared_tmpdir(root)


def cases_for_world(world_size: int) -> list[str]:
    if world_size == 2:
        return [
            "zero3_dense_dp",
            "zero3_moe_edp_recompute",
            "zero3_offload",
            "zero3_recompute_full",
            "zero3_bf16",
            "zero3_eval_and_gathered",
            "zero3_memory",
            "zero3_checkpoint_roundtrip",
            "zero3_gather_sequence",
        ]
    if world_size == 4:
        return [
            "zero3_llama_tp2_sp_dp",
            "zero3_qwen3_tp2_sp_dp_full_recompute",
            "zero3_gpt2_tp2_dp_selective",
            "zero3_moe_ep2_edp",
            "zero3_checkpoint_reshard",
            "zero3_gpt2_pp2_tied_1f1b",
            "zero3_llama_pp2_interleaved",
        ]
    return []


def zero3_gather_sequence() -> None:
    """The exact all-gathers a ZeRO-3 step issues (dp/zero3.py, recorded at the collective), for
    Llama (untied) and GPT-2 (tied: the head gathers the embedding's buckets), 4 layers, one
    microbatch: forward gathers embed, layers.0..3, head (+ the tied embedding) once each, in
    order; backward gathers the head (+ tied embedding) and then layers.3..0, each bucket once,
    and never the embedding unit on its own (its backward needs no weights: a prefetch of it
    would be a wasted gather). The optimizer step gathers nothing."""
    for arch in ("llama", "gpt2"):
        cfg = dataclasses.replace(model_config(arch), num_layers=4)
        calls: list[tuple[str, int]] = []  # (phase, id of the shard gathered)
        original = zero3.all_gather_into

        def recording(full, shard, group, async_op=False):
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            calls.append((phase, id(shard)))
            return original(full, shard, group, async_op=async_op)

        zero3.all_gather_into = recording
        try:
            (model,), reducer, _, _, _ = _run(cfg, ParallelConfig(tp=1), 3, steps=1)
        finally:
            zero3.all_gather_into = original
        z = model._zero3
        owner = {id(s.shard): u.name for u in z.units for s in u.slots}
        units = {u.name: u for u in z.units}
        layers = [f"layers.{i}" for i in range(cfg.num_layers)]

        def names(unit_names):
            return [owner[id(s.shard)] for n in unit_names for s in units[n].gathers]

        want_forward = names(["embed", *layers, "head"])
        want_backward = names(["head", *reversed(layers)])
        got_forward = [owner[i] for phase, i in calls if phase == "forward"]
        got_backward = [owner[i] for phase, i in calls if phase == "backward"]
        if got_forward != want_forward:
            raise AssertionError(f"zero=3 {arch}: forward gathers {got_forward}, want {want_forward}")
        if got_backward != want_backward:
            raise AssertionError(f"zero=3 {arch}: backward gathers {got_backward}, want {want_backward}")
        if len(calls) != len(got_forward) + len(got_backward):
            raise AssertionError(f"zero=3 {arch}: gathers outside forward and backward: {calls}")
        if ("embed" in got_backward) != (arch == "gpt2"):  # tied: only as part of the head
            raise AssertionError(f"zero=3 {arch}: backward gathers {got_backward}")
        for z_ in zero3.sharders([model]):
            z_.remove_hooks()
        reducer.remove_hooks()
