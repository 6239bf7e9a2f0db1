"""Parameter-server training (parallel.dp_mode=ps, training/param_server.py).

In the 4-rank world (tests/distributed/ps_cases.py): bsp and ssp(s=0) equal all-reduce DP,
tp=2+sp workers and MoE tp=2 workers (ep=2, ep=1) with two servers equal the replicated
AdamW, ssp blocks a fast worker at
exactly s steps ahead of a slowed one while asp does not, asp trains within its margin of bsp.
Here: the configuration errors (one line, before any process group), the shard arithmetic,
and end to end under torchrun: the issue's ssp command trains the default tiny model and logs
staleness and per-role memory; a SIGKILLed worker leaves the servers' last checkpoint intact
and a resumed bsp run continues with the interrupted run's losses bit for bit.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from meshtron.errors import ConfigError
from meshtron.training.config import RunConfig
from meshtron.training.param_server import KILL_ENV, check_ps_run, latest_complete, shard_range
from tests.distributed.registry import WORLD_TIMEOUT_S, assert_case_passed, params
from tests.test_train_cli import TORCHRUN, metrics, run


@pytest.mark.distributed
@pytest.mark.timeout(WORLD_TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size,case", params("tests.distributed.ps_cases"))
def test_parameter_server_cases(world_size: int, case: str) -> None:
    assert_case_passed(world_size, case)


def _config(**sections) -> RunConfig:
    tree = {"parallel": {"dp_mode": "ps", "servers": 1}}
    for key, values in sections.items():
        tree.setdefault(key, {}).update(values)
    return RunConfig.from_dict(tree)


@pytest.mark.parametrize(
    "tree,message",
    [
        ({"optim": {"sync": "ssp"}}, "optim.sync=ssp needs parameter servers (parallel.dp_mode=ps"),
        ({"optim": {"sync": "asp"}}, "optim.sync=asp needs parameter servers"),
        ({"optim": {"staleness": 2}}, "optim.staleness=2 applies only to optim.sync=ssp (got optim.sync=bsp)"),
        ({"parallel": {"servers": 2}}, "parallel.servers=2 needs parallel.dp_mode=ps"),
        ({"parallel": {"dp_mode": "ps"}}, "parallel.dp_mode=ps needs parallel.servers >= 1"),
        ({"parallel": {"dp_mode": "sharded"}}, "parallel.dp_mode='sharded' must be one of allreduce, ps"),
    ],
)
def test_bad_ps_keys_are_one_line_config_errors(tree, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(tree)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "sections,world,message",
    [
        ({"parallel": {"pp": 2}, "model": {"num_layers": 2}}, 5, "parallel.pp=2 with parallel.dp_mode=ps"),
        ({"optim": {"zero": 1}}, 3, "optim.zero=1 with parallel.dp_mode=ps: the servers already shard"),
        ({"optim": {"offload": True}}, 3, "optim.offload=true with parallel.dp_mode=ps"),
        ({"trainer": {"precision": "fp16"}}, 3, "trainer.precision=fp16 with parallel.dp_mode=ps"),
        ({}, 1, "parallel.servers=1 leaves no worker rank in world size 1"),
        ({"parallel": {"tp": 2}}, 4, "not divisible by tp*pp=2"),
        ({"trainer": {"global_batch_size": 3}}, 3, "global"),
    ],
)
def test_unsupported_ps_layouts_are_refused(sections, world, message):
    with pytest.raises(ConfigError) as err:
        check_ps_run(_config(**sections), world)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_ps_layout_of_workers_and_servers():
    worker_par, workers, per_worker, micro = check_ps_run(_config(parallel={"tp": 2, "servers": 2}), 6)
    assert (workers, per_worker, micro) == (2, 2, 8)
    assert (worker_par.tp, worker_par.dp, worker_par.dp_mode, worker_par.servers) == (2, 1, "allreduce", 0)
    ranges = [shard_range(10, 3, s) for s in range(3)]
    assert ranges == [(0, 4), (4, 8), (8, 10)]
    assert shard_range(2, 3, 2) == (2, 2)  # more servers than elements: an empty range


def test_ps_single_process_is_one_line_exit_2(tmp_path):
    out = run(
        [sys.executable, "train.py", "parallel.dp_mode=ps", "parallel.servers=1", f"hydra.run.dir={tmp_path}"],
        timeout=100,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("meshtron: configuration error")]
    assert len(lines) == 1 and "leaves no worker rank in world size 1" in lines[0], out.stderr[-3000:]


SMALL = ["trainer.log_every=1", "trainer.progress=false", "data.max_bytes=2000000", "trainer.eval_every=0"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torchrun_ssp_trains_default_model_and_logs_staleness_and_memory(tmp_path):
    """The issue's command (3 processes: 1 server, 2 workers, ssp s=2) on the default tiny model."""
    out = run(
        [
            *TORCHRUN,
            "--nproc_per_node=3",
            "train.py",
            "parallel.dp_mode=ps",
            "parallel.servers=1",
            "optim.sync=ssp",
            "optim.staleness=2",
            "trainer.max_steps=12",
            *SMALL,
            f"hydra.run.dir={tmp_path}",
        ],
        timeout=280,
        threads=1,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 13))
    last = records[-1]
    assert 0 < last["staleness_max"] <= 2 and 0 < last["staleness_mean"] <= 2, last
    assert last["server_state_bytes"] > 0 and last["worker_state_bytes"] > 0, last
    # (this text has a hard batch at step 9 that bsp and all-reduce DP spike on too)
    assert records[-1]["loss"] < records[0]["loss"] - 0.5, [r["loss"] for r in records]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_killed_worker_leaves_server_state_resumable(tmp_path):
    """bsp, 1 server + 2 workers, checkpoint every 2 steps; worker 1 is SIGKILLed at the start
    of step 4 (0-based 3): the run fails, ps_step_2 is complete and loadable; resuming from it
    logs steps 3..6, step 3's loss equal (bit for bit) to the interrupted run's step 3."""
    ckpt = tmp_path / "ckpt"
    common = [
        "parallel.dp_mode=ps",
        "parallel.servers=1",
        "trainer.max_steps=6",
        "model.num_layers=2",
        "model.hidden_size=64",
        *SMALL,
        f"checkpoint.dir={ckpt}",
        "checkpoint.every=2",
    ]
    first = tmp_path / "first"
    out = run(
        [*TORCHRUN, "--nproc_per_node=3", "train.py", *common, f"hydra.run.dir={first}"],
        timeout=200,
        threads=1,
        env={KILL_ENV: "1:3"},
    )
    assert out.returncode != 0, out.stdout[-2000:]
    assert latest_complete(ckpt, 1) == ckpt / "ps_step_2", sorted(p.name for p in ckpt.iterdir())
    state = torch.load(ckpt / "ps_step_2" / "server_0_of_1.pt", weights_only=False)
    assert state["version"] == 2 and state["step"] == 2 and torch.isfinite(state["params"][0]).all()
    interrupted = {r["step"]: r["loss"] for r in metrics(first)}
    assert set(interrupted) >= {1, 2, 3}, interrupted
    second = tmp_path / "second"
    out = run(
        [*TORCHRUN, "--nproc_per_node=3", "train.py", *common, "checkpoint.resume=auto", f"hydra.run.dir={second}"],
        timeout=200,
        threads=1,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = {r["step"]: r["loss"] for r in metrics(second)}
    assert sorted(resumed) == [3, 4, 5, 6], resumed
    assert resumed[3] == interrupted[3], (resumed, interrupted)
    assert latest_complete(ckpt, 1) == ckpt / "ps_step_6"


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_ps_dry_run_reports_per_role_memory(tmp_path):
    """3 processes = 1 worker + 2 servers (ssp s=1): the servers' elements add up to the
    worker's parameters; bytes are 12/element for params + moments, 4/element per buffered
    gradient (workers x (s+1)) and per snapshot (s)."""
    out = run(
        [
            *TORCHRUN,
            "--nproc_per_node=3",
            "train.py",
            "parallel.dp_mode=ps",
            "parallel.servers=2",
            "optim.sync=ssp",
            "optim.staleness=1",
            "trainer.dry_run=true",
            f"hydra.run.dir={tmp_path}",
        ],
        timeout=180,
        threads=1,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    servers, workers = plan["roles"]["servers"], plan["roles"]["worker_ranks"]
    assert len(servers) == 2 and len(workers) == 1 and servers[0]["elements"] > 0
    assert sum(s["elements"] for s in servers) == sum(w["parameters"] for w in workers)
    for s in servers:
        n = s["elements"]
        got = (s["params_and_moments_bytes"], s["buffered_gradient_bytes"], s["snapshot_bytes"])
        assert got == (12 * n, 8 * n, 4 * n), s
    assert "[dry run] server 0:" in out.stdout


class _NoChannel:
    """The server's P2P channel, for a server driven by hand: sends complete at once."""

    class _Done:
        def wait(self) -> None:
            pass

    def isend(self, tensor, rank, tag):
        return self._Done()


def test_asp_learning_rate_of_every_update_exactly():
    """asp: the server applies each worker's gradient as its own AdamW step at
    lr_at(updates // W) (module doc), whatever the order the W=3 workers' pushes arrive in.
    One server driven by hand with 9 pushes in an uneven order, warm-up 4 of 8 steps (so the
    learning rate changes every step index): the lr of every update equals the schedule at
    update // 3, and the parameters equal the same AdamW stepped with exactly those lrs,
    bit for bit."""
    from meshtron.dp.adamw import adamw
    from meshtron.training import param_server as ps
    from meshtron.training.reporting import lr_schedule

    run = _config(
        parallel={"dp_mode": "ps", "servers": 1},
        optim={"sync": "asp", "lr": 1e-2, "warmup_steps": 4, "weight_decay": 0.1},
        trainer={"max_steps": 8, "max_grad_norm": 1.0},
    )
    schedule = lr_schedule(run)
    W, n = 3, 5
    server = ps.ParameterServer(run, ps.Roles(W, 1, 1), 0, None, schedule, _NoChannel())
    init = torch.linspace(-1.0, 1.0, n)
    server.params = [init.clone()]
    view = torch.nn.Parameter(server.params[0][:])
    server.pieces = [[(0, n, view)]]
    server.optimizer = adamw([{"params": [view], "weight_decay": 0.1}], lr=run.optim.lr)
    server.answered = [0] * W
    ref = torch.nn.Parameter(init.clone())
    ref_opt = adamw([{"params": [ref], "weight_decay": 0.1}], lr=run.optim.lr)

    seen = []
    step_of_optimizer = server.optimizer.step

    def recording_step():
        seen.append([g["lr"] for g in server.optimizer.param_groups])
        return step_of_optimizer()

    server.optimizer.step = recording_step
    order = [0, 0, 1, 2, 0, 1, 1, 2, 0]  # worker 0 runs ahead, worker 2 lags
    steps = [0] * W
    for u, w in enumerate(order):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(u)) * 0.01
        header = torch.zeros(ps.HEADER, dtype=torch.float64)
        header[ps.P_KIND], header[ps.P_STEP], header[ps.P_VERSION] = ps.PUSH, steps[w], server.version
        header[ps.P_FINITE], header[ps.P_NORM], header[ps.P_LOSS] = 1.0, 0.5, 1.0  # norm < max: no clipping
        server._asp_push(w, 0, steps[w], header, grad.clone())
        steps[w] += 1
        want_lr = schedule(u // W)
        assert seen[-1] == [want_lr], (u, seen[-1], want_lr)
        for g in ref_opt.param_groups:
            g["lr"] = want_lr
        ref.grad = grad
        ref_opt.step()
        assert torch.equal(server.params[0], ref.detach()), u
    assert server.version == len(order)
    assert len({lr for (lr,) in seen}) == 3  # the schedule moved: the check can fail
