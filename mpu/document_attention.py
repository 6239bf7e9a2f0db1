"""Causal attention restricted to packed documents, without a dense [b, 1, s, s] mask where the
device allows it. No communication: the model's attention core (cp = 1) and the all-to-all
context parallelism (`mpu.context_parallel.ulysses_attention`, which holds the whole sequence
of its heads) call `document_attention` on tensors they hold.

Layout: q [b, h, s, d], k and v [b, hkv, s, d] with h a multiple of hkv (grouped-query), and
`doc_ids` [b, s], the per-token document ids of `mpu.attention_blocks.document_ids`: each
document is one contiguous run of equal ids within its row. A query sees the keys at or before
it in its own document. A sliding window (`window`, `model.sliding_window` when it is shorter
than the sequence, Mistral's) further limits query i to keys i - window < j <= i, as
transformers' sliding-window causal mask; `doc_ids` None then means one document per row (the
model's plain causal attention with a window). Backends (`ATTENTION_BACKENDS`, the setting
`trainer.attention_backend`):

* "dense": the boolean [b, 1, s, s] mask and `F.scaled_dot_product_attention`: what every
  parallel == serial test pins, the only one with attention dropout. O(s^2) memory per layer,
  and on a GPU the mask takes SDPA off its flash kernel.
* "varlen": torch's flash varlen kernel (`torch.nn.attention.varlen.varlen_attn`) on the b*s
  tokens flattened row by row, one segment per document (`document_segments`): CUDA, fp16 or
  bf16, no dropout. O(s) memory.
* "flex": FlexAttention with a block mask (causal and same document), `flex_attention`
  compiled once per process on CUDA; on the CPU it runs eager and has no backward (torch
  raises "FlexAttention does not support backward on CPU"), so there it serves no-grad calls
  only. No dropout.
* "auto": `pick_backend`: varlen on CUDA with 16-bit inputs, flex on CUDA otherwise and
  inside compiled blocks (`trainer.compile`: static shapes), dense on the CPU or with dropout.

With a window: dense and flex add it to their masks; varlen is refused (`pick_backend`, and
`attention_backend_checks` before the run) and auto takes flex where it would take varlen.
Context parallelism (cp > 1) has no window (ring attention's blocks and the all-to-all path
do not mask by distance): refused by `attention_backend_checks` and by the model's build.

The segments (one host sync: the ids are copied to the host) and the block mask are built once
per `doc_ids` tensor and reused while it lives unmodified, so the layers of one forward (and
their recomputation) share them: one host sync per microbatch, not per layer.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange

from meshtron.eager import eager
from meshtron.rules import Check

ATTENTION_BACKENDS = ("auto", "dense", "flex", "varlen")
HALF_DTYPES = (torch.float16, torch.bfloat16)
_HALF_PRECISIONS = ("bf16", "fp16", "fp8", "auto")  # fp8 runs attention in bf16 autocast

# (id(doc_ids), kind, window) -> (weak reference to doc_ids, its version when built, the layout)
_LAYOUTS: dict[tuple[int, str], tuple[weakref.ref, int, object]] = {}


# --------------------------------------------------------------------------- choosing


def backend_problem(
    backend: str,
    device_type: str,
    dtype: torch.dtype,
    dropout_p: float,
    requires_grad: bool,
    window: int | None = None,
) -> str | None:
    """Why `backend` cannot run attention on `device_type` with `dtype` inputs, dropout
    `dropout_p`, (`requires_grad`) a backward to come and sliding window `window`; None when it can."""
    if backend not in ATTENTION_BACKENDS:
        return f"unknown; use one of {', '.join(ATTENTION_BACKENDS)}"
    if backend in ("auto", "dense"):
        return None
    if backend == "varlen" and window is not None:
        return f"has no sliding window (model.sliding_window={window}); use flex, dense or auto"
    if dropout_p > 0:
        return f"has no attention dropout (got {dropout_p}); use dense"
    if backend == "varlen" and device_type != "cuda":
        return f"is torch's flash varlen kernel, CUDA only (got {device_type})"
    if backend == "varlen" and dtype not in HALF_DTYPES:
        return f"needs fp16 or bf16 inputs (got {str(dtype).removeprefix('torch.')})"
    if backend == "varlen" and not varlen_kernel_fits():
        return f"needs torch's varlen_attn with window_size and enable_gqa (torch {torch.__version__} lacks them); use flex"
    if backend == "flex" and device_type != "cuda" and (device_type != "cpu" or requires_grad):
        return f"has no backward on {device_type} (FlexAttention trains on CUDA only)"
    return None


def pick_backend(
    requested: str,
    device_type: str,
    dtype: torch.dtype,
    dropout_p: float,
    requires_grad: bool,
    window: int | None = None,
) -> str:
    """The backend (dense, flex or varlen) that runs a call: auto is varlen on CUDA with fp16/bf16
    inputs and no sliding `window`, flex on CUDA otherwise, dense on other devices or with
    dropout; an explicit choice stays, or raises ValueError with the reason when it cannot run
    there (`backend_problem`)."""
    problem = backend_problem(requested, device_type, dtype, dropout_p, requires_grad, window)
    if problem is not None:
        raise ValueError(f"attention backend {requested!r} {problem}")
    if requested != "auto":
        return requested
    if device_type != "cuda" or dropout_p > 0:
        return "dense"
    if torch.compiler.is_compiling():
        # inside a compiled block (trainer.compile): varlen's segment count changes with every
        # microbatch (a recompile each), flex's block mask keeps its shapes
        return "flex"
    return "varlen" if dtype in HALF_DTYPES and window is None and varlen_kernel_fits() else "flex"


@functools.cache
def varlen_kernel_fits() -> bool:
    """Whether this torch's `varlen_attn` takes what `varlen_document_attention` passes
    (window_size for the causal mask, enable_gqa, scale): torch 2.13's does; older releases
    have other signatures (auto then takes flex)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return {"window_size", "enable_gqa", "scale"} <= inspect.signature(varlen_attn).parameters.keys()


def attention_backend_checks(
    backend: str,
    *,
    device_type: str | None,
    precision: str,
    attention_dropout: float,
    cp: int,
    cp_comm: str,
    sliding_window: int | None = None,
) -> list[Check]:
    """The run rules of `trainer.attention_backend` (device_type None: not known yet, checked
    again once resolved): varlen and flex only where they run and where they are used; a
    `sliding_window` (GPTConfig.attention_window: model.sliding_window < seq_len) not with
    varlen."""
    window = sliding_window_checks(backend, sliding_window, cp, cp_comm)
    if backend not in ("flex", "varlen"):
        return window
    what = f"trainer.attention_backend={backend}"
    return [
        *window,
        (
            attention_dropout == 0,
            f"{what} has no attention dropout (model.attention_dropout or model.dropout gives "
            f"{attention_dropout}); use trainer.attention_backend=dense or model.attention_dropout=0",
        ),
        (
            device_type != "cpu" or backend != "varlen",
            f"{what} is torch's flash varlen kernel, CUDA only; this run computes on the CPU: use "
            "trainer.attention_backend=auto or dense",
        ),
        (
            device_type != "cpu" or backend != "flex",
            f"{what} cannot train on the CPU (FlexAttention has no backward there); use "
            "trainer.attention_backend=auto or dense",
        ),
        (
            backend != "varlen" or precision in _HALF_PRECISIONS,
            f"{what} needs 16-bit attention (trainer.precision=bf16 or fp16, got {precision}); use "
            "trainer.attention_backend=flex or auto",
        ),
        (
            cp == 1 or cp_comm == "a2a",
            f"{what} applies to parallel.cp_comm=a2a (ring attention has its own blockwise kernel); use "
            "parallel.cp_comm=a2a or trainer.attention_backend=auto",
        ),
    ]


def sliding_window_checks(backend: str, sliding_window: int | None, cp: int, cp_comm: str = "a2a") -> list[Check]:
    """A sliding window (None: none, or one >= the sequence) runs at any cp (the all-to-all
    through these backends, the ring in its score tiles), not with the varlen backend."""
    if sliding_window is None:
        return []
    return [
        (
            backend != "varlen",
            f"model.sliding_window={sliding_window} (shorter than model.seq_len) is not in "
            f"trainer.attention_backend=varlen; use auto, flex or dense",
        ),
    ]


# --------------------------------------------------------------------------- attention


def document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor | None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention within documents: q [b, h, s, d], k, v [b, hkv, s, d], `doc_ids` [b, s]
    (None: one document per row) -> out [b, h, s, d] in q's dtype, by `backend`
    (`pick_backend`); `window`: query i sees keys i - window < j <= i only. No communication;
    dropout (dense only) draws from the current RNG (the caller forks the tensor-parallel stream)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    chosen = pick_backend(backend, q.device.type, q.dtype, dropout_p, grad, window)
    if chosen == "varlen":
        return varlen_document_attention(q, k, v, doc_ids, scale=scale)
    if chosen == "flex":
        return flex_document_attention(q, k, v, doc_ids, scale=scale, window=window)
    return dense_document_attention(q, k, v, doc_ids, scale=scale, dropout_p=dropout_p, window=window)


def dense_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor | None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
) -> torch.Tensor:
    """SDPA with the boolean mask [b, 1, s, s] (same document and causal, within `window`; no
    `doc_ids`: [s, s], causal within `window`): bit for bit the model's attention before the
    other backends existed. No communication."""
    if doc_ids is None:
        mask = causal_window_mask(q.shape[2], window, q.device)
    else:
        same = doc_ids[:, :, None] == doc_ids[:, None, :]
        if window is None:
            mask = (same & torch.ones_like(same).tril_())[:, None]
        else:
            mask = (same & causal_window_mask(same.shape[-1], window, same.device))[:, None]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def varlen_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor,
    *,
    scale: float | None = None,
    kernel: Callable | None = None,
) -> torch.Tensor:
    """Causal attention of each document as one segment of `kernel` (torch's `varlen_attn`, or
    `varlen_reference`, same signature) over the b*s tokens flattened row by row. No
    communication; one host sync per `doc_ids` tensor (`document_segments`)."""
    b, h, s, _ = q.shape
    cu_seqlens, longest = document_layout(doc_ids, "varlen")
    if kernel is None:
        from torch.nn.attention.varlen import varlen_attn as kernel
    q_, k_, v_ = (rearrange(t, "b h s d -> (b s) h d") for t in (q, k, v))
    out = kernel(
        q_, k_, v_, cu_seqlens, cu_seqlens, longest, longest,
        scale=scale, window_size=(-1, 0), enable_gqa=h != k.shape[1],
    )  # fmt: skip
    return rearrange(out, "(b s) h d -> b h s d", b=b, s=s)


def flex_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_ids: torch.Tensor | None,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """FlexAttention with the block mask of `document_block_mask` (built once per `doc_ids`
    tensor and window; no `doc_ids`: `window_block_mask`, once per length and window):
    compiled on CUDA, eager elsewhere (the CPU: forward only). No communication."""
    if doc_ids is None:
        block_mask = window_block_mask(q.shape[2], window, q.device)
    else:
        block_mask = document_layout(doc_ids, "flex", window)
    gqa = q.shape[1] != k.shape[1]
    if q.is_cuda:
        return _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # eager is the point off CUDA: no nagging to compile
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


# --------------------------------------------------------------------------- layouts


def document_segments(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Segments of the b*s tokens of `doc_ids` [b, s] flattened row by row: a segment starts at
    each row's first token and wherever the id changes. Returns (cu_seqlens int32 [n + 1] on
    doc_ids' device: 0, the segments' ends; the longest segment's length). One host sync (the
    ids are copied to the host)."""
    ids = doc_ids.detach().cpu()
    starts = torch.ones(ids.shape, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    ends = torch.cat([starts.flatten().nonzero().flatten(), torch.tensor([ids.numel()])])
    longest = int((ends[1:] - ends[:-1]).max())
    return ends.to(torch.int32).to(doc_ids.device), longest


def causal_window_mask(s: int, window: int | None, device) -> torch.Tensor:
    """Boolean [s, s]: query i sees key j iff j <= i and (with a `window`) i - window < j, the
    mask of transformers' sliding-window causal attention (`sliding_window_overlay`)."""
    i = torch.arange(s, device=device)
    behind = i[:, None] - i[None, :]  # query - key
    if window is None:
        return behind >= 0
    return (behind >= 0) & (behind < window)


def document_block_mask(doc_ids: torch.Tensor, window: int | None = None):
    """FlexAttention BlockMask over [b, any head, s, s]: key at or before the query, same
    document (and, with `window`, fewer than `window` tokens behind it)."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = doc_ids.detach().clone()  # the mask's own copy: the cache must not keep doc_ids alive

    def causal_same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    def windowed_same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window) & (docs[b, q_idx] == docs[b, kv_idx])

    rows, s = docs.shape
    mask_mod = causal_same_document if window is None else windowed_same_document
    return create_block_mask(mask_mod, rows, None, s, s, device=docs.device)


@eager  # host work on a cache: stays out of compiled graphs
@functools.lru_cache(maxsize=16)
def window_block_mask(s: int, window: int, device):
    """FlexAttention BlockMask over [any row, any head, s, s]: causal within `window` (query i
    sees keys i - window < j <= i), built once per (s, window, device)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return create_block_mask(causal_window, None, None, s, s, device=device)


_BUILDERS = {"varlen": lambda doc_ids, window: document_segments(doc_ids), "flex": document_block_mask}


@eager  # host work on a cache: stays out of compiled graphs
def document_layout(doc_ids: torch.Tensor, kind: str, window: int | None = None):
    """`document_segments` (kind "varlen") or `document_block_mask` ("flex", with `window`) of
    `doc_ids`, built once per tensor (and window) and reused while it lives unmodified (every
    layer of a forward passes the same tensor). No communication."""
    if doc_ids.is_inference():  # no version counter to trust: build each time
        return _BUILDERS[kind](doc_ids, window)
    key = (id(doc_ids), kind, window)
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0]() is doc_ids and hit[1] == doc_ids._version:
        return hit[2]
    layout = _BUILDERS[kind](doc_ids, window)
    _LAYOUTS[key] = (weakref.ref(doc_ids, lambda _, key=key: _LAYOUTS.pop(key, None)), doc_ids._version, layout)
    return layout


# --------------------------------------------------------------------------- reference


def varlen_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Plain-torch `varlen_attn` (same signature, full or causal windows): segment i is rows
    cu_seq_q[i]:cu_seq_q[i+1] of query [T, h, d] against rows cu_seq_k[i]:cu_seq_k[i+1] of key
    and value [T, hkv, d], through SDPA. Raises ValueError when the arguments break what the
    kernel assumes (int32 offsets from 0 to T, non-empty segments, none longer than max_q/max_k)."""
    if tuple(window_size) not in ((-1, -1), (-1, 0)):
        raise ValueError(f"window_size={window_size}: the reference has full (-1, -1) and causal (-1, 0) only")
    _check_offsets(cu_seq_q, query.shape[0], max_q, "q")
    _check_offsets(cu_seq_k, key.shape[0], max_k, "k")
    outs = []
    for (q0, q1), (k0, k1) in zip(_pairs(cu_seq_q), _pairs(cu_seq_k)):
        q, k, v = (
            rearrange(t[a:b], "s h d -> 1 h s d") for t, a, b in ((query, q0, q1), (key, k0, k1), (value, k0, k1))
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=window_size[1] == 0, scale=scale, enable_gqa=enable_gqa)
        outs.append(rearrange(out, "1 h s d -> s h d"))
    return torch.cat(outs)


def _pairs(cu: torch.Tensor) -> list[tuple[int, int]]:
    ends = cu.tolist()
    return list(zip(ends[:-1], ends[1:]))


def _check_offsets(cu: torch.Tensor, total: int, longest: int, which: str) -> None:
    lengths = [b - a for a, b in _pairs(cu)]
    problems = [
        (cu.dtype == torch.int32, f"cu_seq_{which} is {cu.dtype}, not int32"),
        (cu.dim() == 1 and cu.numel() >= 2 and int(cu[0]) == 0, f"cu_seq_{which} must start at 0"),
        (int(cu[-1]) == total, f"cu_seq_{which} ends at {int(cu[-1])}, not the token count {total}"),
        (all(n > 0 for n in lengths), f"cu_seq_{which} has empty or backward segments"),
        (max(lengths, default=0) <= longest, f"max_{which}={longest} is below the longest segment {max(lengths)}"),
    ]
    message = next((m for ok, m in problems if not ok), None)
    if message is not None:
        raise ValueError(message)
