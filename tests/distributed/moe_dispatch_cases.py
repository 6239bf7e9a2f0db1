"""The deduplicated, asynchronous MoE dispatcher against the pair-per-row reference.

Each case builds one MoE layer on an expert layout (ep, etp folded over dp; tp = 1 but in
`overlap_order_async_tp2_sp`), feeds
every rank its own tokens, and runs the layer twice from the same weights: with its own
dispatcher (one row per (token, destination ep rank), combine weights sent with the rows,
asynchronous all-to-alls overlapped with the shared experts) and with `PairDispatcher`, the
previous implementation (one row per (token, choice) pair, blocking all-to-alls, weights
applied on the source rank). Output and every gradient (input, router through the combine
weights, experts, shared experts) agree to 1e-6; the rows sent equal the distinct (token,
destination) pairs, fewer than the reference's pairs. Over gloo the exchanges complete where
they start (shared memory, mpu.mappings.async_exchanges); `overlap_order_async` and
`dedup_ep2_etp2_top2_capacity_async` force them asynchronous, as NCCL runs them: the shared
experts then run while the all-to-alls are in flight, forward and backward, with results
bit-identical to the blocking exchanges (`overlap_order` checks gloo's default);
`overlap_order_async_tp2_sp` does the same with the shared experts tensor-parallel at tp=2
(SP), their tp collectives issued while the ep all-to-alls fly.
`shared_experts_checkpoint_reshard` checks the tensor-parallel shared experts' layout tags
through a checkpoint saved at tp=2 (SP) and loaded at tp=1, 4 and 2 (no SP).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

import meshtron.moe.dispatcher as dispatcher_module
import meshtron.mpu.mappings as mappings
from meshtron.models.config import GPTConfig
from meshtron.moe.layer import MoELayer
from meshtron.mpu.init import initialize_parameters
from meshtron.mpu.mappings import all_gather_stats, all_to_all, all_to_all_stats, gather_rows, reduce_scatter_rows
from meshtron.mpu.mesh import ParallelConfig, build_mesh
from tests.distributed.dense_cases import assert_close

RTOL = 1e-6


@dataclasses.dataclass
class _PairState:
    tokens: torch.Tensor
    pair_order: torch.Tensor
    pair_token: torch.Tensor
    pair_weight: torch.Tensor
    regroup: torch.Tensor | None
    input_splits: list
    output_splits: list
    etp_sizes: list
    out: torch.Tensor | None = None


class PairDispatcher:
    """The pair-per-row dispatcher this repository had before deduplication (blocking
    all-to-alls; every (token, choice) pair is its own row), behind the same four steps."""

    def __init__(self, num_experts: int, mesh):
        self.mesh, self.num_experts = mesh, num_experts
        self.ep, self.etp = mesh.par.ep, mesh.par.etp
        self.rows = True  # communicates (ep or etp > 1), as AllToAllDispatcher's row path
        self.num_local = num_experts // self.ep
        self.last_send_splits: list[int] = []

    def dispatch(self, tokens, pair_expert, pair_weight, keep=None):
        k = pair_expert.numel() // tokens.shape[0]  # pairs are token-major: pair i is a choice of token i // k
        pair_token = torch.arange(tokens.shape[0]).repeat_interleave(k)
        if keep is not None:
            pair_expert, pair_token, pair_weight = pair_expert[keep], pair_token[keep], pair_weight[keep]
        order = torch.argsort(pair_expert, stable=True)
        pair_token = pair_token[order]
        counts = torch.bincount(pair_expert, minlength=self.num_experts)
        rows = tokens.index_select(0, pair_token)
        input_splits = output_splits = etp_sizes = []
        by_block = counts.view(1, self.num_experts)
        if self.ep > 1:
            by_block = all_to_all_stats(counts.view(self.ep, self.num_local), self.mesh.ep)
            input_splits = counts.view(self.ep, self.num_local).sum(1).tolist()
            output_splits = by_block.sum(1).tolist()
            rows = all_to_all(rows, output_splits, input_splits, self.mesh.ep)
        self.last_send_splits = list(input_splits)
        if self.etp > 1:
            gathered = all_gather_stats(by_block, self.mesh.etp)
            etp_sizes = gathered.sum((1, 2)).tolist()
            rows = gather_rows(rows, etp_sizes, self.mesh.etp)
            by_block = gathered.reshape(-1, self.num_local)
        regroup = None
        if by_block.shape[0] > 1:
            block_expert = torch.arange(self.num_local).repeat(by_block.shape[0])
            row_expert = torch.repeat_interleave(block_expert, by_block.flatten(), output_size=rows.shape[0])
            regroup = torch.argsort(row_expert, stable=True)
            rows = rows.index_select(0, regroup)
        state = _PairState(tokens, order, pair_token, pair_weight, regroup, input_splits, output_splits, etp_sizes)
        state.rows, state.group_sizes = rows, by_block.sum(0)
        return state

    def dispatch_chunks(self, chunks):
        return [self.dispatch(*chunk) for chunk in chunks]

    def receive(self, state):
        return state.rows, state.group_sizes

    def combine(self, rows, state):
        if state.regroup is not None:
            inverse = torch.empty_like(state.regroup)
            inverse[state.regroup] = torch.arange(state.regroup.numel())
            rows = rows.index_select(0, inverse)
        if self.etp > 1:
            rows = reduce_scatter_rows(rows, state.etp_sizes, self.mesh.etp)
        if self.ep > 1:
            rows = all_to_all(rows, state.input_splits, state.output_splits, self.mesh.ep)
        weights = state.pair_weight[state.pair_order].unsqueeze(-1)
        state.out = torch.zeros_like(state.tokens).index_add(0, state.pair_token, (rows * weights).to(rows.dtype))
        return state

    def finish(self, state):
        return state.out


def _config(top_k: int, capacity_factor, shared: int, activation: str = "swiglu") -> GPTConfig:
    return GPTConfig(
        arch="llama" if activation == "swiglu" else "gpt2",
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        num_experts=8,
        top_k=top_k,
        moe_ffn_hidden_size=24,
        shared_experts=shared,
        capacity_factor=capacity_factor,
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
        seq_len=16,
    )


def _layer(cfg: GPTConfig, mesh, dispatch_chunks: int = 1) -> MoELayer:
    layer = MoELayer(cfg.moe(), mesh, dispatch_chunks=dispatch_chunks)
    initialize_parameters(layer, 11, mesh)
    return layer


def _inputs(cfg: GPTConfig, mesh):
    gen = torch.Generator().manual_seed(100 + mesh.rank)
    x = torch.randn(cfg.seq_len, 2, cfg.hidden_size, generator=gen)
    return x, torch.randn(x.shape, generator=gen)


def check_dispatch(ep: int, etp: int, top_k: int, capacity_factor, shared: int, activation: str = "swiglu") -> None:
    cfg = _config(top_k, capacity_factor, shared, activation)
    mesh = build_mesh(ParallelConfig(ep=ep, etp=etp), cfg)
    layer, reference = _layer(cfg, mesh), _layer(cfg, mesh)  # same seed: same weights
    reference.dispatcher = PairDispatcher(cfg.num_experts, mesh)
    x, grad = _inputs(cfg, mesh)
    results = {}
    for name, model in (("dedup", layer), ("pairs", reference)):
        xi = x.clone().requires_grad_()
        out = model(xi)
        (out * grad).sum().backward()
        results[name] = (
            out.detach(),
            xi.grad,
            {n: p.grad for n, p in model.named_parameters()},
            list(model.dispatcher.last_send_splits),
            model.last_router.topk_idx,
        )
    (out, gx, grads, sent, idx), (ref_out, ref_gx, ref_grads, ref_sent, ref_idx) = results["dedup"], results["pairs"]
    assert torch.equal(idx, ref_idx), "the routing differs between the two runs"
    assert_close("output", out, ref_out, RTOL)
    assert_close("input gradient", gx, ref_gx, RTOL)
    assert ref_grads["router.weight"].abs().sum() > 0
    for name, g in ref_grads.items():
        assert_close(f"gradient of {name}", grads[name], g, RTOL)

    # Rows sent: one per distinct (token, destination) among the kept pairs.
    kept = torch.ones(idx.numel(), dtype=torch.bool)
    if capacity_factor is not None:
        from meshtron.moe.capacity import capacity_for, capacity_keep_mask

        s = cfg.seq_len
        kept = capacity_keep_mask(
            idx.view(s, -1, top_k), cfg.num_experts, capacity_for(s, cfg.num_experts, top_k, capacity_factor), None
        ).reshape(-1)
        assert not kept.all(), "the case should drop something"
    flat = idx.reshape(-1)
    token = torch.arange(flat.numel()) // top_k
    dest = flat // (cfg.num_experts // ep)
    want = [len({int(t) for t, d, k in zip(token, dest, kept) if k and d == r}) for r in range(ep)]
    if sent != want:
        raise AssertionError(f"rows sent per ep rank {sent}, distinct (token, destination) pairs {want}")
    if sum(ref_sent) != int(kept.sum()):
        raise AssertionError(f"reference sent {sum(ref_sent)} rows for {int(kept.sum())} kept pairs")
    # Over every rank (one rank's 32 tokens may, by the draw, never pick two experts of one rank).
    totals = torch.tensor([float(sum(sent)), float(sum(ref_sent))])
    torch.distributed.all_reduce(totals)
    if top_k > 1 and not totals[0] < totals[1]:
        raise AssertionError(f"deduplication saved nothing: {int(totals[0])} rows vs {int(totals[1])} pairs")


def dedup_ep2_top2() -> None:
    check_dispatch(ep=2, etp=1, top_k=2, capacity_factor=None, shared=1)


def dedup_ep2_top3_capacity_gelu() -> None:
    check_dispatch(ep=2, etp=1, top_k=3, capacity_factor=0.75, shared=0, activation="gelu")


def dedup_ep4_top2() -> None:
    check_dispatch(ep=4, etp=1, top_k=2, capacity_factor=None, shared=1)


def dedup_ep2_etp2_top2_capacity() -> None:
    check_dispatch(ep=2, etp=2, top_k=2, capacity_factor=1.0, shared=1)


def dedup_ep2_etp2_top2_capacity_async() -> None:
    """`dedup_ep2_etp2_top2_capacity` with the asynchronous exchanges NCCL gets, forced on gloo."""
    with forced_exchanges(True):
        check_dispatch(ep=2, etp=2, top_k=2, capacity_factor=1.0, shared=1)


def dedup_ep4_etp2_top2() -> None:
    check_dispatch(ep=4, etp=2, top_k=2, capacity_factor=None, shared=1)


def dedup_ep4_etp2_top3_capacity() -> None:
    check_dispatch(ep=4, etp=2, top_k=3, capacity_factor=1.0, shared=0, activation="gelu")


@contextlib.contextmanager
def forced_exchanges(asynchronous: bool | None):
    """Run the block with mpu.mappings.ASYNC_EXCHANGES set to `asynchronous` (None: by transport)."""
    default = mappings.ASYNC_EXCHANGES
    mappings.ASYNC_EXCHANGES = asynchronous
    try:
        yield
    finally:
        mappings.ASYNC_EXCHANGES = default


def overlap_order() -> None:
    """gloo's default (mpu.mappings.async_exchanges: by transport): every all-to-all completes
    where it starts, through shared memory, so nothing is in flight when the shared experts'
    halves or their gradients are computed."""
    assert mappings.ASYNC_EXCHANGES is None  # by transport
    mesh = build_mesh(ParallelConfig(ep=torch.distributed.get_world_size()), _config(2, None, 1))
    if mappings.async_exchanges(mesh.ep):
        raise AssertionError("all-to-alls over gloo on one host should complete at once (shared memory)")
    _overlap_order(asynchronous=None)


def overlap_order_async() -> None:
    """With asynchronous exchanges (what NCCL gets; forced here on gloo) the shared experts'
    up/gate half runs between the dispatch all-to-all's start and wait, the down half between
    the combine's, and in backward their gradients while the gradients' all-to-alls are in
    flight; the output and every gradient equal the blocking run's bit for bit."""
    _compare_overlapped_with_blocking(tp=1)


def overlap_order_async_tp2_sp() -> None:
    """`overlap_order_async` at tp=2 with SP (ep = world / 2): the tensor-parallel shared
    experts' all-gather and reduce-scatter over tp, and their backward, run while the ep
    all-to-alls are in flight, as NCCL runs them; results bit-identical to blocking."""
    _compare_overlapped_with_blocking(tp=2)


def _compare_overlapped_with_blocking(tp: int) -> None:
    blocking = _overlap_order(asynchronous=None, tp=tp)  # the gloo default: blocking, through shared memory
    overlapped = _overlap_order(asynchronous=True, tp=tp)
    for name, want in blocking.items():
        if not torch.equal(overlapped[name], want):
            raise AssertionError(f"{name} differs between blocking and asynchronous exchanges")


def _overlap_order(asynchronous: bool | None, tp: int = 1) -> dict[str, torch.Tensor]:
    """One forward + backward of an MoE layer with a shared expert (tp-parallel with SP when
    tp > 1, ep = world / tp), recording for each shared half whether the all-to-all it should
    overlap is in flight; returns the output and gradients."""
    world = torch.distributed.get_world_size()
    cfg = _config(2, None, 1)
    mesh = build_mesh(ParallelConfig(tp=tp, sp=tp > 1, ep=world // tp), cfg)
    layer = _layer(cfg, mesh)
    handles, events = [], []
    start = dispatcher_module.all_to_all_start

    def recording_start(*args, **kwargs):
        result = start(*args, **kwargs)
        handles.append(result[1])
        return result

    def in_flight(i: int) -> bool:
        return bool(handles[i].works) if len(handles) > i else False

    hidden, output = layer.shared.hidden, layer.shared.output

    def shared_hidden(*args):
        events.append(("forward up/gate", in_flight(0)))
        return hidden(*args)

    def shared_output(*args):
        events.append(("forward down", in_flight(1)))
        return output(*args)

    dispatcher_module.all_to_all_start = recording_start
    layer.shared.hidden, layer.shared.output = shared_hidden, shared_output
    layer.shared.up.register_hook(lambda g: events.append(("backward up", bool(handles[0].grad_works))))
    layer.shared.down.register_hook(lambda g: events.append(("backward down", bool(handles[1].grad_works))))
    try:
        with forced_exchanges(asynchronous):
            x, grad = _inputs(cfg, mesh)
            x.requires_grad_()
            out = layer(x)
            out.backward(grad)
    finally:
        dispatcher_module.all_to_all_start = start
    flying = bool(asynchronous)
    want = [("forward up/gate", flying), ("forward down", flying), ("backward down", flying), ("backward up", flying)]
    if events != want:
        raise AssertionError(f"(shared-expert half, all-to-all in flight) events {events}, expected {want}")
    assert not handles[0].works and not handles[0].grad_works and not handles[1].grad_works
    return {
        "output": out.detach(),
        "input gradient": x.grad,
        **{f"gradient of {n}": p.grad for n, p in layer.named_parameters()},
    }


def _forward_backward(layer: MoELayer, cfg: GPTConfig, mesh) -> dict[str, torch.Tensor]:
    """Output, input gradient and every parameter gradient of one forward + backward."""
    x, grad = _inputs(cfg, mesh)
    x.requires_grad_()
    out = layer(x)
    out.backward(grad)
    return {
        "output": out.detach(),
        "input gradient": x.grad,
        **{f"gradient of {n}": p.grad for n, p in layer.named_parameters()},
    }


def check_dispatch_chunks(par: ParallelConfig, top_k: int, capacity_factor, shared: int) -> None:
    """The layer with its tokens dispatched in 2 and 3 chunks equals one chunk (output, input
    and parameter gradients within 1e-6), with blocking exchanges and with the asynchronous
    ones forced as over NCCL (bit-equal to blocking)."""
    cfg = _config(top_k, capacity_factor, shared)
    mesh = build_mesh(par, cfg)
    want = _forward_backward(_layer(cfg, mesh), cfg, mesh)
    assert want["gradient of router.weight"].abs().sum() > 0
    for chunks in (2, 3):
        layer = _layer(cfg, mesh, dispatch_chunks=chunks)
        assert layer.dispatch_chunk_count(cfg.seq_len * 2 // (mesh.tp_size if par.sp else 1)) == chunks
        blocking = _forward_backward(layer, cfg, mesh)
        for name, value in want.items():
            assert_close(f"{chunks} chunks: {name}", blocking[name], value, RTOL)
        with forced_exchanges(True):
            overlapped = _forward_backward(_layer(cfg, mesh, dispatch_chunks=chunks), cfg, mesh)
        for name, value in blocking.items():
            if not torch.equal(overlapped[name], value):
                raise AssertionError(f"{chunks} chunks: {name} differs between blocking and asynchronous exchanges")


def dispatch_chunks_ep2() -> None:
    check_dispatch_chunks(ParallelConfig(ep=2), top_k=2, capacity_factor=None, shared=0)


def dispatch_chunks_ep2_etp2_capacity_shared() -> None:
    check_dispatch_chunks(ParallelConfig(ep=2, etp=2), top_k=2, capacity_factor=1.0, shared=1)


def dispatch_chunks_tp2_sp_ep2_top3() -> None:
    check_dispatch_chunks(ParallelConfig(tp=2, sp=True, ep=2), top_k=3, capacity_factor=None, shared=1)


def dispatch_chunks_overlap_order() -> None:
    """Two dispatch chunks, no shared experts, asynchronous exchanges forced as over NCCL:
    chunk 0's experts run while chunk 1's tokens travel, chunk 1's while chunk 0's outputs
    travel back; in backward chunk 1's expert gradients are computed while chunk 0's output
    gradients travel and chunk 0's while chunk 1's input gradients travel."""
    world = torch.distributed.get_world_size()
    cfg = _config(2, None, 0)
    mesh = build_mesh(ParallelConfig(ep=world), cfg)
    layer = _layer(cfg, mesh, dispatch_chunks=2)
    handles, events = [], []
    start, experts = dispatcher_module.all_to_all_start, layer.experts.forward

    def recording_start(*args, **kwargs):
        result = start(*args, **kwargs)
        handles.append(result[1])
        return result

    def in_flight(i: int, grads: bool) -> bool:
        return len(handles) > i and bool(handles[i].grad_works if grads else handles[i].works)

    def recording_experts(rows, group_sizes):
        chunk = sum(1 for e in events if e[0] == "forward")
        # handles: 0, 1 = chunks 0, 1 dispatch; 2, 3 = chunks 0, 1 return
        events.append(("forward", chunk, in_flight(1, False) if chunk == 0 else in_flight(2, False)))
        out = experts(rows, group_sizes)
        out.register_hook(
            lambda g: events.append(("backward", chunk, in_flight(2, True) if chunk == 1 else in_flight(1, True)))
        )
        return out

    dispatcher_module.all_to_all_start = recording_start
    layer.experts.forward = recording_experts
    try:
        with forced_exchanges(True):
            _forward_backward(layer, cfg, mesh)
    finally:
        dispatcher_module.all_to_all_start = start
    want = [("forward", 0, True), ("forward", 1, True), ("backward", 1, True), ("backward", 0, True)]
    if events != want:
        raise AssertionError(f"(pass, chunk, other chunk's all-to-all in flight) events {events}, expected {want}")
    if any(h.works or h.grad_works for h in handles) or len(handles) != 4:
        raise AssertionError(f"{len(handles)} exchanges, some still in flight after backward")


def shared_experts_checkpoint_reshard() -> None:
    """Tensor-parallel shared experts (tp-sharded layout tags) in checkpoints: a llama MoE with
    a shared expert, trained 2 steps at tp=2 with SP (shared experts split over tp) and saved,
    loads into tp=1, tp=4 and tp=2 without SP with every parameter (all-gathered) equal bit
    for bit to the same checkpoint loaded into one process; the next step's loss equals that
    serial continuation within 1e-6 and the weights after it within 1e-5 (the protocol of
    checkpoint_cases, without its check that the saving layout's own continuation matches the
    serial one: that compares two layouts' fp32 trajectories, about 1e-6 apart for this model)."""
    from tests.distributed.checkpoint_cases import _check_reshard, _Run
    from tests.distributed.moe_cases import moe_config

    cfg = moe_config("llama", 2, "softmax", None)
    assert cfg.shared_experts == 1
    save = ParallelConfig(tp=2, sp=True, ep=2)
    source = _Run(cfg, save)
    shards = {n: p.shards for n, p in source.named if n.startswith("layers.1.mlp.shared.")}
    source.close()
    assert shards and all(s == ((0 if n.endswith(("up", "gate")) else 1, "tp"),) for n, s in shards.items()), shards
    _check_reshard(
        cfg,
        save,
        [
            (ParallelConfig(tp=1, ep=4), False),
            (ParallelConfig(tp=4, ep=2, etp=2), False),
            (ParallelConfig(tp=2, ep=1), True),
        ],
        check_continuation=False,
    )


def cases_for_world(world_size: int) -> list[str]:
    return {
        2: [
            "dedup_ep2_top2",
            "dedup_ep2_top3_capacity_gelu",
            "overlap_order",
            "overlap_order_async",
            "dispatch_chunks_ep2",
            "dispatch_chunks_overlap_order",
        ],
        4: [
            "dedup_ep4_top2",
            "dedup_ep2_etp2_top2_capacity",
            "dedup_ep2_etp2_top2_capacity_async",
            "overlap_order",
            "overlap_order_async",
            "overlap_order_async_tp2_sp",
            "shared_experts_checkpoint_reshard",
            "dispatch_chunks_ep2_etp2_capacity_shared",
            "dispatch_chunks_tp2_sp_ep2_top3",
        ],
        8: ["dedup_ep4_etp2_top2", "dedup_ep4_etp2_top3_capacity"],
    }.get(world_size, [])
