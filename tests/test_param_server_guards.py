"""Parameter-server runs (parallel.dp_mode=ps) have the all-reduce path's guards (issue 41):
SIGTERM makes the servers save a complete ps_step_N and the run stop; shards carry CRC32s
checked before any process group (a flipped bit or a truncated shard is one line, exit 2;
resume=auto skips a corrupt newest one with a warning); a changed parallel.servers, head
count or checkpoint kind is refused with one line naming the setting; the checkpoint-dir
lock is taken; non-finite steps are announced and stop the run after trainer.max_skipped; a
dead server is one line naming it. Every run: 1 server + 2 workers on a 1-layer model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshtron.training.param_server import KILL_SERVER_ENV
from tests.test_dead_peer import free_port
from tests.test_train_cli import ROOT, TORCHRUN, metrics, run

pytestmark = pytest.mark.serial  # servers and workers race against deadlines and signals

COMMON = [
    "parallel.dp_mode=ps",
    "parallel.servers=1",
    "model.num_layers=1",
    "model.hidden_size=32",
    "trainer.global_batch_size=4",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "data.max_bytes=200000",
]
NO_GROUP = {  # three ranks announced, no process group can form (port 1): checks before any group
    "WORLD_SIZE": "3",
    "RANK": "0",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "3",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "1",
}


def _torchrun(args: list[str], tmp: Path, env: dict | None = None, nproc: int = 3):
    """torchrun of train.py on one node."""
    cmd = [*TORCHRUN, f"--nproc_per_node={nproc}", "train.py", *COMMON, *args, f"hydra.run.dir={tmp}"]
    return run(cmd, 60, env, 1)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("meshtron: ") and "warning" not in line]


def _refused_before_group(tmp: Path, args: list[str], message: str, extra=COMMON, env=NO_GROUP) -> str:
    out = run([sys.executable, "train.py", *extra, *args, f"hydra.run.dir={tmp}"], 60, env, 1)
    lines = _error_lines(out.stderr)
    assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr[-3000:]
    return out.stderr


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[Path, int, str]:
    """A bsp run (checkpoint every step, keep 2) stopped by SIGTERM to torchrun: (checkpoint
    dir, the step it stopped after, its stdout)."""
    tmp = tmp_path_factory.mktemp("stopped")
    ckpt, run_dir = tmp / "ckpt", tmp / "run"
    args = [*COMMON, "trainer.max_steps=100000", f"checkpoint.dir={ckpt}", "checkpoint.every=1", "checkpoint.keep=2"]
    proc = subprocess.Popen(
        [*TORCHRUN, "--nproc_per_node=3", "train.py", *args, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while not ((run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # to the torchrun agent, which forwards it to all three ranks
    stdout, stderr = proc.communicate(timeout=60)
    step = max(r["step"] for r in metrics(run_dir))
    assert step < 100000 and f"SIGTERM: stopped after step {step}" in stdout, (stdout[-2000:], stderr[-2000:])
    return ckpt, step, stderr


@pytest.mark.timeout(120)
def test_sigterm_makes_the_servers_save_and_stop(stopped):
    ckpt, step, stderr = stopped
    folders = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("ps_step_"))
    assert folders == sorted([f"ps_step_{step - 1}", f"ps_step_{step}"]), folders  # keep=2: the newest is the stop's
    saved = json.loads((ckpt / f"ps_step_{step}" / "server_0_of_1.json").read_text())
    assert saved["step"] == step and saved["servers"] == 1 and len(saved["file"]["crc32"]) == 8
    assert "param_server.py" not in stderr, stderr[-3000:]  # torchrun reports the signal; no rank fails


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["bitflip", "truncate"])
def test_damaged_shard_is_one_line_before_any_group(tmp_path, stopped, damage):
    ckpt, step, _ = stopped
    folder = tmp_path / f"ps_step_{step}"
    shutil.copytree(ckpt / f"ps_step_{step}", folder)
    shard = folder / "server_0_of_1.pt"
    data = bytearray(shard.read_bytes())
    if damage == "bitflip":
        data[len(data) // 2] ^= 0x40  # same size: only the checksum can tell
        message = f"checkpoint file {shard} is corrupt: its CRC32 is"
    else:
        data = data[:1000]
        message = f"checkpoint file {shard} has 1000 bytes"
    shard.write_bytes(bytes(data))
    _refused_before_group(tmp_path / "run", [f"checkpoint.resume={folder}"], message)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args,message",
    [
        (["parallel.servers=2"], "saved with parallel.servers=1 but this run has parallel.servers=2"),
        (["model.num_heads=2"], "saved for another model (model.num_heads 4 -> 2, model.num_kv_heads 4 -> 2)"),
    ],
    ids=["servers", "heads"],
)
def test_changed_layout_or_model_is_refused_with_the_setting(tmp_path, stopped, args, message):
    ckpt, _, _ = stopped
    env_world = ["checkpoint.resume=auto", f"checkpoint.dir={ckpt}", *args]
    before = _snapshot(ckpt)
    if "parallel.servers=2" in args:  # 4 processes: 2 workers + 2 servers
        NO_GROUP_4 = dict(NO_GROUP, WORLD_SIZE="4", LOCAL_WORLD_SIZE="4")
        out = run([sys.executable, "train.py", *COMMON, *env_world, f"hydra.run.dir={tmp_path}"], 60, NO_GROUP_4, 1)
        lines = _error_lines(out.stderr)
        assert out.returncode == 2 and len(lines) == 1 and message in lines[0], out.stderr[-3000:]
    else:
        _refused_before_group(tmp_path, env_world, message)
    assert _snapshot(ckpt) == before


@pytest.mark.timeout(60)
def test_checkpoint_kinds_are_named(tmp_path, stopped):
    ckpt, step, _ = stopped
    folder = ckpt / f"ps_step_{step}"
    _refused_before_group(  # an all-reduce run given a ps checkpoint: not "an unfinished save"
        tmp_path / "a",
        [f"checkpoint.resume={folder}"],
        f"{folder} is a parameter-server checkpoint (ps_step_N of parallel.dp_mode=ps)",
        extra=[c for c in COMMON if not c.startswith("parallel.")] + ["trainer.max_steps=1"],
        env={},  # one process
    )
    fake = tmp_path / "step_00000002"  # a ps run given an all-reduce checkpoint
    fake.mkdir()
    (fake / "meshtron.json").write_text("{}")
    _refused_before_group(tmp_path / "b", [f"checkpoint.resume={fake}"], f"{fake} is an all-reduce checkpoint")


@pytest.mark.timeout(90)
def test_corrupt_newest_is_skipped_and_non_finite_steps_stop_at_max_skipped(tmp_path, stopped):
    """resume=auto skips the corrupt newest shard with a warning and loads the previous one;
    a huge lr makes the weights overflow: each non-finite step is announced and the run stops
    after trainer.max_skipped=1 in a row (exit != 0, one line), saving nothing."""
    ckpt, step, _ = stopped
    mine = tmp_path / "ckpt"
    shutil.copytree(ckpt, mine)
    newest = mine / f"ps_step_{step}" / "server_0_of_1.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    before = _snapshot(mine)
    out = _torchrun(
        [
            f"checkpoint.dir={mine}",
            "checkpoint.resume=auto",
            "optim.lr=1e30",
            "optim.warmup_steps=0",
            "trainer.max_skipped=1",
            f"trainer.max_steps={step + 20}",
        ],
        tmp_path / "run",
        nproc=2,  # one worker
    )
    assert out.returncode != 0, out.stdout[-2000:]
    assert f"skipping checkpoint {mine / f'ps_step_{step}'}" in out.stderr, out.stderr[-3000:]
    assert f"resuming from the previous checkpoint {mine / f'ps_step_{step - 1}'}" in out.stderr
    assert f"starting at step {step - 1}" in out.stdout, out.stdout[-2000:]
    assert "skipped: non-finite loss or gradient norm (1 in a row, 1 in total)" in out.stdout, out.stdout[-2000:]
    lines = [line for line in out.stderr.splitlines() if "consecutive steps had a non-finite" in line]
    assert len(lines) == 1 and "trainer.max_skipped=1" in lines[0], out.stderr[-3000:]
    assert _snapshot(mine) == before  # nothing saved over the intact or the corrupt one


@pytest.mark.timeout(60)
def test_second_run_on_a_locked_dir_is_refused(tmp_path, stopped):
    from meshtron.training.checkpoint import LOCK_FILE, _process_start

    ckpt, _, _ = stopped
    mine = tmp_path / "ckpt"
    shutil.copytree(ckpt, mine)
    holder = {
        "pid": os.getpid(),  # this test: a live run on this host
        "pid_start": _process_start(os.getpid()),
        "host": socket.gethostname(),
        "started": "now",
    }
    (mine / LOCK_FILE).write_text(json.dumps(holder))
    before = _snapshot(mine)
    out = _torchrun([f"checkpoint.dir={mine}", "trainer.max_steps=3"], tmp_path / "run", nproc=2)  # 1 worker
    assert out.returncode != 0, out.stdout[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("meshtron: checkpoint error")]
    assert lines and all(f"checkpoint.dir {mine} is in use by another run" in x for x in lines), out.stderr[-3000:]
    assert _snapshot(mine) == before and not (tmp_path / "run" / "metrics.jsonl").exists()


def _one_rank_per_node(args: list[str], tmp: Path, env: dict, world: int, timeout: float) -> list[tuple[int, str]]:
    """train.py with each rank its own "node" (no torchrun agent that would SIGTERM the
    survivors when one rank dies, as an agent on another node would not): (returncode,
    stderr) per rank; ranks still alive after `timeout` are killed and reported as -9."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        rank_env = dict(os.environ, OMP_NUM_THREADS="1", HYDRA_FULL_ERROR="1", **env)
        rank_env.update(
            WORLD_SIZE=str(world), RANK=str(rank), GROUP_RANK=str(rank), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1"
        )
        rank_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, "train.py", *COMMON, *args, f"hydra.run.dir={tmp}"]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=rank_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )
    results, deadline = [], time.monotonic() + timeout
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        results.append((proc.returncode, err))
    return results


@pytest.mark.timeout(90)
def test_dead_server_is_one_line_naming_it(tmp_path):
    # worker on rank 0, server on rank 1, as on two nodes: the worker alone must learn of it
    (code, stderr), (server_code, server_err) = _one_rank_per_node(
        ["trainer.max_steps=6"], tmp_path, {KILL_SERVER_ENV: "0:2"}, 2, 70
    )
    assert server_code == -signal.SIGKILL, server_err[-3000:]  # the hook killed it
    assert code == 1, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("meshtron: parameter server")]
    assert len(lines) == 1, stderr[-3000:]
    expected = "parameter server 0 (global rank 1) is gone during the exchange of step 2 (connection closed by peer)"
    assert all(expected in x for x in lines), lines
    assert "param_server.py" not in stderr, stderr[-3000:]  # no traceback through meshtron
