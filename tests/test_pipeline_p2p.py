"""Pipeline point-to-point messages pair up without tags (NCCL semantics) and never deadlock.

The tag-blind matcher (`pipeline.p2p.check_plan`) pairs the k-th send on each directed
channel with the k-th receive on it by position alone, demands that both carry the same
message (kind, microbatch, virtual stages), and replays every rank's batches with blocking
sends and receives. It runs over
- the executor's plan (`plan_p2p`) for every schedule the configuration accepts: gpipe and
  1f1b at pp 2..8 with 1..16 microbatches, interleaved at pp 2..8, vpp 1..4 with every
  microbatch count up to 16 divisible by pp, and the forward-only evaluation order;
- what `PipelineExecutor.run` itself posts, recorded op by op (peer, tag, shape, dtype)
  through a stand-in for `torch.distributed`, on a smaller sweep;
and it must reject a plan with two sends swapped, the pre-batching executor's order
(blocking receive per action, separate sends) and a receive posted after its action.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshtron.mpu.mesh import collective_device
from meshtron.pipeline.executor import PipelineExecutor
from meshtron.pipeline.p2p import (
    ACTIVATION,
    GRADIENT,
    Batch,
    Message,
    P2POp,
    check_placement,
    check_plan,
    needed_message,
    plan_p2p,
    produced_message,
    replay_tag_blind,
)
from meshtron.pipeline.schedules import build_all_ranks


def accepted_schedules(max_pp: int = 8, max_vpp: int = 4, max_m: int = 16, ms=None):
    """(name, pp, vpp, m, forward_only) for every combination the config check accepts
    (vpp > 1 needs interleaved; interleaved needs m divisible by pp; evaluation takes any m)."""
    for pp, m in itertools.product(range(2, max_pp + 1), ms or range(1, max_m + 1)):
        yield "gpipe", pp, 1, m, False
        yield "1f1b", pp, 1, m, False
        for vpp in range(1, max_vpp + 1):
            if m % pp == 0:
                yield "interleaved", pp, vpp, m, False
            yield "interleaved", pp, vpp, m, True


def _label(name, pp, vpp, m, forward_only) -> str:
    return f"{name} pp={pp} vpp={vpp} m={m}{' forward-only' if forward_only else ''}"


def test_every_accepted_schedule_pairs_by_order_and_completes():
    checked = 0
    for name, pp, vpp, m, forward_only in accepted_schedules():
        schedules = build_all_ranks(name, pp, m, vpp, forward_only)
        try:
            check_plan(schedules, vpp, plan_p2p(schedules, vpp))
        except AssertionError as err:
            raise AssertionError(f"{_label(name, pp, vpp, m, forward_only)}: {err}") from err
        checked += 1
    assert checked == 776  # 7 pp x 16 m x (gpipe, 1f1b, 4 eval vpp) + 104 interleaved


# ------------------------------------------------------------------ what the executor posts


class _Recorder:
    """Stands in for torch.distributed's point-to-point calls: records each batch the
    executor posts (after how many actions, which ops) and fills the receive buffers."""

    def __init__(self, pp: int):
        self.pp, self.batches, self.actions_done, self.tensors = pp, [], 0, []

    def op(self, op, tensor, peer, group=None, tag=0):
        return SimpleNamespace(op=op, tensor=tensor, peer=peer, tag=tag)

    def batch_isend_irecv(self, ops):
        self.batches.append((self.actions_done, ops))
        for op in ops:
            if op.op is dist.irecv:
                op.tensor.normal_()
        return [SimpleNamespace(wait=lambda: None) for _ in ops]


def _message_of_tag(tag: int, num_virtual: int) -> Message:
    """Invert `PipelineExecutor._tag` (with tags on, a tag names its message)."""
    slot, backward = divmod(tag, 2)
    microbatch, dst = divmod(slot, num_virtual)
    return Message(GRADIENT, microbatch, dst + 1, dst) if backward else Message(ACTIVATION, microbatch, dst - 1, dst)


def recorded_plans(monkeypatch, name, pp, vpp, m, forward_only, shape=(2, 1, 3)):
    """Run `PipelineExecutor.run` of every pipeline rank on tiny linear chunks and return what
    each posted, as plans `check_plan` reads, plus {(rank, op, message): (shape, dtype)}."""
    schedules = build_all_ranks(name, pp, m, vpp, forward_only)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: list(range(pp)))
    plans, tensors = [], {}
    for rank in range(pp):
        recorder = _Recorder(pp)
        monkeypatch.setattr(dist, "P2POp", recorder.op)
        monkeypatch.setattr(dist, "batch_isend_irecv", recorder.batch_isend_irecv)
        chunks = [nn.Linear(shape[-1], shape[-1]) for _ in range(vpp)]

        def count(*_):
            recorder.actions_done += 1

        def before_backward(index, action):
            count()
            return contextlib.nullcontext()

        for chunk in chunks:
            chunk.register_forward_pre_hook(count)
        mesh = SimpleNamespace(pp_size=pp, pp_rank=rank, pp="pp group")
        executor = PipelineExecutor(chunks, mesh, shape, torch.float32, torch.device("cpu"))
        executor.run(
            schedules,
            [torch.randn(shape) for _ in range(m)],
            lambda chunk, out, i: out.sum(),
            before_backward=before_backward,
            forward_only=forward_only,
        )
        plan = []
        for before, ops in recorder.batches:
            p2p = []
            for op in ops:
                kind = "send" if op.op is dist.isend else "recv"
                message = _message_of_tag(op.tag, pp * vpp)
                p2p.append(P2POp(kind, op.peer, message))
                tensors[(rank, kind, message)] = (tuple(op.tensor.shape), op.tensor.dtype)
            plan.append(Batch(before, 0, tuple(p2p)))
        plans.append(plan)
    return schedules, plans, tensors


def test_executor_posts_a_tag_blind_deadlock_free_order(monkeypatch):
    """Replays what the executor really posts (not the plan it was given) for pp 2..4,
    vpp 1..3 and several microbatch counts; paired tensors have one shape and dtype."""
    for case in accepted_schedules(max_pp=4, max_vpp=3, ms=(1, 2, 3, 4, 6, 8)):
        name, pp, vpp, m, forward_only = case
        schedules, plans, tensors = recorded_plans(monkeypatch, *case)
        try:
            check_plan(schedules, vpp, plans)
        except AssertionError as err:
            raise AssertionError(f"{_label(*case)}: {err}") from err
        for (_rank, kind, message), layout in tensors.items():
            if kind == "send":
                assert tensors[(message.dst_stage % pp, "recv", message)] == layout == ((2, 1, 3), torch.float32)


# ------------------------------------------------------------------ the matcher can fail


def _swap_two_sends(plans, rank):
    """`plans` with the first two sends of one channel of `rank` (in different batches) swapped."""
    sends = [(b, o, op) for b, batch in enumerate(plans[rank]) for o, op in enumerate(batch.ops) if op.op == "send"]
    for (b1, o1, op1), (b2, o2, op2) in itertools.combinations(sends, 2):
        if op1.peer == op2.peer and b1 != b2:
            plan = list(plans[rank])
            for b, o, new in ((b1, o1, op2), (b2, o2, op1)):
                plan[b] = replace(plan[b], ops=plan[b].ops[:o] + (new,) + plan[b].ops[o + 1 :])
            return [plan if r == rank else p for r, p in enumerate(plans)]
    raise AssertionError("no channel with two sends in different batches")


@pytest.mark.parametrize("name,pp,vpp,m", [("1f1b", 4, 1, 8), ("interleaved", 2, 2, 4), ("gpipe", 3, 1, 5)])
def test_matcher_rejects_two_swapped_sends(name, pp, vpp, m):
    schedules = build_all_ranks(name, pp, m, vpp)
    swapped = _swap_two_sends(plan_p2p(schedules, vpp), 1)
    with pytest.raises(AssertionError, match="carries"):
        replay_tag_blind(swapped)  # the k-th receive meets the wrong message
    with pytest.raises(AssertionError):
        check_plan(schedules, vpp, swapped)


def _pre_batching_plans(schedules, v):
    """The executor's order before this plan existed: a blocking receive before each action
    that needs one, then a send after it, each on its own; correct on gloo thanks to tags."""
    pp = len(schedules)
    plans = []
    for rank, actions in enumerate(schedules):
        plan = []
        for index, action in enumerate(actions):
            need = needed_message(action, rank, pp, v)
            if need is not None:
                plan.append(Batch(index, 0, (P2POp("recv", need.src_stage % pp, need),)))
            out = produced_message(action, rank, pp, v)
            if out is not None:
                plan.append(Batch(index + 1, 0, (P2POp("send", out.dst_stage % pp, out),)))
        plans.append(plan)
    return plans


@pytest.mark.parametrize("name,pp,vpp,m", [("1f1b", 4, 1, 8), ("interleaved", 2, 2, 4), ("interleaved", 4, 2, 8)])
def test_matcher_finds_the_pre_batching_deadlock(name, pp, vpp, m):
    """Rank r sends its activation to r + 1 while r + 1 sends its gradient to r: with sends
    that block until received (NCCL, large tensors) each waits for the other."""
    schedules = build_all_ranks(name, pp, m, vpp)
    plans = _pre_batching_plans(schedules, vpp)
    check_placement(schedules, vpp, plans)
    with pytest.raises(AssertionError, match="deadlock"):
        replay_tag_blind(plans)


def test_matcher_rejects_a_receive_after_its_action():
    schedules = build_all_ranks("1f1b", 2, 2, 1)
    plans = plan_p2p(schedules, 1)
    late = [
        replace(batch, before=batch.before + 1) if any(op.op == "recv" for op in batch.ops) else batch
        for batch in plans[1]
    ]
    with pytest.raises(AssertionError, match="runs before"):
        check_placement(schedules, 1, [plans[0], late])


def test_plan_rejects_inconsistent_schedules():
    schedules = list(build_all_ranks("1f1b", 2, 2, 1))
    with pytest.raises(ValueError, match="deadlock"):
        plan_p2p([schedules[0][::-1], schedules[1]], 1)  # rank 0 waits for a gradient of its last forward
    with pytest.raises(ValueError, match="never receives"):
        forwards = build_all_ranks("1f1b", 2, 2, 1, forward_only=True)
        plan_p2p([forwards[0], forwards[1][:1]], 1)  # rank 1 skips microbatch 1


# ------------------------------------------------------------------ devices of collectives


def test_collective_device_follows_the_backend(monkeypatch):
    assert collective_device() == torch.device("cpu")  # no process group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, device in [("gloo", "cpu"), ("nccl", "cuda:3"), ("cpu:gloo,cuda:nccl", "cuda:3")]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert collective_device() == torch.device(device), backend


def test_executor_refuses_cpu_messages_on_nccl(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [0, 1])
    mesh = SimpleNamespace(pp_size=2, pp_rank=0, pp="pp group")
    with pytest.raises(ValueError, match="cannot travel over the nccl backend"):
        PipelineExecutor([nn.Linear(3, 3)], mesh, (2, 1, 3), torch.float32, torch.device("cpu"))
