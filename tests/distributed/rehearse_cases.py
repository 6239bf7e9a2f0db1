"""A rehearsal equals the real run, rank by rank: every rank of each layout below, rehearsed
alone in one process (`meshtron.training.rehearse.rehearse`, its peers emulated) by the
parent test before the world starts, then run for real in a gloo world of 4 whose groups log
every call (`recorded_gloo`, mpu/rehearsal_groups.py), issues the same collectives and
point-to-point messages (op, group, bytes sent and received, in order) in a training step,
and peaks within 2% of the real rank's memory (fp32 CPU, tensor bytes by the profiler).

Every rank reads the same tokens (a text of one repeated byte), so every rank routes its MoE
tokens as the rehearsal assumes every peer does: the expert all-to-alls' received sizes are
then exact, not an assumption. That holds for the first MoE layer only (the values it returns
are this rank's experts' where the real peers' experts' would be, so a later layer would route
differently): the MoE model has one, its last layer, and no ZeRO (a rehearsal's parameter
all-gathers put this rank's shard in every slot: after the first update its weights are not the
real run's). And the learning rate is 1e-30 (no update changes a weight): the
rehearsal's gradients (each all-reduce leaves this rank's share) would otherwise move the
router's weights a little differently from the real run's, and with them a near tie. Layouts: tp/sp, pp (1F1B, interleaved), ep/etp, cp (ring and
all-to-all), dp with ZeRO 1-3. Run by tests/test_rehearse.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

WORLD = 4
STEPS, WARMUP = 3, 1
MEMORY_TOLERANCE = 0.02
# The real run's CPU peak can only read high: a tensor whose last reference a gloo worker
# thread drops (its finished Work) is freed on a thread the profiler does not record, so that
# free is never subtracted (seen as +32-128 KiB on random ranks, more under load). A real peak
# above the rehearsal's is measured again, by every rank together, and the lowest reading kept.
REAL_REMEASURES = 2
SMALL = [
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.seq_len=64",
    "trainer.global_batch_size=8",
    "trainer.device=cpu",
    "trainer.precision=fp32",
    "optim.lr=1e-30",  # below fp32 rounding: the weights stay the initial ones (see the module doc)
]
LAYOUTS = {
    "tp2_sp_dp2_zero1": ["parallel.tp=2", "parallel.sp=true", "optim.zero=1"],
    "pp2_1f1b_dp2": ["model.num_layers=4", "parallel.pp=2", "trainer.micro_batch_size=1"],
    "pp2_interleaved_tp2": [
        "model.num_layers=4",
        "parallel.pp=2",
        "parallel.vpp=2",
        "parallel.schedule=interleaved",
        "parallel.tp=2",
        "trainer.micro_batch_size=2",
    ],
    "moe_ep2_etp2": [
        "+model=moe_tiny",
        "model.num_layers=2",  # one MoE layer, the last: see the module doc
        "model.hidden_size=64",
        "model.moe_ffn_hidden_size=64",
        "parallel.ep=2",
        "parallel.etp=2",
    ],
    "cp2_ring_dp2_zero2": ["model.arch=llama", "parallel.cp=2", "optim.zero=2"],
    "cp2_a2a_tp2": ["model.arch=llama", "parallel.cp=2", "parallel.cp_comm=a2a", "parallel.tp=2"],
    "dp4_zero3": ["optim.zero=3"],
}


def overrides(layout: str, data_file: Path) -> list[str]:
    """train.py overrides of `layout` at the tests' small size, reading `data_file`."""
    return LAYOUTS[layout] + SMALL + [f"data.paths=[{data_file}]"]


def write_data(folder: Path) -> Path:
    """A text of one repeated byte: every rank's windows hold the same tokens."""
    path = folder / "same.txt"
    path.write_text("a" * 40_000)
    return path


def rehearse_all(folder: Path) -> None:
    """Rehearse every rank of every layout in this process; write what each issued and held."""
    from meshtron.training.cli import compose_run
    from meshtron.training.rehearse import rehearse

    data = write_data(folder)
    expected = {}
    for layout in LAYOUTS:
        run = compose_run(overrides(layout, data))
        for rank in range(WORLD):
            report = rehearse(run, WORLD, rank, steps=STEPS, warmup=WARMUP, gpus_per_node=WORLD)
            expected[f"{layout}/{rank}"] = {"calls": report["calls"], "total": report["memory_bytes"]["total"]}
    (folder / "rehearsed.json").write_text(json.dumps(expected))


def _check(layout: str) -> None:
    """This rank of `layout` run for real in the recorded world equals its rehearsal."""
    import torch.distributed as dist

    from meshtron.training.cli import compose_run
    from meshtron.training.rehearse import measure_rank, prepare

    folder = Path(os.environ["MESHTRON_REHEARSAL_DIR"])
    rank = dist.get_rank()
    want = json.loads((folder / "rehearsed.json").read_text())[f"{layout}/{rank}"]
    prepared = prepare(compose_run(overrides(layout, folder / "same.txt")), WORLD, WORLD)
    report = measure_rank(prepared, WORLD, rank, steps=STEPS, warmup=WARMUP, gpus_per_node=WORLD)
    got = report["calls"]
    for i, (g, w) in enumerate(zip(got, want["calls"], strict=False)):
        assert g == w, f"rank {rank} call {i}: real {g} rehearsed {w}"
    assert len(got) == len(want["calls"]), (
        f"rank {rank}: real run issued {len(got)} calls, rehearsal {len(want['calls'])}"
    )
    real, rehearsed = report["memory_bytes"]["total"], want["total"]
    for _ in range(REAL_REMEASURES):
        if not _any_rank(real > (1 + MEMORY_TOLERANCE) * rehearsed):
            break
        again = measure_rank(prepared, WORLD, rank, steps=STEPS, warmup=WARMUP, gpus_per_node=WORLD)
        real = min(real, again["memory_bytes"]["total"])
    assert rehearsed > 0 and real > 0, (rehearsed, real)
    assert abs(rehearsed - real) <= MEMORY_TOLERANCE * real, (
        f"rank {rank}: rehearsed peak {rehearsed:,} B vs real {real:,} B ({rehearsed / real - 1:+.2%})"
    )


def _any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on one (a max over the world): the ranks measure
    again together, or not at all."""
    import torch
    import torch.distributed as dist

    from meshtron.mpu.mappings import all_reduce_stats

    return bool(all_reduce_stats(torch.tensor([float(flag)]), dist.group.WORLD, op="max").item())


def _case(layout: str):
    def case() -> None:
        _check(layout)

    case.__name__ = layout
    return case


for _layout in LAYOUTS:
    globals()[_layout] = _case(_layout)

CASES = list(LAYOUTS)
