"""The MoE layer: router -> (capacity) -> dispatch -> grouped experts -> combine (+ shared experts).

Tokens inside the layer are always distinct per rank: under sequence parallelism they
arrive as sequence shards; at tp > 1 without SP the layer keeps its TP rank's sequence chunk
on the way in and all-gathers the output on the way out (so ep can fold over the TP ranks,
e.g. tp=4 attention with ep=8 experts on 8 ranks). Routing statistics (aux loss, z-loss,
load) pool the tokens of the aux-loss scope (moe/scope.py) over its stats group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshtron.eager import prepare_for_compile
from meshtron.moe.capacity import capacity_for, capacity_keep_mask, capacity_keep_mask_cp
from meshtron.moe.config import MoEConfig
from meshtron.moe.dispatcher import AllToAllDispatcher
from meshtron.moe.experts import GroupedExperts, expert_out_init_std
from meshtron.moe.router import RouterOutput, TopKRouter
from meshtron.moe.scope import aux_loss_scope
from meshtron.mpu import fp8
from meshtron.mpu.init import normal_init, tag
from meshtron.mpu.mappings import (
    all_reduce_stats,
    gather_from_region,
    gather_from_sequence,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    sequence_gathered,
)
from meshtron.mpu.mesh import Mesh, expert_shard_checks
from meshtron.rules import raise_first


class SharedExperts(nn.Module):
    """`n` always-visited experts as one MLP of width f = n * moe_ffn_hidden_size, tensor-
    parallel over `mesh.tp` like the dense MLP: up (and gate) column-parallel ([f/tp, h] per
    rank), down row-parallel ([h, f/tp]); full weights as at tp = 1, so the single-process
    model is unchanged. Gradients reduce over dp (each TP rank holds a distinct shard).

    The MoE layer's tokens are sequence shards over tp (with or without SP): `hidden` takes
    the shard and uses the full sequence, all-gathered over tp (`gather_from_sequence`), or,
    when the caller already holds it (tp > 1 without SP: the replicated input the shard was
    cut from), that tensor without communication (`sequence_gathered`); backward
    reduce-scatters the input gradient to the shard either way. `output` reduce-scatters the
    row-parallel partial sums back to the shard. The two halves let the layer run them while
    its dispatch and combine all-to-alls are in flight.
    """

    def __init__(self, cfg: MoEConfig, mesh: Mesh, device=None, dtype=None):
        super().__init__()
        self.mesh = mesh
        h, f = cfg.hidden_size, cfg.shared_width
        tp = mesh.tp_size
        if cfg.shared_ffn_hidden_size is None:
            raise_first(expert_shard_checks(0, cfg.ffn_hidden_size, cfg.shared_experts, ep=1, etp=1, tp=tp))
        elif f % tp:
            raise ValueError(f"model.shared_ffn_hidden_size={f} must be divisible by parallel.tp={tp}")
        out_std = expert_out_init_std(cfg.init_std, cfg.num_layers)

        def weight(full, local, std, dim):
            return tag(
                nn.Parameter(torch.empty(local, device=device, dtype=dtype)), normal_init(full, std), tp_shard_dim=dim
            )

        self.up = weight((f, h), (f // tp, h), cfg.init_std, 0)
        self.gate = weight((f, h), (f // tp, h), cfg.init_std, 0) if cfg.activation == "swiglu" else None
        self.down = weight((h, f), (h, f // tp), out_std, 1)
        # Qwen2-MoE's shared_expert_gate: each token's shared output times sigmoid(x . w). Every
        # tp rank scores its own sequence shard: the gradient is summed over tp, as the router's.
        self.output_gate = (
            tag(
                nn.Parameter(torch.empty(1, h, device=device, dtype=dtype)),
                normal_init((1, h), cfg.init_std),
                sequence_parallel=tp > 1,
            )
            if cfg.shared_expert_gate
            else None
        )

    def gated(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The shared output `out` [s/tp, b, h] of the sequence shard x [s/tp, b, h], scaled by
        sigmoid(x . output_gate) per token when the layer has the gate. No communication."""
        return out if self.output_gate is None else out * torch.sigmoid(F.linear(x, self.output_gate))

    def hidden(self, x: torch.Tensor, full: torch.Tensor | None = None) -> torch.Tensor:
        """This TP rank's slice of the hidden activation, [s, b, f/tp], for the sequence shard
        x [s/tp, b, h] (`full`: the already-gathered [s, b, h], if the caller has it)."""
        group = self.mesh.tp
        x = gather_from_sequence(x, group) if full is None else sequence_gathered(x, full, group)
        up = fp8.linear(x, self.up)
        return F.gelu(up, approximate="tanh") if self.gate is None else F.silu(fp8.linear(x, self.gate)) * up

    def output(self, hidden: torch.Tensor) -> torch.Tensor:
        """Down projection of `hidden`, summed over tp and cut to this rank's sequence shard."""
        return reduce_scatter_to_sequence(fp8.linear(hidden, self.down), self.mesh.tp)

    def forward(self, x: torch.Tensor, full: torch.Tensor | None = None) -> torch.Tensor:
        return self.gated(self.output(self.hidden(x, full)), x)


class MoELayer(nn.Module):
    """Top-k routed experts over the expert mesh; input/output [s(/tp), b, h] like the dense MLP.

    Dispatch (moe/dispatcher.py) sends each token once per destination ep rank; over NCCL its
    all-to-alls run asynchronously (mpu.mappings.async_exchanges): the shared experts
    (tensor-parallel over tp) compute while the tokens and the outputs travel, and their
    gradients while the gradients travel. The one host sync of the layer
    is the dispatcher's copy of the split sizes.

    `dispatch_chunks` (`trainer.moe_dispatch_chunks`) > 1 cuts this rank's tokens into that
    many contiguous ranges, each dispatched on its own after the routing of all of them
    (Tutel-style pipelining; the statistics still pool every token): chunk i's experts run
    while chunk i+1's tokens and chunk i-1's outputs travel, forward and backward, so the
    exchanges overlap expert work without shared experts too. The chunks share one count
    exchange and one host sync (`AllToAllDispatcher.dispatch_chunks`); each costs one more
    set of small ops and smaller GEMMs: worth it where the all-to-alls take about as long as
    the expert GEMMs (ep across nodes), not on small host-bound layers. The result equals one
    chunk up to the summation order of the expert weight gradients.

    After each forward, `last_router` holds the router's output (aux/z-loss terms and load)
    and `last_dropped` the global fraction of (token, choice) pairs dropped by capacity (over
    `mesh.tp_dp`: one small all-reduce per forward with a capacity; dropless, a constant 0
    and no collective).
    """

    def __init__(
        self, cfg: MoEConfig, mesh: Mesh, device=None, dtype=None, *, backend: str = "torch", dispatch_chunks: int = 1
    ):
        super().__init__()
        cfg.validate()
        if dispatch_chunks < 1:
            raise ValueError(f"trainer.moe_dispatch_chunks={dispatch_chunks} must be at least 1")
        self.cfg, self.mesh = cfg, mesh
        self.dispatch_chunks = dispatch_chunks
        self.scope = aux_loss_scope(cfg.aux_loss_scope, mesh)
        self.router = TopKRouter(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.top_k,
            score=cfg.router_score,
            renormalize=cfg.router_renormalize,
            aux_loss_coef=cfg.aux_loss_coef,
            z_loss_coef=cfg.z_loss_coef,
            bias_update_rate=cfg.router_bias_update_rate,
            groups=cfg.router_groups,
            topk_groups=cfg.router_topk_groups,
            pooled_aux=cfg.aux_loss_layers == "pooled",
            scaling_factor=cfg.router_scaling_factor,
            init_std=cfg.init_std,
            sequence_parallel=mesh.tp_size > 1,
            device=device,
            dtype=dtype,
        )
        self.experts = GroupedExperts(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.ffn_hidden_size,
            cfg.activation,
            mesh,
            init_std=cfg.init_std,
            out_init_std=expert_out_init_std(cfg.init_std, cfg.num_layers),
            backend=backend,
            device=device,
            dtype=dtype,
        )
        self.shared = SharedExperts(cfg, mesh, device, dtype) if cfg.shared_experts else None
        self.dispatcher = AllToAllDispatcher(cfg.num_experts, cfg.top_k, mesh)
        self.last_router: RouterOutput | None = None
        self.last_dropped: torch.Tensor | None = None
        self.reduce_counts = all_reduce_stats  # the capacity's kept-pair count (keep_collectives_eager)

    def compile_moe(self) -> str:
        """Put this layer under torch.compile (`trainer.compile_moe`) and say how: "layer", the
        whole layer as one graph (`fullgraph`), where it has no collective and no host sync
        (dropless, tp = cp = ep = etp = 1, routing statistics local to the rank); else "parts":
        the router's two halves (routing, statistics) and the experts, the computation between
        the dispatch's collectives and host sync, which stay eager (as do capacity, the shared
        experts and the sequence scatter/gather). The statistics' all-reduce, where it has ranks
        to reduce over, runs eagerly between the statistics' two graphs. Parameters, state dict
        and hooks stay the modules' own. Rows per expert vary from step to step at ep > 1: the
        experts' graph recompiles once with a dynamic row count."""
        prepare_for_compile()  # meshtron.eager's functions: disabled before tracing
        local_stats = self.scope.stats_ranks == 1  # also means tp = cp = 1: they shard the statistics
        if local_stats and self.cfg.capacity_factor is None and self.mesh.par.ep == 1 and self.mesh.par.etp == 1:
            self.compile(fullgraph=True)
            return "layer"
        if not local_stats:
            self.router.reduce_stats = torch.compiler.disable(all_reduce_stats)
        router = self.router  # the layer calls its two halves apart: each compiled on the instance
        router.route = torch.compile(router.route, fullgraph=True)
        router.statistics = torch.compile(router.statistics, fullgraph=local_stats)
        self.experts.compile(fullgraph=True)
        return "parts"

    def keep_collectives_eager(self) -> None:
        """Under a compiled block (`trainer.compile`; models/gpt.py `Block.compile_body`) this
        layer's communication runs eagerly, a graph break around each call: the dispatcher's
        four steps where it communicates (ep or etp > 1; their all-to-all handles span the
        calls: traced by dynamo (torch 2.13) an ep = 2 step lost its equality with eager, and
        tracing some of the steps hung), the routing statistics' all-reduce where it has ranks
        to reduce over, and the capacity's count of kept pairs."""
        if self.dispatcher.rows:
            for name in ("dispatch_chunks", "receive", "combine", "finish"):
                setattr(self.dispatcher, name, torch.compiler.disable(getattr(self.dispatcher, name)))
        if self.scope.stats_ranks > 1:
            self.router.reduce_stats = torch.compiler.disable(all_reduce_stats)
        self.reduce_counts = torch.compiler.disable(all_reduce_stats)

    def dispatch_chunk_count(self, num_tokens: int) -> int:
        """How many chunks `num_tokens` tokens are dispatched in: `dispatch_chunks` (at most one
        per token) where the dispatcher communicates (ep or etp > 1), else 1 (at ep = etp = 1
        nothing travels, so there is nothing to overlap)."""
        return max(1, min(self.dispatch_chunks, num_tokens)) if self.dispatcher.rows else 1

    def _chunks(
        self, tokens: torch.Tensor, pair_expert: torch.Tensor, pair_weight: torch.Tensor, keep: torch.Tensor | None
    ) -> list[tuple]:
        """The dispatcher's inputs (tokens, pair_expert, pair_weight, keep) cut into
        `dispatch_chunk_count` contiguous token ranges (pairs are token-major: k per token)."""
        n, T, k = self.dispatch_chunk_count(tokens.shape[0]), tokens.shape[0], self.cfg.top_k
        if n == 1:
            return [(tokens, pair_expert, pair_weight, keep)]
        bounds = [T * i // n for i in range(n + 1)]
        return [
            (
                tokens[a:e],
                pair_expert[a * k : e * k],
                pair_weight[a * k : e * k],
                None if keep is None else keep[a * k : e * k],
            )
            for a, e in zip(bounds, bounds[1:])
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mesh, k = self.mesh, self.cfg.top_k
        gather_back = mesh.tp_size > 1 and not mesh.sequence_parallel
        full = x if gather_back else None  # the replicated input: the shared experts use it as is
        if gather_back:
            x = scatter_to_sequence(x, mesh.tp)
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        routing = self.router.route(x)
        pair_expert = routing.topk_idx.view(-1)  # token-major: pair i is a choice of token i // k
        pair_weight = routing.topk_weight.view(-1)
        keep = None
        if self.cfg.capacity_factor is not None:  # dropless layers count nothing (no collective)
            full_seq = s * mesh.tp_size * mesh.cp_size
            capacity = capacity_for(full_seq, self.cfg.num_experts, k, self.cfg.capacity_factor)
            if mesh.cp_size > 1:  # this rank's tokens: a tp piece of its 2 cp chunks
                keep = capacity_keep_mask_cp(routing.topk_idx, self.cfg.num_experts, capacity, mesh)
            else:
                keep = capacity_keep_mask(routing.topk_idx, self.cfg.num_experts, capacity, mesh.tp)
            keep = keep.reshape(-1)  # dropped pairs are not sent (the dispatcher filters them)
            kept = keep.sum().to(torch.float32)
            counts = self.reduce_counts(
                torch.stack([kept, torch.tensor(float(s * b * k), device=x.device)]), mesh.tp_dp
            )
            self.last_dropped = 1.0 - counts[0] / counts[1]

        # Over NCCL the all-to-alls run asynchronously: the shared experts' up/gate half runs
        # while the tokens travel to the experts, their down half while the outputs travel
        # back, and the same in backward (mpu.mappings.async_exchanges). With dispatch chunks
        # the experts of one chunk also run while the next chunk's tokens travel and the
        # previous chunk's outputs travel back (`dispatch_chunks`).
        in_flight = self.dispatcher.dispatch_chunks(self._chunks(tokens, pair_expert, pair_weight, keep))
        shared_hidden = self.shared.hidden(x, full) if self.shared is not None else None
        for i, state in enumerate(in_flight):
            rows, group_sizes = self.dispatcher.receive(state)
            in_flight[i] = self.dispatcher.combine(self.experts(rows, group_sizes), state)
        # The balancing statistics (and their all-reduce) feed only the losses: issued once the
        # expert GEMMs are queued, so that a GPU starting this layer idle waits for the routing's
        # few ops before its first large kernel, not for these.
        self.last_router = self.router.statistics(routing, self.scope.stats_group, per_sequence=self.scope.per_sequence)
        if keep is None:
            self.last_dropped = torch.zeros((), device=x.device)
        shared_out = self.shared.gated(self.shared.output(shared_hidden), x) if self.shared is not None else None
        routed = [self.dispatcher.finish(state) for state in in_flight]
        out = (routed[0] if len(routed) == 1 else torch.cat(routed)).view(s, b, h)
        if shared_out is not None:
            out = out + shared_out
        if gather_back:
            out = gather_from_region(out, 0, mesh.tp)
        return out
