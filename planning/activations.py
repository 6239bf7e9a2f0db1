"""Bytes autograd saves for backward, measured with saved-tensor hooks.

`saved_activation_bytes` measures a real model's forward and loss (the benches and tests use
it). The planner measures without running anything: `trace_layer`, `trace_pre` and
`trace_post` build one transformer block (dense or MoE), the embedding chunk or the final
norm + LM head + loss with the real modules of `models.gpt` and `moe/` on the meta device,
turn their parameters into meta-backed fake tensors labelled with the run's device
(`torch._subclasses.FakeTensorMode`: shapes and dtypes only, nothing allocated, but every
kernel choice is the device's: CPU attention falls back to the math path with dropout, CPU
dropout keeps a float noise tensor) and count the distinct storages packed by
`torch.autograd.graph.saved_tensors_hooks` during one forward, parameters and autocast's
weight copies excluded (the planner counts those as model states). Recompute none /
selective / full is the model's own: the traced block is built with that `ExecutionConfig`. The pieces
are built on a `virtual_mesh` TP rank: its collectives (`mpu.mappings`) allocate outputs of
the real collective's shape without communicating, so a sequence-parallel all-gather gives
the full sequence and a reduce-scatter this rank's shard, as in a run. A trace is cached per
(piece, config, layout, precision, device): a model of L layers costs one trace per layer
kind, whatever L.

What cannot be traced on fake tensors, stated once here:
* MoE dispatch over ep / etp > 1 sizes its buffers from data (the split sizes), so an MoE
  block is traced on the pair path of an ep = etp = 1 mesh with the same tp / sp: under
  balanced routing without capacity drops every (token, choice) pair is one row, as there;
  etp > 1 gathers each row etp times (`etp_row_bytes`). A capacity factor is ignored (no pair
  dropped: the upper bound).
* device="cuda" on a CPU-only host: the CUDA kernels' saved sets are stood in for
  (`_CudaKernels`): flash attention saves q, k, v, the output and the fp32 log-sum-exp;
  dropout a bool mask; the fused RMSNorm its input and fp32 rstd. Autocast is CPU autocast.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.fits import check_model_fits
from meshtron.mpu.mesh import ParallelConfig, virtual_mesh
from meshtron.mpu.random import TENSOR_PARALLEL, get_rng_tracker

__all__ = [
    "saved_activation_bytes",
    "SavedTrace",
    "trace_layer",
    "trace_pre",
    "trace_post",
    "etp_row_bytes",
    "clear_trace_cache",
]


class _SavedStorages:
    """Distinct storages packed for backward (each counted once, `excluded` ones never), by
    the term active when first packed; tensors are kept referenced so no storage id is reused."""

    def __init__(self, excluded: set[int]):
        self.excluded = excluded
        self.term = self.outer = ""
        self.terms: dict[str, int] = {}
        self._seen: set[int] = set()
        self.saved_excluded: set[int] = set()
        self._alive: list[torch.Tensor] = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.excluded:
            self.saved_excluded.add(key)
        elif key not in self._seen:
            self._seen.add(key)
            self._alive.append(t)
            self.terms[self.term] = self.terms.get(self.term, 0) + storage.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @contextlib.contextmanager
    def children_as_terms(self, module: nn.Module):
        """Attribute what each direct child of `module` saves to the child's name; the rest to
        the current term."""
        handles = []
        for name, child in module.named_children():

            def enter(_m, _args, name=name):
                self.outer, self.term = self.term, name

            def leave(_m, _args, _out):
                self.term = self.outer

            handles += [child.register_forward_pre_hook(enter), child.register_forward_hook(leave)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def _storage_ids(tensors) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors}


def saved_activation_bytes(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, **forward_kwargs) -> int:
    """Bytes of the distinct storages autograd saves for backward during one forward and loss
    of a real model (parameters excluded; `forward_kwargs`: a LocalMicrobatch's, e.g. the MTP
    depths' cut inputs under cp); runs the backward afterwards to free them."""
    saved = _SavedStorages(_storage_ids(model.parameters()))
    with saved.hooks():
        # the summed loss, fused with the head per the model's execution
        loss = model(inputs, targets=targets, **forward_kwargs)
        aux = model.aux_loss()
    (loss if aux is None else loss + aux).backward()
    return sum(saved.terms.values())


# --------------------------------------------------------------------------- tracing


@dataclass
class SavedTrace:
    """Saved bytes of one traced piece for one microbatch: `total`, `terms` by submodule (or
    step), `after_mark`: the bytes first saved from the marked point on (a block: from norm2,
    the MLP half), and `shared`: bytes saved by every block of a chunk
    alike (the RoPE tables, one storage per chunk), not in `total`."""

    total: int
    terms: dict[str, int] = field(default_factory=dict)
    after_mark: int = 0
    shared: int = 0


class _WeightCopies(TorchDispatchMode):
    """Records the storages autocast casts parameters into (its 16-bit weight copies)."""

    def __init__(self, params: set[int], copies: set[int]):
        super().__init__()
        self.params, self.copies = params, copies
        self._alive: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage()._cdata in self.params:
            self.copies.add(out.untyped_storage()._cdata)
            self._alive.append(out)
        return out


class _FusedRMSNorm(torch.autograd.Function):
    """Stands in for CUDA's fused RMSNorm: saves its input and the fp32 rstd [..., 1]."""

    @staticmethod
    def forward(ctx, x, weight):
        rstd = x.new_empty(x.shape[:-1] + (1,), dtype=torch.float32)
        ctx.save_for_backward(x, rstd)
        return torch.empty_like(x) if weight is None else torch.empty_like(x) * weight

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a traced stand-in is never differentiated")


class _GroupedMM(torch.autograd.Function):
    """Stands in for CPU `torch._grouped_mm` (torch's meta kernel accepts only bf16): saves both
    operands and the offsets, as the real op does."""

    @staticmethod
    def forward(ctx, x, weight, offs):
        ctx.save_for_backward(x, weight, offs)
        return x.new_empty(x.shape[0], weight.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a traced stand-in is never differentiated")


class _MetaGaps(TorchFunctionMode):
    """Ops whose meta kernel rejects what the CPU kernel runs, replaced by `_GroupedMM`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._grouped_mm:
            return _GroupedMM.apply(args[0], args[1], kwargs.get("offs"))
        return func(*args, **kwargs)


class _CudaKernels(TorchFunctionMode):
    """What CUDA runs where the CPU would not: flash attention (with dropout, GQA native),
    dropout keeping a bool mask, the fused RMSNorm."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            dv = v.shape[-1]
            if dv != q.shape[-1]:  # MLA's narrower v: CUDA's memory-efficient kernel saves the same out + lse
                v = F.pad(v, (0, q.shape[-1] - dv))
            out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q,
                k,
                v,
                kwargs.get("dropout_p", 0.0),
                is_causal=kwargs.get("is_causal", False),
                scale=kwargs.get("scale"),
            )
            return out[..., :dv] if dv != q.shape[-1] else out
        if func is F.dropout:
            x, p, training = (list(args) + [kwargs.get("p", 0.5), kwargs.get("training", True)])[:3]
            return torch.native_dropout(x, p, training)[0] if training and p > 0 else x
        if func is F.rms_norm:
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            return _FusedRMSNorm.apply(args[0], weight)
        return func(*args, **kwargs)


def _fake_module(module: nn.Module, mode: FakeTensorMode) -> set[int]:
    """Replace the meta parameters and buffers of `module` by fake CPU tensors (a tied
    parameter stays one); returns the storage ids of the parameters."""
    fakes: dict[int, nn.Parameter] = {}
    dev = torch.device("cpu")
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                if id(p) not in fakes:
                    fake = nn.Parameter(FakeTensor(mode, p.data, dev), requires_grad=p.requires_grad)
                    fake.__dict__.update(p.__dict__)
                    fakes[id(p)] = fake
                sub._parameters[name] = fakes[id(p)]
        for name, b in sub._buffers.items():
            if b is not None:
                sub._buffers[name] = FakeTensor(mode, b, dev)
    return _storage_ids(fakes.values())


@contextlib.contextmanager
def _traced(module: nn.Module, precision: str, device: str):
    """Fake `module` for `device` and yield (mode, counter): the counter excludes parameters
    and autocast's weight copies; autocast under bf16/fp16 (bf16 stands for both: same sizes);
    a tensor-parallel RNG stream exists for dropout (the caller's RNG state is restored)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    params = _fake_module(module, mode)
    tracker, cpu_rng = get_rng_tracker(), torch.get_rng_state()
    states = tracker.get_states()
    if TENSOR_PARALLEL not in states:
        tracker.add(TENSOR_PARALLEL, 0)
    excluded = set(params)  # grows with each weight copy autocast makes
    copies = _WeightCopies(params, excluded)
    counter = _SavedStorages(excluded)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mode)
            stack.enter_context(copies)
            stack.enter_context(_MetaGaps())
            if device == "cuda":
                stack.enter_context(_CudaKernels())
            if precision != "fp32":
                stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
            yield counter
    finally:
        tracker.set_states(states)
        torch.set_rng_state(cpu_rng)


_CACHE: dict[tuple, SavedTrace] = {}


def _cached(key: tuple, measure) -> SavedTrace:
    if key not in _CACHE:
        _CACHE[key] = measure()
    return _CACHE[key]


def clear_trace_cache() -> None:
    """Forget every cached trace (for a process whose model code changed, e.g. a test's patch)."""
    _CACHE.clear()


def _mesh(cfg: GPTConfig, tp: int, sp: bool, tp_rank: int = 0, cp: int = 1, cp_comm: str = "ring"):
    """TP rank `tp_rank` (cp rank 0) of a tp (x sp) x cp layout without process groups
    (dp = pp = ep = etp = 1); ParallelConfigError when `cfg` does not split over tp and cp.
    The cp group is virtual (size 1 to the collectives): attention runs on this rank's own
    shard only, which saves what context-parallel attention saves (ring: q, k, v, out and the
    log-sum-exp of the shard; a2a with the fused kernel: the same bytes in head shards)."""
    par = ParallelConfig(tp=tp, sp=sp, cp=cp, cp_comm=cp_comm).resolved(tp * cp)
    check_model_fits(par, cfg)
    return virtual_mesh(par, tp * cp, tp_rank)


def _tokens_sp(cfg: GPTConfig, tp: int, sp: bool, cp: int = 1) -> int:
    local = cfg.seq_len // cp
    return local // tp if sp else local


def trace_layer(
    cfg: GPTConfig,
    index: int,
    mode: str,
    *,
    micro_batch_size: int,
    tp: int = 1,
    sp: bool = False,
    precision: str = "fp32",
    device: str = "cpu",
    cp: int = 1,
    cp_comm: str = "ring",
) -> SavedTrace:
    """Saved bytes of block `index` (dense or MoE as `cfg` makes it) under recompute `mode`
    (none | selective | full) for one microbatch on a tp (x sp) x cp rank (seq_len / cp tokens). Terms: norm1, attn,
    norm2, mlp and "block" (the block's own ops: residual dropout masks; its input under full
    recompute); `after_mark` is what the MLP half (from norm2 on) saves."""
    is_moe = cfg.is_moe_layer(index)
    traced_cfg = dataclasses.replace(cfg, **({"capacity_factor": None} if is_moe else {}))
    key = ("layer", repr(traced_cfg), mode, is_moe, micro_batch_size, tp, sp, precision, device, cp, cp_comm)

    def measure() -> SavedTrace:
        from meshtron.models.gpt import Block

        mesh = _mesh(cfg, tp, sp, cp=cp, cp_comm=cp_comm)
        block = Block(traced_cfg, mesh, index, device="meta", execution=ExecutionConfig(recompute=mode))
        block.train()
        with _traced(block, precision, device) as saved:
            x = torch.empty(_tokens_sp(cfg, tp, sp, cp), micro_batch_size, cfg.hidden_size, requires_grad=True)
            return _saved_by_block(block, x, _rope_of(cfg, cp, x.device), saved)

    return _cached(key, measure)


def _rope_of(cfg: GPTConfig, cp: int, device: torch.device) -> tuple:
    """The rotary tables a block of a cp rank receives (seq_len / cp positions); () without RoPE."""
    from meshtron.models.rope import rope_tables

    if cfg.position != "rope":
        return ()
    return rope_tables(cfg.seq_len // cp, cfg.rope_dim, cfg.rope_theta, device, cfg.rope_scaling)


def _saved_by_block(block, x: torch.Tensor, rope: tuple, saved) -> SavedTrace:
    """Run `block` once under the `saved` tracer (its children as terms, the block's own ops
    as "block", the shared rope tables excluded) and split the bytes at norm2."""
    saved.excluded |= _storage_ids(rope)
    saved.term = "block"
    marked = {}

    def mark(_m, _args):
        marked["before"] = sum(saved.terms.values())

    handle = block.norm2.register_forward_pre_hook(mark)
    with saved.hooks(), saved.children_as_terms(block):
        block(x, rope or None)
    handle.remove()
    shared = sum(t.untyped_storage().nbytes() for t in rope if t.untyped_storage()._cdata in saved.saved_excluded)
    total = sum(saved.terms.values())
    # Under full recompute the first pass runs without grad: nothing is saved after norm2.
    after = total - marked.get("before", total)
    return SavedTrace(total, dict(saved.terms), after, shared)


def _trace_end_chunk(
    kind: str,
    cfg: GPTConfig,
    micro_batch_size: int,
    tp: int,
    sp: bool,
    tp_rank: int,
    precision: str,
    device: str,
    run,
    cp: int = 1,
    cp_comm: str = "ring",
    fused_lm_loss: bool = False,
) -> SavedTrace:
    """`run(model, saved)` on a layer-less chunk (kind "pre": embeddings; "post": final norm,
    head and loss, fused or not, and the multi-token prediction depths with the fused loss)
    built on meta for TP rank `tp_rank`; cached per shape."""
    from meshtron.models.gpt import GPT

    def measure() -> SavedTrace:
        model = GPT(
            cfg if kind == "post" and fused_lm_loss else dataclasses.replace(cfg, mtp_depths=0),
            _mesh(cfg, tp, sp, tp_rank, cp, cp_comm),
            device="meta",
            layers=range(0),
            pre_process=kind == "pre",
            post_process=kind == "post",
            execution=ExecutionConfig(fused_lm_loss=fused_lm_loss),
        )
        model.train()
        with _traced(model, precision, device) as saved:
            return run(model, saved)

    key = (kind, repr(cfg), micro_batch_size, tp, sp, tp_rank, precision, device, cp, cp_comm, fused_lm_loss)
    return _cached(key, measure)


def trace_pre(
    cfg: GPTConfig,
    *,
    micro_batch_size: int,
    tp: int = 1,
    sp: bool = False,
    tp_rank: int = 0,
    precision: str = "fp32",
    device: str = "cpu",
    cp: int = 1,
    cp_comm: str = "ring",
) -> SavedTrace:
    """Saved bytes of the embedding step (token ids, positions, dropout) for one microbatch
    (this cp rank's seq_len / cp tokens of each sequence)."""

    def run(model, saved) -> SavedTrace:
        saved.term = "embedding"
        with saved.hooks():
            model(torch.zeros(micro_batch_size, cfg.seq_len // cp, dtype=torch.long))
        return SavedTrace(sum(saved.terms.values()), dict(saved.terms))

    return _trace_end_chunk("pre", cfg, micro_batch_size, tp, sp, tp_rank, precision, device, run, cp, cp_comm)


def trace_post(
    cfg: GPTConfig,
    *,
    micro_batch_size: int,
    tp: int = 1,
    sp: bool = False,
    tp_rank: int = 0,
    precision: str = "fp32",
    device: str = "cpu",
    cp: int = 1,
    cp_comm: str = "ring",
    fused_lm_loss: bool = False,
) -> SavedTrace:
    """Saved bytes of the final norm, LM head and loss for one microbatch on TP rank
    `tp_rank`. Terms: final_norm, head (the head's input) and loss (its softmax, targets and
    masks). With `fused_lm_loss` the head and loss are one step whose saved tensors (the
    precomputed input and weight gradients) are all "loss"."""

    def run(model, saved) -> SavedTrace:
        x = torch.empty(_tokens_sp(cfg, tp, sp, cp), micro_batch_size, cfg.hidden_size, requires_grad=True)
        targets = torch.zeros(micro_batch_size, cfg.seq_len // cp, dtype=torch.long)
        saved.term = "loss" if fused_lm_loss else "head"
        with saved.hooks():
            if fused_lm_loss:  # with the MTP depths (model.mtp_depths): their ids and labels per depth
                depths = (cfg.mtp_depths, *targets.shape)
                inputs, labels = (torch.zeros(depths, dtype=torch.long) for _ in range(2))
                with saved.children_as_terms(model):
                    model(x, targets=targets, mtp_inputs=inputs, mtp_labels=labels)
            else:
                with saved.children_as_terms(model):
                    logits = model(x)
                saved.term = "loss"
                model.loss_per_token(logits, targets)
        return SavedTrace(sum(saved.terms.values()), dict(saved.terms))

    return _trace_end_chunk(
        "post", cfg, micro_batch_size, tp, sp, tp_rank, precision, device, run, cp, cp_comm, fused_lm_loss
    )


def etp_row_bytes(cfg: GPTConfig, *, micro_batch_size: int, tp: int, etp: int, precision: str, cp: int = 1) -> int:
    """Bytes an MoE layer saves beyond its ep = etp = 1 trace when experts are tensor-parallel:
    the dispatched rows are all-gathered over etp, each of the layer's T_l * top_k rows
    (T_l = tokens / tp: the layer's tokens are distinct per TP rank) kept etp times, h
    elements of the activation dtype each. Arithmetic: the gathered sizes are data-dependent."""
    tokens = cfg.seq_len // cp * micro_batch_size
    local = tokens // tp if tp > 1 else tokens
    return (etp - 1) * local * cfg.top_k * cfg.hidden_size * (4 if precision == "fp32" else 2)
