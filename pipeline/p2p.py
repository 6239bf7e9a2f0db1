"""The point-to-point plan of a pipeline schedule: which activation and gradient messages each
pipeline rank sends and receives, in which order and in which batches (no communication here;
`pipeline.executor` posts the plan over the pipeline's ranks).

NCCL pairs point-to-point messages by order, not by tag (PyTorch issue 94819): between two
ranks, the k-th send from A to B meets the k-th receive posted on B from A, whatever the tags
say. The plan makes that pairing right by construction:

- A message is one tensor between two virtual stages (`Message`): an activation forward or
  its gradient backward. Its *channel* is the directed pair (sender's pipeline rank,
  receiver's pipeline rank).
- Rounds: every rank's action list runs in a simulated lock step (`action_starts`: each
  action as soon as its rank is free and its input exists, forward 1 and backward 2 time
  units), which gives every action a start time. A message travels in round t = the start
  time of the action that consumes it. A rank starts one action per round, so a channel
  carries at most one message per round, and its order is the order of the rounds; both ends
  compute the rounds from the same action lists, so the k-th send and the k-th receive of a
  channel carry the same message by construction, whatever the tags.
- Batches: on each rank, the ops of one round form one batch, posted with
  `torch.distributed.batch_isend_irecv` before the rank's first action that starts in that
  round or later, and completed before that action runs. The message a send carries exists
  by then (its producer ends no later than its consumer starts); a sender keeps it until the
  consumer's round, so nothing waits in a receive buffer.
- No deadlock, even with sends that block until received (NCCL, large tensors): every op of
  a round-t batch meets its partner in the peer's round-t batch, so the ranks advance in lock
  step. By induction over t: once every batch of the rounds before t has completed, every
  action starting before t can run (it needs only messages of rounds up to its start), so
  every rank reaches its round-t batch, and those batches complete together. The exchange of
  two neighbours at one step (Megatron's send_forward_recv_backward) is thus one batch on each
  side, never a receive on one side facing a receive on the other.

`check_plan` verifies a plan: `check_placement` (each message received before the action that
needs it, sent after the action that makes it) and `replay_tag_blind` (replays every rank's
batches under blocking semantics, pairing the k-th send of a channel with its k-th receive
while ignoring tags; raises on a mismatched pair or a deadlock). Tests run it over every
schedule the configuration accepts.
Every message is one tensor of the executor's activation shape and dtype (activations and
their gradients share it), so paired ops carrying the same message agree in shape and dtype.
"""

from __future__ import annotations

import bisect
import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from meshtron.pipeline.schedules import Action

ACTIVATION, GRADIENT = "activation", "gradient"


@dataclass(frozen=True)
class Message:
    """One tensor sent from virtual stage `src_stage` to `dst_stage` for `microbatch`:
    an `ACTIVATION` (forward, dst = src + 1) or a `GRADIENT` (backward, dst = src - 1)."""

    kind: str
    microbatch: int
    src_stage: int
    dst_stage: int

    def __str__(self) -> str:
        return f"{self.kind[0]}{self.microbatch}:{self.src_stage}->{self.dst_stage}"


@dataclass(frozen=True)
class P2POp:
    """A send of `message` to pipeline rank `peer`, or a receive of it from `peer`."""

    op: str  # "send" | "recv"
    peer: int
    message: Message

    def __str__(self) -> str:
        return f"{self.op}({self.message}, peer {self.peer})"


@dataclass(frozen=True)
class Batch:
    """Ops posted together (`torch.distributed.batch_isend_irecv`) and completed before this
    rank's action `before` runs (`before` = number of actions: after the last one). `round`:
    the lock-step round of every op in it, the same at the other end of each op."""

    before: int
    round: int
    ops: tuple[P2POp, ...]


RankPlan = list[Batch]
# Unit costs of the lock-step simulation that numbers the rounds (any positive costs give a
# valid, deadlock-free plan; these are the ones the schedules are designed for).
COST = {"F": 1, "B": 2}


def needed_message(action: Action, rank: int, pp: int, v: int) -> Message | None:
    """The message `action` of pipeline rank `rank` consumes (None on the first forward stage
    and the last backward stage). Chunk c of rank r is virtual stage c * pp + r."""
    stage = action.chunk * pp + rank
    if action.kind == "F":
        return None if stage == 0 else Message(ACTIVATION, action.microbatch, stage - 1, stage)
    return None if stage == pp * v - 1 else Message(GRADIENT, action.microbatch, stage + 1, stage)


def produced_message(action: Action, rank: int, pp: int, v: int) -> Message | None:
    """The message `action` of pipeline rank `rank` produces (None on the last forward stage
    and the first backward stage)."""
    stage = action.chunk * pp + rank
    if action.kind == "F":
        return None if stage == pp * v - 1 else Message(ACTIVATION, action.microbatch, stage, stage + 1)
    return None if stage == 0 else Message(GRADIENT, action.microbatch, stage, stage - 1)


def action_starts(schedules: Sequence[Sequence[Action]], v: int) -> list[list[int]]:
    """Start time of every action of every rank when each runs as soon as its rank is free and
    its input message exists (costs `COST`; a message exists from the end of the action that
    produces it). Raises ValueError when the schedules deadlock whatever the communication."""
    pp = len(schedules)
    finish: dict[Message, int] = {}
    starts: list[list[int]] = [[] for _ in range(pp)]
    clock = [0] * pp
    progressed = True
    while progressed:
        progressed = False
        for rank, actions in enumerate(schedules):
            while len(starts[rank]) < len(actions):
                action = actions[len(starts[rank])]
                need = needed_message(action, rank, pp, v)
                if need is not None and need not in finish:
                    break
                start = max(clock[rank], finish[need] if need is not None else 0)
                clock[rank] = start + COST[action.kind]
                starts[rank].append(start)
                out = produced_message(action, rank, pp, v)
                if out is not None:
                    finish[out] = clock[rank]
                progressed = True
    stuck = {
        rank: str(actions[len(starts[rank])])
        for rank, actions in enumerate(schedules)
        if len(starts[rank]) < len(actions)
    }
    if stuck:
        raise ValueError(f"the pipeline schedules deadlock (each stuck rank's next action: {stuck})")
    return starts


def plan_p2p(schedules: Sequence[Sequence[Action]], v: int) -> list[RankPlan]:
    """Every pipeline rank's batches of sends and receives for `schedules` (rank r's action
    list at index r; v model chunks per rank): each message in the round its consumer starts
    (`action_starts`), each rank's ops of one round in one batch, posted before its first
    action starting in that round or later (see the module docstring). Raises ValueError when
    the schedules deadlock, an action needs a message no rank sends, or a sent message is never
    received."""
    pp = len(schedules)
    starts = action_starts(schedules, v)
    round_of: dict[Message, int] = {}
    for rank, actions in enumerate(schedules):
        for action, start in zip(actions, starts[rank]):
            need = needed_message(action, rank, pp, v)
            if need is not None:
                if need.src_stage % pp == rank:
                    raise ValueError(f"pipeline rank {rank}: {action} needs {need} from itself (pp={pp})")
                round_of[need] = start
    ops: list[dict[int, list[P2POp]]] = [defaultdict(list) for _ in range(pp)]  # rank -> round -> ops
    for rank, actions in enumerate(schedules):
        for action in actions:
            message = produced_message(action, rank, pp, v)
            if message is None:
                continue
            if message not in round_of:
                raise ValueError(f"pipeline rank {message.dst_stage % pp} never receives {message} from rank {rank}")
            t, dst = round_of[message], message.dst_stage % pp
            ops[rank][t].append(P2POp("send", dst, message))
            ops[dst][t].append(P2POp("recv", rank, message))
    plans: list[RankPlan] = []
    for rank in range(pp):
        plan = []
        for t in sorted(ops[rank]):
            # One action per rank per round: at most one receive, and sends to distinct ranks
            # (each receiver starts one action in round t), so no channel repeats in a batch.
            peers = [(op.op, op.peer) for op in ops[rank][t]]
            assert len(set(peers)) == len(peers) and sum(op == "recv" for op, _ in peers) <= 1, peers
            plan.append(Batch(bisect.bisect_left(starts[rank], t), t, tuple(ops[rank][t])))
        plans.append(plan)
    return plans


@functools.lru_cache(maxsize=8)
def cached_plan(schedules: tuple[tuple[Action, ...], ...], v: int) -> tuple[RankPlan, ...]:
    """`plan_p2p` memoised on the (hashable) schedules: a training run plans its training and
    evaluation schedules once each."""
    return tuple(plan_p2p(schedules, v))


def check_plan(schedules: Sequence[Sequence[Action]], v: int, plans: Sequence[RankPlan]) -> int:
    """`check_placement` then `replay_tag_blind`; returns the replay's number of sweeps."""
    check_placement(schedules, v, plans)
    return replay_tag_blind(plans)


def check_placement(schedules: Sequence[Sequence[Action]], v: int, plans: Sequence[RankPlan]) -> None:
    """Raise AssertionError unless, on every rank, each message an action needs is received in
    a batch posted before that action, each message is sent in a batch posted after the action
    that produces it, each exactly once, and nothing else is posted."""
    pp = len(plans)
    for rank, (actions, plan) in enumerate(zip(schedules, plans)):
        if [b.before for b in plan] != sorted(b.before for b in plan):
            raise AssertionError(f"rank {rank}: batches out of order")
        received: dict[Message, int] = {}
        sent: dict[Message, int] = {}
        for batch in plan:
            for op in batch.ops:
                seen = received if op.op == "recv" else sent
                if op.message in seen:
                    raise AssertionError(f"rank {rank}: {op} posted twice")
                seen[op.message] = batch.before
        for index, action in enumerate(actions):
            need = needed_message(action, rank, pp, v)
            if need is not None and received.pop(need, len(actions) + 1) > index:
                raise AssertionError(f"rank {rank}: {action} (action {index}) runs before {need} is received")
            out = produced_message(action, rank, pp, v)
            if out is not None and sent.pop(out, -1) <= index:
                raise AssertionError(f"rank {rank}: {out} is not sent after {action} (action {index}) makes it")
        if received or sent:
            raise AssertionError(f"rank {rank}: posts ops no action asks for: {sorted(map(str, {**received, **sent}))}")


def replay_tag_blind(plans: Sequence[RankPlan]) -> int:
    """Replay every rank's batches tag-blind under blocking semantics; return the number of
    sweeps over the ranks it took. Raises AssertionError naming the first violation.

    Pairing: the k-th send on channel (a -> b) meets the k-th receive posted on b from a, by
    position alone (NCCL ignores tags); the pair must carry the same message (kind,
    microbatch, stages: hence the same chunk and, every message being one activation-shaped
    tensor, the same shape).
    Progress: a rank sits in its current batch until every op of it has met its partner, and
    an op meets its partner only while the partner's rank sits in the batch holding it (sends
    block until received, as NCCL's do for large tensors); no rank able to move while some
    have batches left is a deadlock.
    """
    pp = len(plans)
    partner: dict[tuple[int, int, int], tuple[int, int, int]] = {}  # (rank, batch, op) -> partner's
    sends: dict[tuple[int, int], list] = defaultdict(list)
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    for rank, plan in enumerate(plans):
        for b, batch in enumerate(plan):
            for o, op in enumerate(batch.ops):
                if op.op == "send":
                    sends[(rank, op.peer)].append(((rank, b, o), op.message))
                else:
                    recvs[(op.peer, rank)].append(((rank, b, o), op.message))
    for key in sorted(set(sends) | set(recvs)):
        out, into = sends.get(key, []), recvs.get(key, [])
        if len(out) != len(into):
            raise AssertionError(f"channel {key[0]}->{key[1]}: {len(out)} sends but {len(into)} receives")
        for k, ((s, sent_message), (r, expected)) in enumerate(zip(out, into)):  # by position only
            if sent_message != expected:
                raise AssertionError(
                    f"channel {key[0]}->{key[1]}: send #{k} carries {sent_message} but the "
                    f"receive it meets expects {expected}"
                )
            partner[s], partner[r] = r, s
    current = [0] * pp
    matched: set[tuple[int, int, int]] = set()
    sweeps = 0
    moved = True
    while moved:
        moved = False
        for rank in range(pp):
            b = current[rank]
            if b == len(plans[rank]):
                continue
            ops = [(rank, b, o) for o in range(len(plans[rank][b].ops))]
            for op in ops:
                peer, peer_batch, _ = partner[op]
                if current[peer] == peer_batch:  # both ends posted: the transfer happens
                    matched.update((op, partner[op]))
            if all(op in matched for op in ops):
                current[rank] += 1
                moved = True
        sweeps += moved
    stuck = {
        rank: [str(op) for op in plans[rank][current[rank]].ops]
        for rank in range(pp)
        if current[rank] < len(plans[rank])
    }
    if stuck:
        raise AssertionError(f"point-to-point deadlock; each stuck rank's current batch: {stuck}")
    return sweeps
