"""Data-parallel gradient reduction in buckets, overlapped with backward.

Each parameter's `.grad` is a view into a flat bucket buffer. A post-accumulate-grad hook
counts the parameters of a bucket that are ready; when the last one is, the bucket's
all-reduce is launched asynchronously while backward keeps running. `finish()` waits for
all of them. Buckets are filled in reverse registration order, roughly the order in which
backward produces gradients.

First touch: `zero_grad()` does not zero the buffers. It leaves every parameter's gradient
unset, so autograd hands the first gradient of the step to the post-accumulate-grad hook as a
tensor of its own, which the hook copies into the parameter's bucket slice and makes `.grad`
again; later microbatches accumulate into the slice as usual. That is one copy instead of a
memset of every buffer plus an accumulation (~1.4 ms of a ~330 ms step of the MoE benchmark
model on the 2-core CPU; docs/parallelism.md). `finish()` zeroes the slices of parameters that got no
gradient in the step. ZeRO-3 unit buffers (allocated zeroed per unit) are left as they were.

Reductions are sums, not averages: the training loss is already divided by the number of
tokens in the global batch, so summing over data-parallel replicas (and accumulating over
microbatches) gives exactly the single-process gradient.

Groups:
  * ordinary parameters (key "dp"): the data replicas, `mesh.dp_cp` (dp x cp: with context
    parallelism each cp rank saw other tokens of the same sequences; `mesh.dp` without);
  * sequence-parallel replicated parameters (norms, row-parallel biases, position
    embeddings under SP; MoE routers at tp > 1), whose gradient on each
    TP rank covers only its tokens: the flattened `mesh.tp_dp` group (every rank of the
    stage), summing over TP, CP and DP in one collective;
  * expert parameters: the expert-data-parallel group `mesh.edp` (replicas of the same
    expert shard that saw different tokens).

Hierarchical all-reduce (`parallel.dp_hierarchical`, dp/hierarchical.py): with ZeRO 0/1 the
"dp" buckets are reduce-scattered inside a node when launched; `finish()` then launches every
bucket's all-reduce across nodes, then every all-gather inside the node (`pipeline_stages`). Local SGD (training/local_sgd.py) passes
`replica_groups` that leave the data replicas out of every sum.

ZeRO-2 (`shard_grads=True`): each bucket is reduce-scattered instead of all-reduced, into
`bucket.shard` (this rank's `[rank*size, (rank+1)*size)` range of the bucket, size =
buffer / replicas), which `ShardedAdamW` uses as its gradient. The full bucket buffer is only
the local accumulation space of backward: `finish()` frees it (and sets `p.grad = None` for
its parameters) once the reduce-scatter is done, `zero_grad()` re-creates it and re-points
every `p.grad` at it, so outside forward/backward a rank holds 1/replicas of the gradients.
Buckets whose group has one member are not sharded (their shard is the whole buffer).

ZeRO-3 (`unit_buffers()`, called by `dp.zero3.Zero3`): a sharded bucket's full buffer exists
only while its unit's backward runs. `ensure_buffers` allocates it (Zero3 calls it before the
unit's backward); once all its parameters' gradients are in, it is reduce-scattered — after
every microbatch, not only the last — into a temporary that is added to `bucket.shard` (the
step's accumulator, zeroed by `zero_grad()`), and freed when the next bucket is launched (or
in `finish()`). So during backward a rank holds the gradients of about two units in full
instead of the whole model's. Summing per microbatch instead of per step changes only the
order of the fp32 additions. Tied-embedding buckets under pipeline parallelism keep the
ZeRO-2 behaviour (summed over the stages first, in `finish()`).

16-bit resident weights (`main_grads=True`, dp/resident.py): torch requires a gradient's
dtype to equal its parameter's, so a bf16 parameter's `.grad` cannot be a view of an fp32
bucket. Instead each parameter's `main_grad` (Megatron's name) is the fp32 view; a
post-accumulate-grad hook on every parameter adds the bf16 `.grad` autograd produced into it
and drops `.grad`, so microbatch accumulation and the dp reduction (or reduce-scatter) stay fp32.

Tied embeddings under pipeline parallelism (parameters tagged `tied_across_stages`: the
embedding weight of the first stage and its copy on the last stage): both copies' gradients
are summed over `mesh.embedding` in `finish()`. With `shard_grads` their buckets (tied parameters get buckets
of their own) are not launched from the backward hooks: `finish()` first launches all other
buckets, then all-reduces the tied gradients over `mesh.embedding`, then reduce-scatters
their buckets (the two stages' buckets are laid out differently, so the sum must come before
the scatter; doing it in a hook would block the last stage's pipeline sends). Without
`shard_grads` the sum happens after all buckets are reduced.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from meshtron.dp.hierarchical import dp_hierarchy, pipeline_stages, resolve_hierarchical
from meshtron.mpu import shm_collectives as shm
from meshtron.mpu.mappings import reduce_scatter_into
from meshtron.mpu.mesh import Mesh, group_rank, group_size
from meshtron.mpu.waits import wait_for


@dataclass
class _Bucket:
    group: object
    buffer: torch.Tensor | None  # None between finish() and zero_grad() when grads are sharded
    params: list[nn.Parameter]
    ready: int = 0
    work: object = None
    launched: bool = False
    names: list[str] = field(default_factory=list)
    decay: bool = True
    key: str = "dp"  # replica group: "dp", "tp_dp" or "edp"
    numel: int = 0  # padded size of the flat buffer
    shard: torch.Tensor | None = None  # this rank's range of the (reduced) bucket
    shard_start: int = 0
    deferred: bool = False  # holds a tied embedding: launched by finish() after the pp sum
    comm: tuple | None = None  # (wire buffer, its result) while a compressed reduction is in flight
    lazy: bool = False  # ZeRO-3: full buffer only during its unit's backward, reduced every microbatch
    in_shm: bool = False  # all-reduced through shared memory by finish() (CPU ranks of one host)
    padding: int = 0  # zeros after the last parameter (the buffer is padded to a multiple of the replicas)


GRAD_GROUPS = ("dp", "tp_dp", "edp")


def replica_group(mesh, key: str):
    """The process group of gradient group `key`: "dp" sums over the data replicas, which
    with context parallelism are dp x cp (`mesh.dp_cp`: each cp rank saw other tokens of the
    same sequences); "tp_dp" over every rank of the stage; "edp" over expert replicas."""
    return mesh.dp_cp if key == "dp" else getattr(mesh, key)


def grad_group(p: nn.Parameter) -> str:
    """Replica group a parameter's gradient is summed over: "edp" (experts), "tp_dp"
    (sequence-parallel replicated: each TP rank saw only its tokens) or "dp"."""
    if getattr(p, "expert", False):
        return "edp"
    return "tp_dp" if getattr(p, "sequence_parallel", False) else "dp"


def is_tied_embedding(p: nn.Parameter) -> bool:
    """Whether `p` is a tied embedding whose pipeline-stage copies are summed over `mesh.embedding`."""
    return getattr(p, "tied_across_stages", False)


@dataclass(frozen=True)
class BucketSpec:
    """One gradient bucket: its replica group `key`, weight-decay class (matrices), whether it
    holds tied embeddings, its (name, parameter) items in fill order, their elements and the
    buffer size padded to a multiple of the replica count."""

    key: str
    decay: bool
    tied: bool
    items: tuple
    numel: int
    padded_numel: int


def bucket_layout(
    named_params, replicas: dict[str, int], bucket_mb: float = 25.0, *, tied_apart: bool = False, unit_of=None
) -> list[BucketSpec]:
    """The buckets `DataParallelGradReducer` fills (pure: no tensor is touched, so meta
    parameters work): parameters needing a gradient, classed by replica group (`grad_group`),
    by weight decay (ndim >= 2, so a ZeRO shard of a bucket belongs to one optimizer group) and,
    when `tied_apart` (the tied embedding's copies live on different ranks), into buckets of
    their own for tied embeddings; each class is taken in reverse registration order and a
    bucket closed once it reaches `bucket_mb` MiB of fp32. `replicas[key]` is the size of the
    group each bucket's buffer is padded to a multiple of. `unit_of(name)` (ZeRO-3: the unit of
    parameters gathered together, dp/zero3.py) also closes a bucket where the unit changes, so
    every bucket belongs to one unit."""
    by_class: dict[tuple[str, bool, bool], list[tuple[str, nn.Parameter]]] = {}
    for name, p in named_params:
        if p.requires_grad:
            cls = (grad_group(p), p.ndim >= 2, tied_apart and is_tied_embedding(p))
            by_class.setdefault(cls, []).append((name, p))
    limit = int(bucket_mb * 2**20)
    out: list[BucketSpec] = []

    def close(key, decay, tied, items):
        numel = sum(p.numel() for _, p in items)
        padded = -(-numel // replicas[key]) * replicas[key]
        out.append(BucketSpec(key, decay, tied, tuple(items), numel, padded))

    for (key, decay, tied), items in by_class.items():
        current: list[tuple[str, nn.Parameter]] = []
        size = 0
        for name, p in reversed(items):
            if current and unit_of is not None and unit_of(name) != unit_of(current[-1][0]):
                close(key, decay, tied, current)
                current, size = [], 0
            current.append((name, p))
            size += p.numel() * 4
            if size >= limit:
                close(key, decay, tied, current)
                current, size = [], 0
        if current:
            close(key, decay, tied, current)
    return out


class DataParallelGradReducer:
    """Owns the gradient buffers of `params` and sums them over their replica groups.

    Usage per optimizer step:
        reducer.zero_grad()
        for i, micro in enumerate(microbatches):
            with reducer.sync(i == last):
                loss(micro).backward()
        reducer.finish()      # all bucket collectives done; grads are final
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        mesh: Mesh,
        bucket_mb: float = 25.0,
        *,
        shard_grads: bool = False,
        comm_dtype: torch.dtype | None = None,
        unit_of=None,
        main_grads: bool = False,
        replica_groups: dict | None = None,
    ):
        """`replica_groups` {key: group} replaces `replica_group(mesh, key)` for those keys (local
        SGD, training/local_sgd.py: the data replicas left out of the sum)."""
        self.mesh = mesh
        self.shard_grads = shard_grads
        # 16-bit resident weights: gradients land in `p.main_grad` (fp32 bucket views), see the module doc
        self.main_grads = main_grads
        # Gradient compression: buckets travel (and are summed) in `comm_dtype`, e.g. bf16, while
        # microbatch accumulation and the result stay fp32 (as DDP's bf16 compression hook).
        self.comm_dtype = comm_dtype
        self._sync_enabled = True
        self._in_flight: list[_Bucket] = []  # ZeRO-3 unit buckets launched, not yet added to their shards
        self.peak_buffer_bytes = 0  # most bytes of full gradient buffers at once (ZeRO-3 unit buffers)
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._slice_of: dict[int, torch.Tensor] = {}  # id(param) -> its view of the bucket buffer
        self._untouched: dict[int, nn.Parameter] = {}  # parameters without a gradient yet this step (first touch)
        tied_apart = group_size(mesh.embedding) > 1
        self.tied_embedding = [p for _, p in named_params if p.requires_grad and is_tied_embedding(p) and tied_apart]
        groups = {key: replica_group(mesh, key) for key in GRAD_GROUPS}
        groups.update(replica_groups or {})
        replicas = {key: group_size(group) for key, group in groups.items()}
        # parallel.dp_hierarchical: "dp" buckets all-reduced in three stages (dp/hierarchical.py)
        self.hierarchy = None
        if (
            "dp" not in (replica_groups or {})
            and mesh.dense_mesh is not None
            and resolve_hierarchical(
                mesh.par.dp_hierarchical, mesh.par, mesh.world_size, mesh.ranks_per_node, shard_grads=shard_grads
            )
        ):
            self.hierarchy = dp_hierarchy(mesh)
        for spec in bucket_layout(named_params, replicas, bucket_mb, tied_apart=tied_apart, unit_of=unit_of):
            self._make_bucket(groups[spec.key], spec)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for bucket in self.buckets for p in bucket.params
        ]

    def _reduces_in_shm(self, group, buffer: torch.Tensor) -> bool:
        """Whether a bucket of `buffer` is all-reduced through shared memory (mpu/shm_collectives)
        rather than gloo: a plain fp32 all-reduce (no ZeRO-2 scatter, compression or hierarchy)
        over a group of CPU ranks on one host. Collective over `group` on its first call (host
        names compared), which is why the constructor decides it, at the same point on every rank."""
        if group_size(group) <= 1 or self.shard_grads or self.hierarchy is not None:
            return False
        if self.comm_dtype is not None and self.comm_dtype != buffer.dtype:
            return False
        return shm.eligible(group, buffer[:0])

    def _make_bucket(self, group, spec: BucketSpec) -> None:
        params = [p for _, p in spec.items]
        dtype = torch.float32 if params[0].dtype in (torch.float16, torch.bfloat16) else params[0].dtype
        replicas, rank = group_size(group), group_rank(group)
        buffer = torch.zeros(spec.padded_numel, dtype=dtype, device=params[0].device)
        bucket = _Bucket(
            group=group,
            buffer=buffer,
            params=params,
            names=[n for n, _ in spec.items],
            decay=spec.decay,
            key=spec.key,
            numel=spec.padded_numel,
            deferred=spec.tied and self.shard_grads,
            padding=spec.padded_numel - sum(p.numel() for p in params),
        )
        bucket.in_shm = self._reduces_in_shm(group, buffer)
        self._point_grads(bucket, self.main_grads)
        size = spec.padded_numel // replicas
        bucket.shard_start = rank * size
        if self._sharded(bucket):
            bucket.shard = torch.zeros(size, dtype=dtype, device=buffer.device)
        else:  # ZeRO-0/1, or a group of one: the shard is a view of the (persistent) buffer
            bucket.shard = buffer[rank * size : (rank + 1) * size]
        for p in params:
            self._bucket_of[id(p)] = bucket
        self.buckets.append(bucket)

    def _sharded(self, bucket: _Bucket) -> bool:
        """Whether `bucket` is reduce-scattered into its own shard tensor (ZeRO-2, > 1 replica)."""
        return self.shard_grads and group_size(bucket.group) > 1

    def _point_grads(self, bucket: _Bucket, main_grads: bool = False, *, unset: bool = False) -> None:
        """Record each parameter's slice of `bucket.buffer` and make it the parameter's `.grad`
        (`main_grad`); `unset`: leave `.grad` unset for a first touch (see the module doc)."""
        offset = 0
        for p in bucket.params:
            view = bucket.buffer[offset : offset + p.numel()].view(p.shape)
            self._slice_of[id(p)] = view
            if main_grads:
                p.main_grad = view
            elif not unset:
                p.grad = view
            offset += p.numel()

    def unit_buffers(self) -> None:
        """ZeRO-3: from now on a sharded bucket's full buffer exists only while its unit's
        backward runs (module doc); frees them now. Needs `shard_grads`."""
        if not self.shard_grads:
            raise ValueError("per-unit gradient buffers need shard_grads=True")
        for bucket in self.buckets:
            if self._sharded(bucket) and not bucket.deferred:
                bucket.lazy = True
                self._free_buffer(bucket)

    def ensure_buffers(self, buckets) -> None:
        """Allocate (zeroed) the full buffers of those of `buckets` that are ZeRO-3 unit
        buckets without one, and point their parameters' `.grad` at them. No communication."""
        for bucket in buckets:
            if bucket.lazy and bucket.buffer is None:
                bucket.buffer = torch.zeros(bucket.numel, dtype=bucket.shard.dtype, device=bucket.shard.device)
                self._point_grads(bucket, self.main_grads)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes())

    def buffer_bytes(self) -> int:
        """Bytes of full gradient buffers allocated now."""
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets if b.buffer is not None)

    @staticmethod
    def _free_buffer(bucket: _Bucket) -> None:
        for p in bucket.params:
            p.grad = None
            if hasattr(p, "main_grad"):
                p.main_grad = None
        bucket.buffer = None

    def complete_unit_buckets(self) -> None:
        """Wait for the ZeRO-3 unit buckets in flight, add each result to its shard, free its buffer."""
        for bucket in self._in_flight:
            if bucket.work is not None:
                wait_for(
                    bucket.work,
                    f"reduce_scatter of a ZeRO-3 gradient bucket over {bucket.key} "
                    f"({bucket.numel * bucket.shard.element_size() / 2**20:.1f} MiB)",
                )
            result, _ = bucket.comm
            bucket.shard.add_(result)
            self._free_buffer(bucket)
            bucket.work, bucket.ready, bucket.launched, bucket.comm = None, 0, False, None
        self._in_flight = []

    def _launch_unit_bucket(self, bucket: _Bucket) -> None:
        """Reduce-scatter a ZeRO-3 unit bucket into a temporary (in `comm_dtype` if set)
        after completing the previous one (one bucket in flight)."""
        self.complete_unit_buckets()
        bucket.launched = True
        source = bucket.buffer
        if self.comm_dtype is not None and self.comm_dtype != source.dtype:
            source = source.to(self.comm_dtype)
        result = torch.empty(bucket.shard.numel(), dtype=source.dtype, device=source.device)
        bucket.comm = (result, bucket.shard)
        bucket.work = reduce_scatter_into(result, source, group=bucket.group, async_op=True)
        self._in_flight.append(bucket)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self._bucket_of[id(param)]
        first = self._untouched.pop(id(param), None) is not None
        if self.main_grads:  # 16-bit weights: accumulate the 16-bit gradient into the fp32 bucket
            if param.main_grad is None:
                raise RuntimeError(
                    "gradient buckets are freed after finish() with shard_grads=True: call "
                    "reducer.zero_grad() before backward"
                )
            if first:
                param.main_grad.copy_(param.grad)
            else:
                param.main_grad.add_(param.grad)
            param.grad = None
        elif first:  # the step's first gradient: into the bucket slice, which becomes .grad
            view = self._slice_of[id(param)]
            view.copy_(param.grad)
            param.grad = view
        if bucket.buffer is None and bucket.lazy:
            raise RuntimeError(
                "a ZeRO-3 gradient bucket has no buffer: dp.zero3.Zero3 allocates it before its "
                "unit's backward (is the model's Zero3 installed and its hooks in place?)"
            )
        if bucket.buffer is None:
            raise RuntimeError(
                "gradient buckets are freed after finish() with shard_grads=True: call "
                "reducer.zero_grad() before backward"
            )
        if bucket.lazy:  # ZeRO-3: reduced after every microbatch
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch_unit_bucket(bucket)
            return
        if not self._sync_enabled:
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.params) and not bucket.deferred:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.launched:
            return
        bucket.launched = True
        if group_size(bucket.group) <= 1:
            return
        if bucket.in_shm:
            # A blocking shared-memory sum (about 3x faster than gloo's for a 12 MB bucket on the
            # 2-core host) runs in finish(), in bucket order, never inside a backward hook: the
            # cores that would overlap it with backward are the ones computing anyway.
            return
        source, target = bucket.buffer, (bucket.shard if self.shard_grads else bucket.buffer)
        if self.comm_dtype is not None and self.comm_dtype != source.dtype:
            wire = source.to(self.comm_dtype)
            result = (
                torch.empty(target.numel(), dtype=self.comm_dtype, device=wire.device) if self.shard_grads else wire
            )
            bucket.comm = (result, target)
            source, target = wire, result
        if self.shard_grads:
            bucket.work = reduce_scatter_into(target, source, group=bucket.group, async_op=True)
        elif self.hierarchy is not None and bucket.key == "dp":  # intra-node stage now, the rest in finish()
            bucket.work = self.hierarchy.all_reduce(source, async_op=True)
        else:
            bucket.work = dist.all_reduce(source, group=bucket.group, async_op=True)

    def _sum_tied_embedding(self) -> None:
        if self.tied_embedding and group_size(self.mesh.embedding) > 1:
            for p in self.tied_embedding:
                dist.all_reduce(p.main_grad if self.main_grads else p.grad, group=self.mesh.embedding)

    @contextlib.contextmanager
    def sync(self, enabled: bool):
        """Within the block, launch reductions as gradients become ready only if `enabled`
        (the last microbatch of a step); earlier microbatches just accumulate locally."""
        previous, self._sync_enabled = self._sync_enabled, enabled
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish(self) -> None:
        """Launch any bucket not yet reduced (in a fixed order on every rank) and wait for all.
        Tied embedding gradients are summed over `mesh.embedding` (before their buckets'
        reduce-scatter with `shard_grads`, after all reductions otherwise). With `shard_grads`
        the full buffers of sharded buckets are then freed: the result is in `bucket.shard`.
        ZeRO-3 unit buckets: those in flight are completed, any still holding gradients (a
        parameter without one) reduced now. First of all, the slices of parameters that got no
        gradient this step are zeroed (first touch, module doc)."""
        self._zero_untouched()
        for bucket in self.buckets:
            if bucket.lazy and bucket.buffer is not None and not bucket.launched:
                self._launch_unit_bucket(bucket)
        self.complete_unit_buckets()
        for bucket in self.buckets:
            if not bucket.deferred and not bucket.lazy:
                self._launch(bucket)
        if self.shard_grads:
            self._sum_tied_embedding()
            for bucket in self.buckets:
                if not bucket.lazy:
                    self._launch(bucket)
        if self.hierarchy is not None:  # every bucket's inter-node stage in flight before any all-gather
            pipeline_stages([bucket.work for bucket in self.buckets])
        for index, bucket in enumerate(self.buckets):
            if bucket.in_shm:  # launched above like every bucket (in_shm excludes deferred and lazy ones)
                shm.all_reduce_in_slots(bucket.buffer, bucket.group)
            if bucket.work is not None:
                op = "reduce_scatter" if self.shard_grads else "all_reduce"
                wait_for(
                    bucket.work,
                    f"{op} of gradient bucket {index + 1}/{len(self.buckets)} over {bucket.key} "
                    f"({bucket.numel * bucket.shard.element_size() / 2**20:.1f} MiB)",
                )
            if bucket.comm is not None:  # compressed: back into the fp32 gradient
                result, target = bucket.comm
                target.copy_(result)
            bucket.work, bucket.ready, bucket.launched, bucket.comm = None, 0, False, None
        if not self.shard_grads:
            self._sum_tied_embedding()
            return
        for bucket in self.buckets:
            if self._sharded(bucket):
                self._free_buffer(bucket)

    def zero_grad(self) -> None:
        """Start a step: every gradient is written by its first backward (first touch, module
        doc), so the buffers are not zeroed and `p.grad` is unset until then; with
        `shard_grads` the buffers freed by `finish()` are re-created (uninitialised but for
        their zero padding). ZeRO-3 unit buckets: the shard is zeroed, the unit buffers come
        with each unit's backward. No communication."""
        self._untouched = {}
        for bucket in self.buckets:
            if bucket.lazy:  # ZeRO-3: the shard accumulates the step; buffers come with the unit's backward
                if bucket.buffer is not None:
                    self._free_buffer(bucket)
                bucket.shard.zero_()
            else:
                if bucket.buffer is None:
                    bucket.buffer = torch.empty(bucket.numel, dtype=bucket.shard.dtype, device=bucket.shard.device)
                    if bucket.padding:
                        bucket.buffer[bucket.numel - bucket.padding :].zero_()
                    self._point_grads(bucket, self.main_grads, unset=True)
                elif not self.main_grads:
                    for p in bucket.params:
                        p.grad = None
                self._untouched.update((id(p), p) for p in bucket.params)
            bucket.ready, bucket.launched, bucket.work = 0, False, None

    def _zero_untouched(self) -> None:
        """Parameters that got no gradient this step: zero their slices (and point `.grad` at them)."""
        for key, p in self._untouched.items():
            view = self._slice_of[key]
            view.zero_()
            if not self.main_grads:
                p.grad = view
        self._untouched = {}

    def grad_bytes(self) -> int:
        """Bytes of gradient storage held now (full buffers still allocated plus shard tensors
        of their own)."""
        total = 0
        for bucket in self.buckets:
            if bucket.buffer is not None:
                total += bucket.buffer.numel() * bucket.buffer.element_size()
            if self._sharded(bucket):
                total += bucket.shard.numel() * bucket.shard.element_size()
        return total

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
