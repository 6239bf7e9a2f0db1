"""Token dispatch to experts over the expert-parallel group, and the way back.

Each token crosses to a destination ep rank at most once. The unit of communication is the
*row*: one per (token, destination ep rank) with at least one kept (token, choice) pair
there. A row carries the token's activations plus, in a small fp32 side tensor, the local
expert id and the combine weight of each of its pairs (at most `slots = min(top_k, experts
per rank)` of them). So a token whose top-2 experts live on one rank is sent once, not twice.

    dispatch  sort the kept pairs by (destination, token, expert); number the rows; build
              each row's token index and metadata in buffers of one row per pair (an upper
              bound); exchange rows and pairs per destination (one small all-to-all over
              `ep`, one all-gather over `etp`); then copy the counts to the host: THE ONE
              HOST SYNC of the layer (the split sizes of the uneven all-to-all and the
              received totals); then gather the rows and START the all-to-alls of the rows
              and of their metadata over `ep` (asynchronous; `mpu.mappings.all_to_all_start`).
              Only those two are issued after the sync, which on a GPU leaves the device idle
              until the host issues more. `dispatch_chunks` does this for several token
              chunks with one count exchange and one sync, then starts each chunk's rows.
    receive   wait for them; all-gather the rows over `etp` when experts are tensor-parallel;
              expand each row into its (row, local expert) pairs, sorted by local expert, for
              the grouped GEMM.
    combine   multiply each pair's expert output by its combine weight and sum the pairs of one
              row (so the return carries one row per (token, destination), and under etp the
              reduce-scatter carries rows, not pairs); reduce-scatter over `etp`; START the
              return all-to-all over `ep`.
    finish    wait for it and sum each token's rows (one per destination) into [T, h].

The combine weights travel with the rows as a differentiable tensor, so the gradients of the
router (through the weights) are exact.

Overlap (mpu.mappings.async_exchanges: over NCCL). Forward: the caller runs independent work
between dispatch and receive and between combine and finish (MoELayer: the shared experts'
up/gate half, then their down half) while the exchanges are in flight. Backward: the reverse
exchanges run asynchronously too, so the shared experts' gradients are computed while the
gradients travel. Over gloo each exchange completes where it starts, through shared memory
between ranks of one host (faster on CPUs than gloo's asynchronous exchange). Without shared
experts nothing independent lies between start and wait unless the layer dispatches its
tokens in chunks (`dispatch_chunks`; MoELayer `dispatch_chunks`): then one chunk's experts
run while another chunk's rows travel. Not overlapped: the count exchange and the host sync
before the start (the split sizes must be known first), and the etp all-gather /
reduce-scatter, which depend on the exchange.

With ep = etp = 1 nothing is communicated and the pairs go straight to the grouped GEMM
(`rows=True` forces the row path there too, for tests). Dropless, every token has exactly
top_k pairs, so the pairs' expert order is a permutation of the token-major order: the
tokens are gathered into it and the expert outputs gathered back out of it
(`gather_permuted`), each gradient by the inverse gather (and a sum of each token's top_k
copies), with no scatter-add (atomic adds on a GPU, slow in 16 bits); each token's top_k
outputs are weighted and summed in the activation dtype. With a capacity the kept pairs are
no such permutation: they are summed back by `index_add`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshtron.moe.counts import add_counts
from meshtron.mpu.mappings import (
    AllToAllHandle,
    all_gather_stats,
    all_to_all_start,
    all_to_all_stats,
    all_to_all_wait,
    gather_rows,
    reduce_scatter_rows,
)
from meshtron.mpu.mesh import Mesh, group_rank


class _GatherPermuted(torch.autograd.Function):
    """out = x[index] where `index` [N] visits every row of x [M, h] N / M times and `inverse`
    [N] orders the gathered rows back by x's row (position i * (N / M) + j holds copy j of row
    i): the gradient is a gather by `inverse` and a sum of each row's N / M copies."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        grad = grad.index_select(0, inverse)
        copies = grad.shape[0] // max(ctx.rows, 1)
        return (grad if copies == 1 else grad.view(ctx.rows, copies, -1).sum(1)), None, None


def gather_permuted(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x[index] (x [M, h], index [N] visiting each row N / M times, `inverse` its inverse
    order, see `_GatherPermuted`), differentiable by gathers only. No communication."""
    return _GatherPermuted.apply(x, index, inverse)


@dataclass
class RowPlan:
    """The rows one rank sends (`plan_rows`): pairs sorted by (destination, token, expert)."""

    order: torch.Tensor  # [P] sorted position -> index of the pair in the caller's order
    row_of_pair: torch.Tensor  # [P] row of each sorted pair
    slot_of_pair: torch.Tensor  # [P] 0..slots-1: position of the pair within its row
    local_expert: torch.Tensor  # [P] expert index on the destination rank, per sorted pair
    token_of_pair: torch.Tensor  # [P] token of each sorted pair
    rows_per_dest: torch.Tensor  # [ep] rows sent to each ep rank (on device)
    pairs_per_dest: torch.Tensor  # [ep] pairs sent to each ep rank (on device)


def plan_rows(
    pair_expert: torch.Tensor,
    pair_token: torch.Tensor,
    num_tokens: int,
    num_experts: int,
    ep: int,
    keep: torch.Tensor | None = None,
) -> RowPlan:
    """Group the kept (token, choice) pairs into rows, one per (token, destination ep rank).

    pair_expert / pair_token [P]: expert and token of each pair (a token's experts distinct);
    keep [P] bool (None: all kept): dropped pairs are sorted after every kept one, so the
    kept pairs are the first `pairs_per_dest.sum()` of the sorted order. Experts are split
    over the `ep` ranks in equal contiguous blocks. Rows are ordered by destination, then
    token; a row's pairs by local expert. Device work only (no host sync, no communication).
    """
    local_count = num_experts // ep
    dest = torch.div(pair_expert, local_count, rounding_mode="floor")
    local = pair_expert - dest * local_count
    if keep is not None:
        dest = torch.where(keep, dest, ep)  # a destination past the last: sorts last, not counted
    row_key = dest * num_tokens + pair_token
    order = torch.argsort(row_key * local_count + local)
    row_key, local = row_key[order], local[order]
    first = torch.ones_like(row_key, dtype=torch.bool)
    first[1:] = row_key[1:] != row_key[:-1]
    row_of_pair = torch.cumsum(first, 0) - 1
    position = torch.arange(row_key.numel(), device=row_key.device)
    row_start = torch.cummax(torch.where(first, position, 0), 0).values if row_key.numel() else position
    dest_sorted = dest[order]
    zeros = torch.zeros(ep + 1, dtype=torch.long, device=pair_expert.device)
    return RowPlan(
        order,
        row_of_pair,
        position - row_start,
        local,
        pair_token[order],
        zeros.index_add(0, dest_sorted, first.long())[:ep],
        zeros.index_add(0, dest_sorted, torch.ones_like(dest_sorted))[:ep],
    )


def host_sync(counts: torch.Tensor) -> list[int]:
    """`counts` copied to the host: the MoE layer's one host sync on the row path (the
    all-to-all split sizes and the received totals). A function of its own so that tests can
    see where it falls among the layer's ops."""
    return counts.tolist()


@dataclass
class _RowSend:
    """One chunk's send, built before the host sync (`AllToAllDispatcher._prepare_rows`)."""

    tokens: torch.Tensor  # [T, h] the chunk's tokens
    row_token: torch.Tensor  # [P] token of each row (the first sum(splits) are the kept rows)
    meta: torch.Tensor  # [P, 2 * slots] combine weights and local expert ids per row
    counts: torch.Tensor  # [ep, 2] rows and pairs sent to each ep rank


@dataclass
class InFlight:
    """One dispatch between `dispatch` and `finish`: what the later steps need (per call, so
    recomputation and several microbatches in flight never share state)."""

    tokens: torch.Tensor  # [T, h] this rank's tokens
    rows: bool  # row path (False: pairs straight to the experts)
    # pair path
    pair_token: torch.Tensor | None = None  # [P] token of each expert-sorted pair
    pair_weight: torch.Tensor | None = None  # combine weights: [P] per expert-sorted pair with a
    # capacity, [T, k] token-major dropless
    group_sizes: torch.Tensor | None = None  # [E] pairs per expert
    pair_order: torch.Tensor | None = None  # [T * k] dropless: token-major index of each expert-sorted pair
    sorted_position: torch.Tensor | None = None  # [T * k] dropless: its inverse, the sorted position of each pair
    # row path
    row_token: torch.Tensor | None = None  # [R] token of each sent row
    input_splits: list[int] = field(default_factory=list)  # rows sent to each ep rank
    output_splits: list[int] = field(default_factory=list)  # rows received from each ep rank
    etp_sizes: list[int] = field(default_factory=list)  # rows received by each etp rank
    received_pairs: int = 0  # pairs of the rows this rank computes (etp-gathered)
    sent: tuple = ()  # buffers of the all-to-all in flight
    handle: AllToAllHandle | None = None
    recv_row_of_pair: torch.Tensor | None = None  # [N] received row of each expert-sorted pair
    recv_pair_weight: torch.Tensor | None = None  # [N] combine weight of each expert-sorted pair
    recv_rows: int = 0


class AllToAllDispatcher:
    """Moves tokens to the ranks owning their experts (groups `mesh.ep`, `mesh.etp`) and the
    weighted expert outputs back; see the module docstring for the steps."""

    def __init__(self, num_experts: int, top_k: int, mesh: Mesh, *, rows: bool | None = None):
        self.mesh = mesh
        self.num_experts = num_experts
        self.ep, self.etp = mesh.par.ep, mesh.par.etp
        self.num_local = num_experts // self.ep
        self.top_k = top_k
        self.slots = min(top_k, self.num_local)
        self.rows = (self.ep > 1 or self.etp > 1) if rows is None else rows
        self.last_send_splits: list[int] = []  # rows sent to each ep rank by the last dispatch

    # ------------------------------------------------------------------ forward steps

    def dispatch(
        self,
        tokens: torch.Tensor,
        pair_expert: torch.Tensor,
        pair_weight: torch.Tensor,
        keep: torch.Tensor | None = None,
    ) -> InFlight:
        """Plan the rows and start sending them. tokens [T, h]; pair_expert / pair_weight
        [T * top_k]: expert and (differentiable) combine weight of each (token, choice) pair,
        token-major (pair i is a choice of token i // top_k); keep [P] bool: the pairs capacity
        keeps (None: all). Dropped pairs are not sent (on the pair path they are filtered out
        with a boolean mask, whose host sync is that path's only one)."""
        return self.dispatch_chunks([(tokens, pair_expert, pair_weight, keep)])[0]

    def dispatch_chunks(self, chunks: list[tuple]) -> list[InFlight]:
        """`dispatch` for several token chunks, each (tokens, pair_expert, pair_weight, keep), to
        be received, combined and finished one by one. On the row path their counts travel in
        one exchange over `ep` (gathered over `etp`) and reach the host in one sync, after which
        each chunk's rows start, in order: one host sync per call however many chunks."""
        if not self.rows:
            self.last_send_splits = []
            return [self._pairs(*chunk) for chunk in chunks]
        sends = [self._prepare_rows(*chunk) for chunk in chunks]
        n, ep = len(sends), self.ep
        counts = torch.stack([send.counts for send in sends], 1)  # [ep (destination), chunk, (rows, pairs)]
        received = all_to_all_stats(counts, self.mesh.ep)  # [ep (source), chunk, 2]
        gathered = all_gather_stats(received, self.mesh.etp)  # [etp, ep (source), chunk, 2]
        host = host_sync(torch.cat([counts.flatten(), gathered.flatten()]))
        # plain Python from here to the sends: no tensor op between the sync and the row gathers
        sent, table = host[: 2 * ep * n], host[2 * ep * n :]
        me = group_rank(self.mesh.etp)
        flights = []
        for c, send in enumerate(sends):

            def got(etp_rank: int, source: int, what: int, c=c) -> int:  # what: 0 rows, 1 pairs
                return table[((etp_rank * ep + source) * n + c) * 2 + what]

            input_splits = [sent[(d * n + c) * 2] for d in range(ep)]
            output_splits = [got(me, src, 0) for src in range(ep)]  # rows from each ep source to this etp rank
            etp_sizes = [sum(got(e, src, 0) for src in range(ep)) for e in range(self.etp)]
            received_pairs = sum(got(e, src, 1) for e in range(self.etp) for src in range(ep))
            flights.append(self._start_rows(send, input_splits, output_splits, etp_sizes, received_pairs))
        self.last_send_splits = [sum(f.input_splits[d] for f in flights) for d in range(ep)]
        return flights

    def _pairs(
        self, tokens: torch.Tensor, pair_expert: torch.Tensor, pair_weight: torch.Tensor, keep: torch.Tensor | None
    ) -> InFlight:
        """The pair path (ep = etp = 1): pairs sorted by expert, straight to the experts."""
        T, k = tokens.shape[0], self.top_k
        group_sizes = torch.zeros(self.num_experts, dtype=torch.long, device=tokens.device)
        if keep is None:  # every pair: the expert order is a permutation of the pairs
            order = torch.argsort(pair_expert, stable=True)
            add_counts(group_sizes, pair_expert)
            position = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
            return InFlight(
                tokens,
                False,
                pair_token=torch.div(order, k, rounding_mode="floor"),
                pair_weight=pair_weight.view(T, k),
                group_sizes=group_sizes,
                pair_order=order,
                sorted_position=position,
            )
        pair = keep.nonzero().squeeze(1)  # index of each kept pair in the token-major order
        pair_expert, pair_weight = pair_expert[pair], pair_weight[pair]
        order = torch.argsort(pair_expert, stable=True)
        add_counts(group_sizes, pair_expert)
        return InFlight(
            tokens,
            False,
            pair_token=torch.div(pair[order], k, rounding_mode="floor"),
            pair_weight=pair_weight[order],
            group_sizes=group_sizes,
        )

    def _prepare_rows(
        self, tokens: torch.Tensor, pair_expert: torch.Tensor, pair_weight: torch.Tensor, keep: torch.Tensor | None
    ) -> _RowSend:
        """Everything one chunk's send needs, built before the host sync in buffers of one row
        per pair (an upper bound on the rows: kept rows come first, numbered in sorted order, and
        the rows of dropped pairs after them), so that after the sync the host issues only the
        row gather and the exchange: on a GPU, the ops issued after a sync run on an idle device."""
        T, k = tokens.shape[0], self.top_k
        pair_token = torch.arange(T, device=tokens.device).repeat_interleave(k)
        plan = plan_rows(pair_expert, pair_token, T, self.num_experts, self.ep, keep)
        slots, bound = self.slots, plan.order.numel()
        row_token = torch.zeros(bound, dtype=torch.long, device=tokens.device)
        row_token.scatter_(0, plan.row_of_pair, plan.token_of_pair)  # every pair of a row has its token
        cell = plan.row_of_pair * slots + plan.slot_of_pair
        weights = torch.zeros(bound * slots, dtype=torch.float32, device=tokens.device)
        weights = weights.index_put((cell,), pair_weight[plan.order].float())  # differentiable
        # Local expert ids as fp32 (exact below 2**24); empty slots hold num_local.
        ids = torch.full((bound * slots,), float(self.num_local), dtype=torch.float32, device=tokens.device)
        ids.index_put_((cell,), plan.local_expert.float())
        meta = torch.cat([weights.view(bound, slots), ids.view(bound, slots)], 1)  # [bound, 2*slots]
        # Per destination: rows and pairs sent (exchanged over ep, gathered over etp)
        counts = torch.stack([plan.rows_per_dest, plan.pairs_per_dest], 1)  # [ep, 2]
        return _RowSend(tokens, row_token, meta, counts)

    def _start_rows(
        self,
        send: _RowSend,
        input_splits: list[int],
        output_splits: list[int],
        etp_sizes: list[int],
        received_pairs: int,
    ) -> InFlight:
        """Gather one chunk's rows and start their all-to-all (and of their metadata) over `ep`."""
        num_rows = sum(input_splits)
        row_token = send.row_token[:num_rows]
        rows = send.tokens.index_select(0, row_token)
        sent, handle = all_to_all_start([rows, send.meta[:num_rows]], output_splits, input_splits, self.mesh.ep)
        return InFlight(
            send.tokens,
            True,
            row_token=row_token,
            input_splits=input_splits,
            output_splits=output_splits,
            etp_sizes=etp_sizes,
            received_pairs=received_pairs,
            sent=sent,
            handle=handle,
        )

    def receive(self, state: InFlight) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the rows; returns (expert inputs [N, h] sorted by local expert, group sizes
        [E_local] on device)."""
        if not state.rows:
            if state.sorted_position is None:
                return state.tokens.index_select(0, state.pair_token), state.group_sizes
            return gather_permuted(state.tokens, state.pair_token, state.sorted_position), state.group_sizes
        rows, meta = all_to_all_wait(state.sent, state.handle)
        state.sent = ()
        if self.etp > 1:
            rows = gather_rows(rows, state.etp_sizes, self.mesh.etp)
            meta = gather_rows(meta, state.etp_sizes, self.mesh.etp)
        slots = self.slots
        ids = meta[:, slots:].detach().long().reshape(-1)  # [R_all * slots], num_local = empty
        pair_of_cell = torch.argsort(ids, stable=True)[: state.received_pairs]
        group_sizes = torch.zeros(self.num_local + 1, dtype=torch.long, device=ids.device)
        group_sizes = group_sizes.index_add(0, ids, torch.ones_like(ids))[: self.num_local]
        state.recv_row_of_pair = torch.div(pair_of_cell, slots, rounding_mode="floor")
        state.recv_pair_weight = meta[:, :slots].reshape(-1).index_select(0, pair_of_cell)
        state.recv_rows = rows.shape[0]
        return rows.index_select(0, state.recv_row_of_pair), group_sizes

    def combine(self, expert_out: torch.Tensor, state: InFlight) -> InFlight:
        """Weight and sum the expert outputs [N, h] (etp partial sums) per row and start sending
        the rows back."""
        if not state.rows:
            if state.sorted_position is not None:
                state.sent = (expert_out,)  # weighted in `finish`, token-major
                return state
            weighted = (expert_out * state.pair_weight.unsqueeze(-1)).to(state.tokens.dtype)
            state.sent = (weighted,)
            return state
        weighted = expert_out * state.recv_pair_weight.unsqueeze(-1)  # fp32 weights: fp32 sum
        summed = weighted.new_zeros((state.recv_rows, expert_out.shape[1]))
        summed = summed.index_add(0, state.recv_row_of_pair, weighted).to(state.tokens.dtype)
        if self.etp > 1:
            summed = reduce_scatter_rows(summed, state.etp_sizes, self.mesh.etp)
        state.sent, state.handle = all_to_all_start([summed], state.input_splits, state.output_splits, self.mesh.ep)
        return state

    def finish(self, state: InFlight) -> torch.Tensor:
        """Wait for the rows to return; the routed output [T, h] (each token's rows summed)."""
        if not state.rows:
            (out,) = state.sent
            if state.sorted_position is None:
                return torch.zeros_like(state.tokens).index_add(0, state.pair_token, out)
            # expert order -> token-major [T, k, h], weighted and summed over each token's k
            T, k = state.pair_weight.shape
            out = gather_permuted(out, state.sorted_position, state.pair_order).view(T, k, -1)
            return (out * state.pair_weight.to(out.dtype).unsqueeze(-1)).sum(1)
        (back,) = all_to_all_wait(state.sent, state.handle)
        state.sent = ()
        return torch.zeros_like(state.tokens).index_add(0, state.row_token, back)
