"""ZeRO-3: parameters sharded over their replica group, gathered per unit just before use.

Design (optim.zero=3):
  * Units are the groups of parameters gathered together (`unit_of`): the embedding with
    the learned positions ("embed"), each transformer block ("layers.<i>"), and the final
    norm with the untied LM head ("head"). The gradient reducer closes a bucket wherever the
    unit changes (`bucket_layout(unit_of=...)`), so each unit owns whole buckets, and runs with
    `shard_grads=True` (ZeRO-2's reduce-scatter into `bucket.shard`).
  * Each bucket's parameters stay views into one flat buffer (`bucket.param_buffer`,
    laid out like the gradient bucket), but while a unit is sharded that buffer's *storage* is
    resized to zero bytes: this rank keeps only `bucket.param_shard` (its
    `[rank*size, (rank+1)*size)` range, own storage), which `ShardedAdamW` updates in place and
    never all-gathers. Gathering re-allocates the storage and all-gathers the shards into it
    over the bucket's replica group (dp, tp_dp for sequence-parallel replicated parameters,
    edp for experts). Because parameters and the tensors autograd saved from them (weight
    views such as `w.t()`) all point at that one storage, freeing it releases the memory
    and re-gathering before backward makes the saved tensors valid again (as FSDP1 does).
    Buckets whose group has one member are never freed.
  * Forward: a unit's pre-hook waits for its gather (or issues it), releases the embedding
    unit once the first block starts, and issues the next unit's gather asynchronously
    (prefetch); its post-hook frees it. Backward: the unit's output passes through an
    identity autograd function whose backward gathers the unit again (and prefetches the
    unit before it) before any of the unit's backward runs; its input passes through one
    whose backward frees it once its backward is done. Gradient buffers follow the units too:
    the reducer (`unit_buffers()`) keeps a bucket's full buffer only from its unit's backward
    until its reduce-scatter (dp/grad_reduce.py). A callback queued on the autograd
    engine frees whatever is still gathered when backward ends. The embedding's backward
    needs no weight values (only indices), so it is not gathered again.
  * Tied embeddings (GPT-2: the head multiplies by the embedding weight): the head unit
    gathers the embedding's buckets too, so the weight is gathered for the embedding lookup
    and again for the head's forward and backward.
  * Recompute (trainer.recompute=full|selective) replays a block inside its backward, i.e.
    after its output-side gather: the replay sees gathered weights.
  * 16-bit weight copies (kernels/operands.py `weight_copy_scope`) of a unit are dropped when
    the unit is freed (`on_free`), so the cache never keeps full copies of freed weights alive.
  * Peak parameter memory: the shards plus at most two units gathered (the one running and
    the prefetched one; the head counts with the tied embedding). Peak gradient memory: about
    two units' buckets in full (plus a tied embedding's, from the head's backward to the end).
    planning/plan.py (`zero3_gathered_bytes`, `zero3_grad_buffer_bytes`) computes both.
  * Ordering: a MoE router's aux-loss path reaches its weights without passing through the
    block's output; it still runs after the block's output-side gather because the autograd
    engine runs ready nodes in decreasing creation order and the gather node was created after
    every node of the block.
  * Not covered: under bf16/fp16 autocast (torch kernels) autocast's own 16-bit weight casts are
    saved by the matmuls until backward, 2 bytes per weight of the whole model (the planner's
    `autocast_weight_copies`), whatever the sharding.
  * Sharp edge: between uses a parameter (and any view of it) points at zero bytes of
    storage; reading it outside its unit's forward/backward reads freed memory. Code that
    needs the weights between steps (checkpoints, checks) opens `gathered()` and copies
    what it keeps beyond the block.
Pipeline parallelism: one `Zero3` per model chunk (each gathers its own units; the last
stage's copy of a tied embedding is gathered with its head; tied-embedding buckets keep
ZeRO-2's full gradient buffers because they are summed over the stages first). Offload:
`OffloadedAdamW(zero=3)` copies its updated shard into `bucket.param_shard`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from meshtron.dp.buckets import cast_bucket_params, flatten_bucket_params
from meshtron.mpu.mappings import all_gather_into
from meshtron.mpu.mesh import group_size
from meshtron.mpu.waits import wait_for


def unit_of(name: str) -> str:
    """The ZeRO-3 unit of a GPT parameter name: "layers.<i>", "embed" (token and learned
    position embeddings) or "head" (final norm, untied LM head)."""
    parts = name.split(".")
    if parts[0] == "layers":
        return f"layers.{parts[1]}"
    if parts[0] in ("embed", "pos_embed"):
        return "embed"
    return "head"


@dataclass
class _Slot:
    """One bucket's parameters: the flat full buffer and this rank's shard of it."""

    bucket: object
    full: torch.Tensor
    shard: torch.Tensor
    start: int
    nbytes: int
    sharded: bool  # more than one replica: the full storage is freed between uses
    params: list = field(default_factory=list)
    gathered: bool = True
    work: object = None


@dataclass
class _Unit:
    name: str
    slots: list  # the buckets this unit owns
    gathers: list  # the buckets gathered for its forward/backward (own + tied embedding)
    backward: bool = True  # gathered again for backward


class Zero3:
    """Shards the parameters of `model` (one GPT model chunk) over the replica groups of `reducer`'s
    buckets and gathers them per unit around forward and backward (module doc). The reducer
    must have been built with `unit_of` and `shard_grads=True`. Communicates over each
    bucket's replica group. `on_free(params)` runs when a unit's full weights are freed
    (training passes `kernels.operands.forget_weight_copies`).
    `param_dtype` (16-bit resident weights, dp/resident.py): the buffers and shards are cast to
    it; each bucket's fp32 shard values are kept as `bucket.main_init` for the optimizer's
    main weights (which takes and drops them)."""

    def __init__(self, model: nn.Module, reducer, *, on_free=None, param_dtype: torch.dtype | None = None):
        if not reducer.shard_grads:
            raise ValueError("ZeRO-3 needs a reducer built with shard_grads=True (reduce-scattered gradients)")
        self.model = model
        self.reducer = reducer
        self.on_free = on_free
        names = {id(p): n for n, p in model.named_parameters()}
        self.slots: list[_Slot] = []
        by_unit: dict[str, list[_Slot]] = {}
        for bucket in reducer.buckets:
            if id(bucket.params[0]) not in names:
                continue  # another model chunk's bucket (pipeline parallelism: one Zero3 per chunk)
            units = {unit_of(names.get(id(p), "?")) for p in bucket.params}
            if len(units) != 1:
                raise ValueError(f"gradient bucket spans ZeRO-3 units {sorted(units)}: build the reducer with unit_of")
            slot = self._shard(bucket, param_dtype)
            self.slots.append(slot)
            by_unit.setdefault(units.pop(), []).append(slot)
        self.units: list[_Unit] = []
        order = ["embed"] + [f"layers.{i}" for i in model.layers] + ["head"]
        for name in order:
            gathers = list(by_unit.get(name, []))
            if name == "head" and model.post_process and model.head is None and model.embed is not None:
                gathers += by_unit.get("embed", [])  # tied: the head multiplies by the embedding weight
            self.units.append(_Unit(name, by_unit.get(name, []), gathers, backward=name != "embed"))
        self._index = {u.name: i for i, u in enumerate(self.units)}
        self._active: set[str] = set()
        self._release_next: list[_Unit] = []
        self._callback_queued = False
        self._gather_depth = 0
        self.peak_gathered = 0  # most bytes of full buffers allocated at once (`reset_peak`)
        # Units acquired (forward and backward) and those whose gathers were already issued
        # by a prefetch when they were needed.
        self.acquired = self.prefetched = 0
        self._hooks = []
        self._install_hooks()
        for slot in self.slots:
            self._free(slot)
        reducer.unit_buffers()  # gradient buffers only during each unit's backward
        model._zero3 = self

    # ---- sharding -------------------------------------------------------------------------
    @staticmethod
    def _shard(bucket, param_dtype: torch.dtype | None = None) -> _Slot:
        """Flatten the bucket's parameters into `bucket.param_buffer` (cast to `param_dtype`,
        the fp32 range kept as `bucket.main_init`) and keep this rank's range of it as
        `bucket.param_shard` (own storage when the group has > 1 member)."""
        flat = flatten_bucket_params(bucket)
        start, size = bucket.shard_start, bucket.shard.numel()
        if param_dtype is not None:
            bucket.main_init = flat[start : start + size].clone()
            flat = cast_bucket_params(bucket, param_dtype)
        sharded = group_size(bucket.group) > 1
        shard = flat[start : start + size].clone() if sharded else flat[start : start + size]
        bucket.param_shard = shard
        return _Slot(bucket, flat, shard, start, flat.untyped_storage().nbytes(), sharded, list(bucket.params))

    def _start_gather(self, slot: _Slot) -> None:
        if slot.gathered or slot.work is not None:
            return
        slot.full.untyped_storage().resize_(slot.nbytes)
        if slot.sharded:
            self.peak_gathered = max(self.peak_gathered, self.gathered_bytes())
        # The collective writes into storage that autograd's saved weight views share; the
        # values written are the ones they were saved with, so their version must not change.
        with torch.autograd._unsafe_preserve_version_counter(slot.full):
            slot.work = all_gather_into(slot.full, slot.shard, slot.bucket.group, async_op=True)
        if slot.work is None:
            slot.gathered = True

    def _wait(self, slot: _Slot) -> None:
        if slot.work is not None:
            wait_for(
                slot.work, f"ZeRO-3 all-gather of a {slot.bucket.key} parameter bucket ({slot.nbytes / 2**20:.1f} MiB)"
            )
            slot.work = None
            slot.gathered = True

    def _free(self, slot: _Slot) -> None:
        if not slot.sharded:
            return
        self._wait(slot)
        if slot.gathered:
            if self.on_free is not None:
                self.on_free(slot.params)
            slot.full.untyped_storage().resize_(0)
            slot.gathered = False

    # ---- unit life cycle ------------------------------------------------------------------
    def acquire(self, unit: _Unit) -> None:
        """Gather every bucket `unit` uses (waiting for a prefetch already issued)."""
        sharded = [slot for slot in unit.gathers if slot.sharded]
        if sharded and unit.name not in self._active and not self._gather_depth:
            self.acquired += 1
            self.prefetched += all(slot.work is not None for slot in sharded)
        for slot in unit.gathers:
            self._start_gather(slot)
        for slot in unit.gathers:
            self._wait(slot)
        self._active.add(unit.name)

    def prefetch(self, unit: _Unit | None) -> None:
        """Issue the all-gathers of `unit` without waiting for them."""
        if unit is not None:
            for slot in unit.gathers:
                self._start_gather(slot)

    def release(self, unit: _Unit) -> None:
        """Free the buckets of `unit` that no other active unit uses (none while a
        `gathered()` block is open)."""
        self._active.discard(unit.name)
        if self._gather_depth:
            return
        in_use = {id(s) for u in self.units if u.name in self._active for s in u.gathers}
        for slot in unit.gathers:
            if id(slot) not in in_use:
                self._free(slot)

    def release_all(self) -> None:
        """Free every sharded bucket (waiting for gathers in flight)."""
        self._active.clear()
        self._release_next = []
        if self._gather_depth:
            return
        for slot in self.slots:
            self._free(slot)

    def _neighbour(self, unit: _Unit, step: int, backward: bool = False) -> _Unit | None:
        i = self._index[unit.name] + step
        while 0 <= i < len(self.units):
            if self.units[i].gathers and (self.units[i].backward or not backward):
                return self.units[i]
            i += step
        return None

    # ---- hooks ----------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        model = self.model
        unit = {u.name: u for u in self.units}
        if model.embed is not None and model.pre_process:
            self._hooks.append(
                model.embed.register_forward_pre_hook(
                    lambda m, args: self._pre_forward(unit["embed"], args, release_at_next=True)
                )
            )
        for i, block in model.layers.items():
            u = unit[f"layers.{i}"]
            self._hooks.append(block.register_forward_pre_hook(lambda m, args, u=u: self._pre_forward(u, args)))
            self._hooks.append(block.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u, out)))
        if model.final_norm is not None:
            u = unit["head"]
            self._hooks.append(model.final_norm.register_forward_pre_hook(lambda m, args: self._pre_forward(u, args)))
            self._hooks.append(model.register_forward_hook(lambda m, args, out: self._post_forward(u, out)))

    def _pre_forward(self, unit: _Unit, args: tuple, release_at_next: bool = False) -> tuple:
        for previous in self._release_next:
            self.release(previous)
        self._release_next = [unit] if release_at_next else []
        self.acquire(unit)
        self.prefetch(self._neighbour(unit, +1))
        if unit.backward and torch.is_grad_enabled() and torch.is_tensor(args[0]) and args[0].requires_grad:
            # Backward of the unit's input: the unit's backward is done.
            args = (_BackwardHook.apply(lambda: self._post_backward(unit), args[0]),) + tuple(args[1:])
        return args

    def _post_forward(self, unit: _Unit, out):
        for previous in self._release_next:
            self.release(previous)
        self._release_next = []
        self.release(unit)
        if unit.backward and torch.is_tensor(out) and out.requires_grad:
            out = _BackwardHook.apply(lambda: self._pre_backward(unit), out)
        return out

    def _pre_backward(self, unit: _Unit) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self.acquire(unit)
        self.reducer.ensure_buffers([slot.bucket for slot in unit.gathers])
        self.prefetch(self._neighbour(unit, -1, backward=True))

    def _post_backward(self, unit: _Unit) -> None:
        self.release(unit)
        # The embedding is not gathered for backward (it needs no weight values), but its
        # gradients arrive next: their buffers are allocated here, after the first block's backward.
        previous = self._neighbour(unit, -1)
        if previous is not None and not previous.backward:
            self.reducer.ensure_buffers([slot.bucket for slot in previous.slots])

    def _end_backward(self) -> None:
        self._callback_queued = False
        self.release_all()
        # The last gradient buckets of this backward: summed into their shards and freed now,
        # not when the next microbatch's backward launches its first one.
        self.reducer.complete_unit_buckets()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # ---- accounting -----------------------------------------------------------------------
    def gathered_bytes(self) -> int:
        """Bytes of full parameter buffers allocated now beyond the shards (sharded buckets only)."""
        return sum(s.full.untyped_storage().nbytes() for s in self.slots if s.sharded)

    def reset_peak(self) -> None:
        self.peak_gathered = self.gathered_bytes()

    def shard_bytes(self) -> int:
        """Bytes of parameter storage this rank keeps between uses: the shards of sharded
        buckets and the full buffers of unsharded ones."""
        return sum(s.shard.numel() * s.shard.element_size() if s.sharded else s.nbytes for s in self.slots)

    def unit_bytes(self) -> dict[str, int]:
        """Full (gathered) bytes of each unit's sharded buckets."""
        return {u.name: sum(s.nbytes for s in u.gathers if s.sharded) for u in self.units}


class _BackwardHook(torch.autograd.Function):
    """Identity whose backward calls `fn()` before passing the gradient on."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.fn()
        return None, grad


def sharders(chunks) -> list[Zero3]:
    """The `Zero3` sharders of `chunks` (empty when they are not ZeRO-3 sharded)."""
    return [c._zero3 for c in chunks if getattr(c, "_zero3", None) is not None]


@contextlib.contextmanager
def gathered(chunks):
    """Every parameter of `chunks` materialised in full (this rank's TP/EP shard) inside the
    block, e.g. to save or load a checkpoint; on exit this rank's range of each buffer is
    copied back into its shard (so weights loaded inside take effect) and the buffers are
    freed. Nested blocks share the outer one. All-gathers over each bucket's replica group;
    no-op for models that are not ZeRO-3 sharded."""
    owners = sharders(chunks if isinstance(chunks, (list, tuple, nn.ModuleList)) else [chunks])
    outer = [z for z in owners if z._gather_depth == 0]
    for z in owners:
        z._gather_depth += 1
    try:
        for z in outer:
            for slot in z.slots:
                z._start_gather(slot)
            for slot in z.slots:
                z._wait(slot)
        yield
    finally:
        for z in owners:
            z._gather_depth -= 1
        for z in outer:
            with torch.no_grad():
                for slot in z.slots:
                    if slot.sharded:
                        slot.shard.copy_(slot.full[slot.start : slot.start + slot.shard.numel()])
            z.release_all()
