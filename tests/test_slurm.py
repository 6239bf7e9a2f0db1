"""Slurm (issue 17): hydra-submitit-launcher presets run end to end with submitit's local
executor (2 tasks per sweep point form one process group, losses equal one process's, a bad
point fails without hanging); the mapping of a submitit JobEnvironment onto torchrun's
variables (multi-node, faked); and examples/slurm/train.sbatch (valid bash, its torchrun line
parses with torchrun's own parser)."""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron.errors import ConfigError
from meshtron.training.distributed import launcher_env, submitit_torch_env

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
# Tiny and short, as tests/test_sweeps.py: one layer, two steps, a 1 MB slice of the default text.
COMMON = [
    "trainer.max_steps=2",
    "trainer.progress=false",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "model.num_layers=1",
    "data.max_bytes=1000000",
]


def run(args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class FakeJobEnvironment:
    """What submitit.JobEnvironment reports for task `global_rank` of a 2-node x 4-task job."""

    def __init__(self, global_rank: int, num_nodes: int = 2, num_tasks: int = 8, job_id: str = "77_3"):
        self.global_rank, self.num_nodes, self.num_tasks, self.job_id = global_rank, num_nodes, num_tasks, job_id
        per_node = num_tasks // max(1, num_nodes)
        self.local_rank, self.node = global_rank % per_node, global_rank // per_node
        self.hostnames = ["gpu017", "gpu018"]


def test_submitit_env_maps_onto_torchrun_variables(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    port = str(random.Random("77_3").randint(20000, 60000))
    assert submitit_torch_env(FakeJobEnvironment(5)) == {
        "WORLD_SIZE": "8",
        "RANK": "5",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "gpu017",
        "MASTER_PORT": port,
    }
    # every task of the job derives the same port; another job (sweep point) most likely another
    assert {submitit_torch_env(FakeJobEnvironment(r))["MASTER_PORT"] for r in range(8)} == {port}
    assert submitit_torch_env(FakeJobEnvironment(0, job_id="77_4"))["MASTER_PORT"] != port
    # the same address and port as submitit's own helper computes
    import submitit.helpers

    monkeypatch.setattr(submitit.helpers, "JobEnvironment", lambda: FakeJobEnvironment(5))
    helper = submitit.helpers.TorchDistributedEnvironment()
    assert (helper.master_addr, str(helper.master_port), helper.local_world_size) == ("gpu017", port, 4)
    monkeypatch.setenv("MASTER_PORT", "29999")  # a port the job script chose wins
    assert submitit_torch_env(FakeJobEnvironment(5))["MASTER_PORT"] == "29999"
    with pytest.raises(ConfigError, match="submitit job runs 7 tasks on 2 nodes: give every node the same"):
        submitit_torch_env(FakeJobEnvironment(0, num_tasks=7))


def test_launcher_env_reads_a_slurm_task_of_submitit(monkeypatch):
    """Inside a submitit Slurm task (SUBMITIT_EXECUTOR=slurm, Slurm's variables, no torchrun)
    launcher_env exports torchrun's variables, the first host of the node list as MASTER_ADDR;
    under torchrun (WORLD_SIZE set) torchrun's values stay."""
    slurm = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "8",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "6",
        "SLURM_LOCALID": "2",
        "SLURM_JOB_NODELIST": "gpu[017-018]",
    }
    monkeypatch.setattr(os, "environ", {"PATH": os.environ.get("PATH", ""), **slurm})
    assert launcher_env() == (8, 6, 2, 4)
    assert (os.environ["RANK"], os.environ["GROUP_RANK"], os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == (
        "6",
        "1",
        "gpu017",
        str(random.Random("4242").randint(20000, 60000)),
    )
    monkeypatch.setattr(os, "environ", {**slurm, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"})
    assert launcher_env() == (2, 1, 1, 2) and "MASTER_ADDR" not in os.environ


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory) -> list[float]:
    run_dir = tmp_path_factory.mktemp("single")
    out = run([sys.executable, "train.py", *COMMON, f"hydra.run.dir={run_dir}"], timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return losses(run_dir)


@pytest.mark.distributed
@pytest.mark.timeout(360)
def test_submitit_local_sweep_two_tasks_per_point(tmp_path, single_process_losses):
    """hydra/launcher=slurm_local with 2 tasks per point: tp=1 (dp=2) and tp=2 each run as one
    2-rank process group and give one process's losses; tp=3 cannot split 2 ranks, so its job
    fails at once and the sweep exits non-zero with the point's one-line error."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs `pip install -e '.[slurm]'`")
    sweep_dir = tmp_path / "sweep"
    out = run(
        [
            sys.executable,
            "train.py",
            "-m",
            "hydra/launcher=slurm_local",
            "hydra.launcher.tasks_per_node=2",
            "hydra.launcher.timeout_min=5",
            "parallel.tp=1,2,3",
            *COMMON,
            f"hydra.sweep.dir={sweep_dir}",
        ],
        timeout=330,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "UncompletedJobError" in out.stderr
    assert (
        "meshtron: configuration error: world size 2 is not divisible by tp*pp=3 (tp=3, pp=1); "
        "change parallel.tp/parallel.pp or the number of processes"
    ) in out.stderr
    assert not (sweep_dir / "2" / "metrics.jsonl").exists()
    for job, layout in ((0, "dp=2 tp=1"), (1, "dp=1 tp=2")):
        assert losses(sweep_dir / str(job)) == pytest.approx(single_process_losses, rel=0, abs=1e-6)
        [job_dir] = [
            d
            for d in (sweep_dir / ".submitit").iterdir()
            if d.name.isdigit()  # not "%j"
            and f"run dir {sweep_dir / str(job)}" in (d / f"{d.name}_0_log.out").read_text()
        ]
        rank0, rank1 = ((job_dir / f"{job_dir.name}_{task}_log.out").read_text() for task in (0, 1))
        assert f"meshtron: rank 0/2: dense pp=1 {layout}" in rank0 and "rank 1/2" not in rank0
        assert "global_rank=1(2)" in rank1  # the second task of the same job: one group of 2


def test_sbatch_example_is_valid_bash_and_its_torchrun_line_parses(tmp_path, monkeypatch):
    out = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    # DRY_RUN prints the command; a fake scontrol expands the node list as Slurm's would.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\n[ "$1 $2 $3" = "show hostnames gpu[017-018]" ] && printf "gpu017\\ngpu018\\n"\n'
    )
    (bin_dir / "scontrol").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DRY_RUN": "1",
        "SLURM_JOB_NODELIST": "gpu[017-018]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_GPUS_ON_NODE": "4",
    }
    out = run(["bash", str(SBATCH), "+model=gpt_1b", "parallel.tp=4"], timeout=30, env=env)
    assert out.returncode == 0, out.stderr
    cmd = shlex.split(out.stdout)
    assert cmd[:3] == ["python", "-m", "torch.distributed.run"]
    from torch.distributed.run import config_from_args, get_args_parser

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args sets it when absent
    args = get_args_parser().parse_args(cmd[3:])
    config, _, script_args = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 4)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("c10d", "gpu017:29500", "4242")
    assert script_args == ["-u", "train.py", "hydra.run.dir=outputs/slurm-4242", "+model=gpt_1b", "parallel.tp=4"]


@pytest.mark.parametrize(
    "preset, overrides, expected, absent",
    [
        (
            "slurm_gpu",
            ["hydra.launcher.nodes=2", "hydra.launcher.partition=gpu"],
            [
                "--nodes=2",
                "--gpus-per-node=8",
                "--ntasks-per-node=8",
                "--cpus-per-task=8",
                "--partition=gpu",
                "--time=240",
            ],
            ["--mem"],
        ),
        (
            "slurm_cpu",
            ["hydra.launcher.mem_gb=64"],
            ["--nodes=1", "--ntasks-per-node=4", "--cpus-per-task=4", "--mem=64GB"],
            ["--gpus-per-node", "--partition"],
        ),
    ],
)
def test_slurm_presets_write_the_sbatch_script(tmp_path, monkeypatch, preset, overrides, expected, absent):
    """The plugin's own launch() with a preset, stopped at submission: the #SBATCH lines it
    would submit (one task per GPU: --ntasks-per-node = --gpus-per-node). submitit wants an
    srun on PATH to believe it is on a cluster; a stub stands in."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs `pip install -e '.[slurm]'`")
    import submitit
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate

    (tmp_path / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    scripts = []
    monkeypatch.setattr(
        submitit.AutoExecutor,
        "map_array",
        lambda self, *args: scripts.append(self._executor._make_submission_file_text("CMD", "uid")) or [],
    )
    with initialize_config_module(config_module="meshtron.configs", version_base="1.3"):
        cfg = compose(
            config_name="train",
            return_hydra_config=True,
            overrides=[f"hydra/launcher={preset}", f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides],
        )
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    assert launcher.launch([["parallel.tp=1"]], initial_job_idx=0) == []
    [script] = scripts
    sbatch = {line.split()[1] for line in script.splitlines() if line.startswith("#SBATCH")}
    assert set(expected) <= sbatch, sbatch
    assert not any(line.startswith(tuple(absent)) for line in sbatch), sbatch
    assert "export SUBMITIT_EXECUTOR=slurm" in script and "\nsrun " in script  # what launcher_env keys on
