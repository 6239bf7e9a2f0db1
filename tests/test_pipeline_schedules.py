"""Pipeline schedules as action lists: every (microbatch, chunk) runs forward once and then
backward once, in-flight activations match each schedule's bound, and a simulated pipeline
(blocking receives, non-blocking sends) finishes without deadlock."""

from __future__ import annotations

import pytest

from meshtron.pipeline.schedules import Action, build_schedule, max_in_flight
from meshtron.pipeline.trace import measured_bubble, theoretical_bubble


def simulate(name: str, pp: int, m: int, v: int = 1) -> int:
    """Run all ranks' action lists with unit-time actions; return the makespan. Raises on deadlock."""
    plans = {r: build_schedule(name, pp, r, m, v) for r in range(pp)}
    done: dict[tuple, int] = {}  # (kind, microbatch, virtual stage) -> finish time
    clock = {r: 0 for r in range(pp)}
    position = {r: 0 for r in range(pp)}
    last = pp * v - 1
    progressed = True
    while progressed:
        progressed = False
        for r in range(pp):
            if position[r] == len(plans[r]):
                continue
            a = plans[r][position[r]]
            stage = a.chunk * pp + r
            if a.kind == "F":
                deps = [] if stage == 0 else [("F", a.microbatch, stage - 1)]
            else:
                deps = [("F", a.microbatch, stage)] + ([] if stage == last else [("B", a.microbatch, stage + 1)])
            if all(d in done for d in deps):
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = start + (1 if a.kind == "F" else 2)
                done[(a.kind, a.microbatch, stage)] = clock[r]
                position[r] += 1
                progressed = True
    stuck = {r: plans[r][position[r]] for r in range(pp) if position[r] < len(plans[r])}
    assert not stuck, f"{name} deadlocks: {stuck}"
    return max(clock.values())


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (3, 6)])
def test_each_microbatch_forward_then_backward_once(name, v, pp, m):
    for rank in range(pp):
        actions = build_schedule(name, pp, rank, m, v)
        for chunk in range(v):
            for mb in range(m):
                f = actions.index(Action("F", mb, chunk))
                b = actions.index(Action("B", mb, chunk))
                assert f < b
        assert len(actions) == 2 * m * v
    simulate(name, pp, m, v)


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8), (4, 3)])
def test_in_flight_bounds(pp, m):
    """1F1B keeps at most pp - rank microbatches alive (pp on the first stage); GPipe all m."""
    for rank in range(pp):
        assert max_in_flight(build_schedule("1f1b", pp, rank, m)) == min(pp - rank, m)
        assert max_in_flight(build_schedule("gpipe", pp, rank, m)) == m


def test_makespan_matches_bubble_formula():
    """With forward 1 and backward 2 time units, 1F1B and GPipe take (m + p - 1) * 3 units; the
    interleaved schedule with v chunks of 1/v the work shortens the fill/drain to (p - 1) / v."""
    pp, m = 4, 8
    assert simulate("gpipe", pp, m) == (m + pp - 1) * 3
    assert simulate("1f1b", pp, m) == (m + pp - 1) * 3
    # v = 2 chunks, each 1/2 of the work: in units of a full-stage microbatch the makespan is
    # m + (p - 1) / v; the simulator's chunk costs 1 and 2, i.e. half a stage.
    assert simulate("interleaved", pp, m, 2) / 2 / 3 == pytest.approx(m + (pp - 1) / 2)
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble(4, 8, 2) == pytest.approx(1.5 / 9.5)


def test_bad_schedules_are_rejected():
    with pytest.raises(ValueError, match="divisible by pp=4"):
        build_schedule("interleaved", 4, 0, 6, 2)
    with pytest.raises(ValueError, match="needs parallel.schedule=interleaved"):
        build_schedule("1f1b", 2, 0, 4, 2)
    with pytest.raises(ValueError, match="unknown"):
        build_schedule("zero-bubble", 2, 0, 4)


def test_measured_bubble_of_a_timeline():
    from meshtron.pipeline.executor import TimelineEvent

    events = [
        TimelineEvent("recv_F", 0, 0, 0.0, 1.0),
        TimelineEvent("F", 0, 0, 1.0, 2.0),
        TimelineEvent("B", 0, 0, 3.0, 5.0),
    ]
    assert measured_bubble(events) == pytest.approx(1 - 3 / 5)
