"""ZeRO-1 / ZeRO-2: sharding AdamW state (and, for ZeRO-2, the reduced gradients) over the
replicas gives the weights of replicated AdamW after 5 steps (dense dp, tp x dp with SP, MoE
experts over edp, pp with tied embeddings), with 1/replicas of the state (and gradients).
optim.overlap_param_gather: the asynchronous per-bucket gathers give bit-identical losses and
weights to the blocking ones, and are still in flight when the first block's forward starts."""

from __future__ import annotations

import dataclasses
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from meshtron.dp import param_gather
from meshtron.dp.distributed_optimizer import ShardedAdamW
from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.dp.param_gather import finish_param_gather
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.mappings import all_gather_into
from meshtron.mpu.mesh import ParallelConfig, build_mesh, group_size
from meshtron.pipeline.executor import PipelineExecutor, activation_shape
from meshtron.training.checkpoint import TrainState, save_checkpoint
from meshtron.training.config import OptimConfig
from meshtron.training.optim import build_optimizer, build_reducer_and_optimizer
from meshtron.training.precision import FP32, Precision
from meshtron.training.step import pipeline_train_step, train_step
from tests.distributed.checkpoint_cases import remove_shared_tmpdir, shared_tmpdir
from tests.distributed.dense_cases import ADAM_EPS, LR, SEED, assert_close, build, microbatches, model_config
from tests.distributed.moe_cases import moe_config
from tests.distributed.pipeline_cases import pipeline_config

STEPS_ZERO = 5
MICRO_PER_RANK = 2  # pipeline cases


def _run(cfg, par, zero: int):
    """Train 5 steps; return (named params, reducer, optimizer, grad norms, grad bytes after the last step)."""
    mesh = build_mesh(par, cfg)
    if mesh.pp_size > 1:
        chunks = init_model_chunks(cfg, mesh, SEED)
        named = [(n, p) for c in chunks for n, p in c.named_parameters()]
        reducer = DataParallelGradReducer(named, mesh, bucket_mb=0.01, shard_grads=zero == 2)
        executor = PipelineExecutor(
            chunks, mesh, activation_shape(mesh, cfg.seq_len, 1, cfg.hidden_size), torch.float32, torch.device("cpu")
        )
        optimizer = build_optimizer(nn.ModuleList(chunks), lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    else:
        model, reducer, optimizer = build(cfg, mesh)
        chunks = [model]
        named = list(model.named_parameters())
        if zero == 2:
            reducer.remove_hooks()
            reducer = DataParallelGradReducer(named, mesh, bucket_mb=0.01, shard_grads=True)
    if zero:
        optimizer = ShardedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    norms = []
    for step in range(STEPS_ZERO):
        if mesh.pp_size > 1:
            micro = microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1, batch=mesh.dp_size * MICRO_PER_RANK)
            out = pipeline_train_step(
                chunks, reducer, optimizer, micro, mesh, executor, schedule="1f1b", lr=LR, max_grad_norm=1.0
            )
        else:
            out = train_step(
                chunks[0],
                reducer,
                optimizer,
                microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1),
                mesh,
                lr=LR,
                max_grad_norm=1.0,
            )
        norms.append(out.grad_norm)
    grad_bytes = reducer.grad_bytes()
    reducer.remove_hooks()
    return named, reducer, optimizer, norms, grad_bytes


def _check(cfg, par, zero: int = 1) -> None:
    plain, _, plain_opt, plain_norms, _ = _run(cfg, par, zero=0)
    sharded, reducer, zero_opt, norms, grad_bytes = _run(cfg, par, zero=zero)
    for (name, a), (_, b) in zip(sharded, plain):
        assert_close(f"zero={zero} weight {name}", a, b, rtol=1e-6)
    # The per-parameter moments checkpoints save equal replicated AdamW's state.
    moments, step = zero_opt.param_moments()
    for (name, a), (_, b) in zip(sharded, plain):
        for got, key in zip(moments[a], ("exp_avg", "exp_avg_sq")):
            assert_close(f"zero={zero} {key} {name}", got, plain_opt.state[b][key], rtol=1e-6)
    if step != STEPS_ZERO:
        raise AssertionError(f"zero={zero}: optimizer step count {step}, want {STEPS_ZERO}")
    for step, (a, b) in enumerate(zip(norms, plain_norms)):
        assert_close(f"zero={zero} step {step} grad norm", a, b, rtol=1e-6)
    replicas = [group_size(b.group) for b in reducer.buckets]
    replicated_state = sum(8 * p.numel() for _, p in plain)
    want = sum(8 * b.numel // r for b, r in zip(reducer.buckets, replicas))
    got = zero_opt.state_bytes()
    if got != want:
        raise AssertionError(f"optimizer state {got} B, want {want} B (replicated: {replicated_state} B)")
    if max(replicas) > 1 and not got < replicated_state:
        raise AssertionError("sharding did not reduce the optimizer state")
    # Gradient memory held between steps: the full buckets (ZeRO-1) or 1/replicas of them (ZeRO-2).
    want_grads = sum(4 * b.numel // (r if zero == 2 else 1) for b, r in zip(reducer.buckets, replicas))
    if grad_bytes != want_grads:
        raise AssertionError(f"zero={zero}: {grad_bytes} B of gradients after a step, want {want_grads} B")
    if zero == 2 and max(replicas) > 1:
        for bucket, r in zip(reducer.buckets, replicas):
            if r > 1 and (bucket.buffer is not None or any(p.grad is not None for p in bucket.params)):
                raise AssertionError("zero=2: a sharded bucket's full gradient buffer is still allocated")


def zero1_dense_dp() -> None:
    _check(model_config("gpt2"), ParallelConfig(tp=1))


def zero1_llama_tp2_sp_dp() -> None:
    _check(model_config("llama"), ParallelConfig(tp=2, sp=True))


def zero1_moe_edp() -> None:
    _check(moe_config("gpt2", 2, "softmax", None), ParallelConfig(tp=1, ep=2))


def zero2_dense_dp() -> None:
    _check(model_config("gpt2"), ParallelConfig(tp=1), zero=2)


def zero2_llama_tp2_sp_dp() -> None:
    _check(model_config("llama"), ParallelConfig(tp=2, sp=True), zero=2)


def zero2_qwen2_tp2_sp_dp() -> None:
    """Qwen2's q/k/v biases (sharded with the fused QKV rows) under ZeRO-2 at tp=2 with SP."""
    _check(model_config("qwen2"), ParallelConfig(tp=2, sp=True), zero=2)


def zero2_moe_ep2_edp2() -> None:
    _check(moe_config("gpt2", 2, "softmax", None), ParallelConfig(tp=1, ep=2), zero=2)


def zero2_gpt2_pp2_tied_1f1b() -> None:
    """pp=2 (x dp=world/2) with tied embeddings: the two copies are summed before the scatter."""
    _check(pipeline_config("gpt2", False), ParallelConfig(tp=1, pp=2, schedule="1f1b"), zero=2)


def zero1_gpt2_pp2_tied_1f1b() -> None:
    """ZeRO-1 with the reducer summing the tied embedding after the all-reduce."""
    _check(pipeline_config("gpt2", False), ParallelConfig(tp=1, pp=2, schedule="1f1b"), zero=1)


def zero2_zero_grad_required() -> None:
    """A backward after finish() without zero_grad() fails instead of silently losing grads."""
    cfg = model_config("gpt2")
    mesh = build_mesh(ParallelConfig(tp=1), cfg)
    (model,) = init_model_chunks(cfg, mesh, SEED)
    reducer = DataParallelGradReducer(list(model.named_parameters()), mesh, bucket_mb=0.01, shard_grads=True)
    try:
        ShardedAdamW(reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
        inputs, targets = microbatches(cfg, 0, mesh.dp_rank, mesh.dp_size, 1)[0]
        model.loss_per_token(model(inputs), targets).sum().backward()
        reducer.finish()
        try:
            model.loss_per_token(model(inputs), targets).sum().backward()
        except RuntimeError as err:
            assert "zero_grad" in str(err), err
        else:
            raise AssertionError("backward after finish() without zero_grad() did not fail")
    finally:
        reducer.remove_hooks()
    dist.barrier()


def bf16_gradient_compression() -> None:
    """optim.grad_comm_dtype=bf16: each bucket is summed over dp in bf16 (all-reduce, and the
    ZeRO-2 reduce-scatter) and written back to the fp32 gradient: the result is exactly the
    bf16 sum of the bf16-rounded local gradients, which is within bf16 precision of the fp32 sum."""
    cfg = model_config("gpt2")
    for shard in (False, True):
        mesh = build_mesh(ParallelConfig(tp=1), cfg)
        (model,) = init_model_chunks(cfg, mesh, SEED)
        results = {}
        for comm in (None, torch.bfloat16):
            reducer = DataParallelGradReducer(
                list(model.named_parameters()), mesh, bucket_mb=0.01, shard_grads=shard, comm_dtype=comm
            )
            reducer.zero_grad()
            inputs, targets = microbatches(cfg, 0, mesh.dp_rank, mesh.dp_size, 2)[0]
            with reducer.sync(True):
                model.loss_per_token(model(inputs), targets).mean().backward()
            local = [b.buffer.clone() for b in reducer.buckets]
            reducer.finish()
            results[comm] = [b.shard.clone() for b in reducer.buckets]
            reducer.remove_hooks()
        for bucket, mine, fp32, bf16 in zip(reducer.buckets, local, results[None], results[torch.bfloat16]):
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, mine)
            exact = torch.stack([t.to(torch.bfloat16).float() for t in everyone]).sum(0).to(torch.bfloat16).float()
            want = exact[bucket.shard_start : bucket.shard_start + bucket.shard.numel()]
            if not torch.equal(bf16, want):
                raise AssertionError(f"shard_grads={shard}: the bf16 reduction is not the bf16 sum")
            # bf16 keeps 8 mantissa bits (relative rounding <= 2**-8 per value).
            assert_close(f"shard_grads={shard}: bf16-reduced gradients vs the fp32 sum", bf16, fp32, rtol=2**-8)
        if all(torch.equal(a, b) for a, b in zip(results[None], results[torch.bfloat16])):
            raise AssertionError("compression changed nothing: the test would prove nothing")


# ---- optim.overlap_param_gather: asynchronous per-bucket parameter all-gathers ----------------------

STEPS_OVERLAP = 3
BUCKET_MB = 0.01  # many small buckets: most of them are still gathering when the first layer runs
SLOW_PEER_S = 0.1  # gathers issued this late: a forward reading a bucket before its wait reads stale values


def _overlap_run(
    cfg, par, o: OptimConfig, overlap: bool, precision=FP32, slow: float = 0.0, last_only: bool = False, save_to=None
):
    """Train 3 steps with `o` (blocking or overlapped gathers); return (losses, {name: weight}
    after `finish_param_gather`, the `ParamGather` or None, the recorded spans of the last step:
    its unit forwards and the gathers launched by the update before it). `slow` (seconds):
    every rank issues its gathers that much later (`_slow_down_gathers`; `last_only`: rank 1,
    the last bucket's only). `save_to`: a weights-only checkpoint is saved there right after
    the last update (before anything else waits for its gathers)."""
    mesh = build_mesh(par, cfg)
    chunks = init_model_chunks(cfg, mesh, SEED)
    reducer, optimizer = build_reducer_and_optimizer(o, chunks, mesh)
    gather = optimizer.overlap_param_gather(chunks) if overlap else None
    if overlap and (gather is None or not gather.order):
        raise AssertionError("overlap_param_gather installed nothing: the test would prove nothing")
    if overlap:
        _check_hooked(gather)
    if slow and (dist.get_rank() == 1 or not last_only):
        _slow_down_gathers(gather, slow, last_only)
    executor = None
    if mesh.pp_size > 1:
        executor = PipelineExecutor(
            chunks, mesh, activation_shape(mesh, cfg.seq_len, 1, cfg.hidden_size), torch.float32, torch.device("cpu")
        )
    losses, since = [], 0.0
    try:
        for step in range(STEPS_OVERLAP):
            if gather is not None and step == STEPS_OVERLAP - 2:
                gather.record(True)
            since = time.perf_counter()
            if executor is not None:
                micro = microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1, batch=mesh.dp_size * MICRO_PER_RANK)
                out = pipeline_train_step(
                    chunks,
                    reducer,
                    optimizer,
                    micro,
                    mesh,
                    executor,
                    schedule="1f1b",
                    lr=LR,
                    max_grad_norm=1.0,
                    precision=precision,
                )
            else:
                out = train_step(
                    chunks[0],
                    reducer,
                    optimizer,
                    microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, 1),
                    mesh,
                    lr=LR,
                    max_grad_norm=1.0,
                    precision=precision,
                )
            losses.append(out.loss)
        if gather is not None and not gather.pending():
            raise AssertionError("no gather pending after the last update: they were not asynchronous")
        if save_to is not None:  # a reader outside forward: must wait for the gathers itself
            save_checkpoint(
                save_to, TrainState(step=STEPS_OVERLAP), chunks, None, mesh, model_config=dataclasses.asdict(cfg)
            )
        finish_param_gather(chunks)
        weights = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters()}
    finally:
        reducer.remove_hooks()
        if gather is not None:
            gather.remove_hooks()
    return losses, weights, gather, (gather.spans_of_step(since) if gather is not None else [])


def _check_hooked(gather) -> None:
    """Every trained parameter is waited for by the pre-hook of the unit reading it: none is left
    to the chunk's post-hook, and a last stage's tied embedding copy is waited for by its head
    (a pipeline hides a late wait there: the stage's input arrives after the gathers are done)."""
    for ci, chunk in enumerate(gather.chunks):
        if gather.leftover[ci]:
            raise AssertionError(f"chunk {ci}: buckets {gather.leftover[ci]} are waited for only after the forward")
        if chunk.embed is not None and not chunk.pre_process:
            tied = next(i for i, b in enumerate(gather.buckets) if any(p is chunk.embed.weight for p in b.params))
            if tied not in gather.unit_buckets[(ci, "head")]:
                raise AssertionError(f"chunk {ci}: the head does not wait for the tied embedding copy's bucket")


class _LateWork:
    """A collective issued `delay` seconds from now by a thread (a slow peer), after the one
    issued before it (`previous`, so the order of collectives is kept): `wait` joins the
    thread, then waits for the collective."""

    def __init__(self, issue, delay: float, previous: _LateWork | None = None):
        self.work = None
        self.thread = threading.Thread(
            target=self._run, args=(issue, time.perf_counter() + delay, previous), daemon=True
        )
        self.thread.start()

    def _run(self, issue, when, previous):
        if previous is not None:
            previous.thread.join()
        time.sleep(max(when - time.perf_counter(), 0.0))
        self.work = issue()

    def wait(self):
        self.thread.join()
        return self.work.wait()

    def is_completed(self) -> bool:
        return self.work is not None and self.work.is_completed()

    def get_future(self):
        raise RuntimeError("no future: the span ends when waited for")


def _slow_down_gathers(gather, delay: float, last_only: bool = False) -> None:
    """This rank issues the parameter all-gathers (`last_only`: only the last bucket's)
    `delay` seconds after the update, from threads, in launch order, while its main thread goes
    on into the next forward: its peers' copies of those buckets stay stale until then, so a
    parameter read before its wait gives other values. Nothing else runs on the gathers' own
    groups until the forward waits for them, so the order of collectives on them is unchanged."""
    last = gather.buckets[gather.order[-1]].param_buffer
    real = param_gather.all_gather_into
    previous = None

    def all_gather_into(output, own, group, async_op=False):
        nonlocal previous
        if last_only and output is not last:
            return real(output, own, group, async_op=async_op)
        previous = _LateWork(lambda: real(output, own, group, async_op=True), delay, previous)
        return previous

    param_gather.all_gather_into = all_gather_into


def _check_overlap(cfg, par, what: str, precision=FP32, **optim) -> None:
    """Overlapped gathers give bit-identical losses and weights to blocking ones, with every
    gather issued 0.1 s late (a parameter read before its bucket's wait reads stale values)."""
    o = OptimConfig(lr=LR, eps=ADAM_EPS, bucket_mb=BUCKET_MB, **optim)
    blocking, want, _, _ = _overlap_run(cfg, par, dataclasses.replace(o, overlap_param_gather=False), False, precision)
    try:
        got_losses, got, _, _ = _overlap_run(cfg, par, o, True, precision, slow=SLOW_PEER_S)
    finally:
        param_gather.all_gather_into = all_gather_into
    for step, (a, b) in enumerate(zip(got_losses, blocking)):
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: step {step + 1} loss {a.item()!r} overlapped vs {b.item()!r} blocking")
    for name, tensor in want.items():
        if not torch.equal(got[name], tensor):
            raise AssertionError(
                f"{what}: weight {name} differs from the blocking gather's "
                f"(max |diff| {(got[name].float() - tensor.float()).abs().max().item():.3g})"
            )


def overlap_param_gather_dense_dp() -> None:
    """zero=1 and 2, fp32 and bf16 gradient reduction, offloaded zero=2, 16-bit resident zero=1."""
    cfg = model_config("gpt2")
    for zero in (1, 2):
        for comm in ("fp32", "bf16"):
            _check_overlap(
                cfg, ParallelConfig(tp=1), f"zero={zero} grad_comm_dtype={comm}", zero=zero, grad_comm_dtype=comm
            )
    _check_overlap(cfg, ParallelConfig(tp=1), "offload zero=2", zero=2, offload=True)
    _check_overlap(
        cfg, ParallelConfig(tp=1), "bf16 resident zero=1", precision=Precision("bf16"), zero=1, param_dtype="bf16"
    )


def overlap_param_gather_pp2() -> None:
    """pp=2 x dp=2, 1f1b, tied embeddings (the last stage's copy is waited for by its head)."""
    cfg = pipeline_config("gpt2", False)
    for zero in (1, 2):
        _check_overlap(cfg, ParallelConfig(tp=1, pp=2, schedule="1f1b"), f"pp=2 zero={zero}", zero=zero)


def overlap_param_gather_tp2_sp_moe() -> None:
    """tp=2 with SP (replicated norms gathered over tp x dp) and MoE experts over edp."""
    _check_overlap(model_config("llama"), ParallelConfig(tp=2, sp=True), "tp=2 sp zero=2", zero=2)
    _check_overlap(moe_config("gpt2", 2, "softmax", None), ParallelConfig(tp=1, ep=2), "moe ep=2 zero=1", zero=1)


def overlap_param_gather_in_flight() -> None:
    """The gathers run during the forward: with rank 1's last-bucket gather issued 0.5 s late,
    rank 0's first block starts (after waiting for its own buckets only) while the last bucket's
    gather is still in flight, and results still equal the blocking gather's; a checkpoint saved
    right after the last update (that gather still in flight) is byte-identical to the blocking
    run's. The buckets are launched in forward order: the embedding's first."""
    cfg = model_config("gpt2")
    par = ParallelConfig(tp=1)
    o = OptimConfig(lr=LR, eps=ADAM_EPS, bucket_mb=BUCKET_MB, zero=1)
    root = shared_tmpdir()
    try:
        want_losses, want, _, _ = _overlap_run(
            cfg, par, dataclasses.replace(o, overlap_param_gather=False), False, save_to=root / "blocking"
        )
        try:
            losses, got, gather, spans = _overlap_run(
                cfg, par, o, True, slow=0.5, last_only=True, save_to=root / "overlap"
            )
        finally:
            param_gather.all_gather_into = all_gather_into
        dist.barrier()
        # The checkpoint saved while the last gather was still in flight holds the gathered weights.
        if dist.get_rank() == 0:
            for blocking in sorted((root / "blocking").glob("step_*/*.distcp")):
                mine = root / "overlap" / blocking.parent.name / blocking.name
                if blocking.read_bytes() != mine.read_bytes():
                    raise AssertionError(f"{mine.name}: the checkpoint saved with a gather in flight differs")
            if not list((root / "blocking").glob("step_*/*.distcp")):
                raise AssertionError("no checkpoint files to compare")
    finally:
        remove_shared_tmpdir(root)
    if [loss.item() for loss in losses] != [loss.item() for loss in want_losses] or any(
        not torch.equal(got[n], t) for n, t in want.items()
    ):
        raise AssertionError("a late gather changed the results")
    first = gather.buckets[gather.order[0]]
    if "embed.weight" not in first.names:
        raise AssertionError(f"first bucket gathered holds {first.names}, not the embedding")
    if dist.get_rank() != 0:
        return
    # The last step's spans: the forward of step 3 and the gathers launched by step 2's update.
    gathers = [s for s in spans if s.lane == "param all-gather"]
    block0 = next(s for s in spans if s.name == "F layers.0")
    last = next(s for s in gathers if s.args["bucket"] == gather.order[-1])
    if block0.args["gathers_in_flight"] < 1:
        raise AssertionError(f"no gather in flight when the first block started: {block0.args}")
    if not last.start < block0.start < last.end:
        raise AssertionError(
            f"the last bucket's gather [{last.start:.4f}, {last.end:.4f}] does not span the first "
            f"block's start {block0.start:.4f}"
        )
    if last.end - last.start < 0.4:
        raise AssertionError(f"the last gather took {last.end - last.start:.3f} s: rank 1's delay did not apply")


def cases_for_world(world_size: int) -> list[str]:
    if world_size == 2:
        return [
            "zero1_dense_dp",
            "zero2_dense_dp",
            "zero2_zero_grad_required",
            "bf16_gradient_compression",
            "overlap_param_gather_dense_dp",
            "overlap_param_gather_in_flight",
        ]
    if world_size == 4:
        return [
            "zero1_dense_dp",
            "zero1_llama_tp2_sp_dp",
            "zero2_qwen2_tp2_sp_dp",
            "zero1_moe_edp",
            "zero2_dense_dp",
            "zero2_llama_tp2_sp_dp",
            "zero2_moe_ep2_edp2",
            "zero2_gpt2_pp2_tied_1f1b",
            "zero1_gpt2_pp2_tied_1f1b",
            "overlap_param_gather_pp2",
            "overlap_param_gather_tp2_sp_moe",
        ]
    return []
