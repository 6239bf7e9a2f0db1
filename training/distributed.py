"""Process-group setup and teardown for a run, and agreement on one run directory.

Under torchrun every rank runs Hydra, and Hydra names the run dir from each rank's clock,
which can differ by a second between ranks. `agree_on_run_dir` makes every rank use rank
0's directory and removes a rank's own stray directory when it holds nothing but Hydra's
bookkeeping.

Hydra multirun under torchrun runs several jobs in one process, each with its own default
process group. torch names every default group "0" under the prefix "default_pg" of the
launcher's store, so a second group read the first one's stale gloo addresses ("Gloo
connectFullMesh: connection refused"). `init_distributed` therefore opens the launcher's
store once per process and gives each job a fresh key prefix over it, which also names
torchrun's restart (TORCHELASTIC_RESTART_COUNT) and the world size: torchrun's store outlives
the workers it restarts, and a restarted worker read the previous attempt's gloo addresses.

At startup every rank's host and process identity are gathered (with the node list) and
registered (`mpu.waits.register_peers`), so a collective failure can name the ranks of this
host that died, whatever the transport (observability/watchdog.py).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from meshtron.errors import ConfigError
from meshtron.mpu import shm_collectives
from meshtron.mpu.mappings import broadcast_object, gather_object, world_group
from meshtron.mpu.waits import process_identity, register_peers


@dataclass
class DistEnv:
    """Where this process sits: world size, ranks from the launcher, and its device."""

    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    device: torch.device
    num_nodes: int = 1  # nodes (torchrun agents) of local_world_size ranks each, checked by `check_nodes`

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def submitit_torch_env(job_env: submitit.JobEnvironment) -> dict[str, str]:  # noqa: F821 (imported lazily)
    """torchrun's variables for one task of a submitit job (one task per GPU, e.g. Hydra's
    `hydra/launcher=slurm_gpu` or `slurm_local`), from a `submitit.JobEnvironment`: ranks as
    Slurm (or the local executor) numbers them, rendezvous on the first host at MASTER_PORT if
    set, else at a port derived from the job id as `submitit.helpers.TorchDistributedEnvironment`
    does (every task of a job derives the same one; sweep points, being jobs of their own, differ)."""
    import random

    if job_env.num_tasks % job_env.num_nodes:
        raise ConfigError(
            f"submitit job runs {job_env.num_tasks} tasks on {job_env.num_nodes} nodes: "
            f"give every node the same hydra.launcher.tasks_per_node"
        )
    port = os.environ.get("MASTER_PORT") or str(random.Random(job_env.job_id).randint(20000, 60000))
    return {
        "WORLD_SIZE": str(job_env.num_tasks),
        "RANK": str(job_env.global_rank),
        "LOCAL_RANK": str(job_env.local_rank),
        "LOCAL_WORLD_SIZE": str(job_env.num_tasks // job_env.num_nodes),
        "GROUP_RANK": str(job_env.node),
        "MASTER_ADDR": job_env.hostnames[0],
        "MASTER_PORT": port,
    }


def launcher_env() -> tuple[int, int, int, int]:
    """(world, rank, local_rank, local_world) from torchrun's variables; (1, 0, 0, 1) without.
    In a submitit task not started by torchrun (SUBMITIT_EXECUTOR set, no WORLD_SIZE), first
    exports `submitit_torch_env` into os.environ, where env:// rendezvous reads MASTER_ADDR/PORT."""
    if "WORLD_SIZE" not in os.environ and os.environ.get("SUBMITIT_EXECUTOR"):
        import submitit  # present: SUBMITIT_EXECUTOR is set by submitit's own job script

        os.environ.update(submitit_torch_env(submitit.JobEnvironment()))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return world, rank, local_rank, local_world


def resolve_device(preference: str, local_rank: int) -> torch.device:
    """auto -> cuda:<local_rank> when CUDA is available, else cpu; cuda without CUDA is an error."""
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device=cuda but CUDA is not available; use trainer.device=cpu or auto")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_preference: str, timeout_s: float = 300.0, num_threads: int | None = None) -> DistEnv:
    """Initialize the default process group when launched with WORLD_SIZE > 1 (NCCL on CUDA,
    gloo on CPU) and set the CPU thread count (cores shared by the local processes)."""
    world, rank, local_rank, local_world = launcher_env()
    device = resolve_device(device_preference, local_rank)
    if num_threads is None and "OMP_NUM_THREADS" not in os.environ:
        num_threads = max(1, (os.cpu_count() or 1) // local_world)
    if num_threads:
        torch.set_num_threads(num_threads)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        timeout = datetime.timedelta(seconds=timeout_s)
        shm_collectives.set_timeout(timeout_s)  # CPU collectives through shared memory fail alike
        dist.init_process_group(
            backend, store=_job_store(rank, world, timeout), rank=rank, world_size=world, timeout=timeout, **kwargs
        )
        _release_at_exit()
    num_nodes = 1
    if world > 1:
        try:
            num_nodes = discover_nodes(local_rank, local_world)
        except ConfigError:
            teardown_distributed()  # every rank raises alike (same gathered list): no rank waits
            raise
    return DistEnv(world, rank, local_rank, local_world, device, num_nodes)


def discover_nodes(local_rank: int, local_world: int) -> int:
    """Gather every rank's (node, local_rank, LOCAL_WORLD_SIZE) on rank 0 and broadcast the
    list over the default group, once at startup; return the number of nodes after
    `check_nodes`; registers every rank's host and process identity (`register_peers`). The
    node is torchrun's GROUP_RANK (the agent: two agents on one host are
    two nodes), else the hostname."""
    node = os.environ.get("GROUP_RANK") or socket.gethostname()
    group = world_group()
    mine = (node, local_rank, local_world, socket.gethostname(), process_identity())
    members = broadcast_object(gather_object(mine, group, dst=0), group, src=0)
    register_peers([(host, identity) for _, _, _, host, identity in members])  # dead peers get named
    return check_nodes([m[:3] for m in members])


def check_nodes(members: list[tuple[str, int, int]]) -> int:
    """Number of nodes, given each global rank's (node, local_rank, local_world_size) in rank
    order; raises ConfigError unless every node runs the same number of ranks and holds
    consecutive global ranks with local_rank = rank % local_world_size (torchrun's
    assignment), so that node = rank // LOCAL_WORLD_SIZE holds for the mesh's placement."""
    per_node: dict[str, int] = {}
    for node, _, _ in members:
        per_node[str(node)] = per_node.get(str(node), 0) + 1
    if len(set(per_node.values())) > 1 or len({lw for _, _, lw in members}) > 1:
        counts = ", ".join(f"node {n}: {c}" for n, c in per_node.items())
        raise ConfigError(
            f"nodes run different numbers of ranks ({counts}); meshtron places ranks by "
            f"node = rank // LOCAL_WORLD_SIZE: start every node with the same --nproc_per_node"
        )
    local_world = members[0][2]
    if any(count != local_world for count in per_node.values()):
        counts = ", ".join(f"node {n}: {c}" for n, c in per_node.items())
        raise ConfigError(
            f"ranks per node ({counts}) differ from LOCAL_WORLD_SIZE={local_world}; "
            f"give every node its own torchrun GROUP_RANK (or host) and --nproc_per_node ranks"
        )
    for rank, (node, local_rank, _) in enumerate(members):
        first = members[rank - rank % local_world][0]
        if local_rank != rank % local_world or str(node) != str(first):
            raise ConfigError(
                f"rank {rank} is local rank {local_rank} of node {node}, not local rank "
                f"{rank % local_world} of node {first} (LOCAL_WORLD_SIZE={local_world}): "
                f"the launcher did not give each node consecutive ranks as torchrun does"
            )
    return len(per_node)


_LAUNCHER_STORE: dist.Store | None = None  # the env:// store, kept for the life of the process
_JOBS_STARTED = 0  # process groups created so far; every rank runs the same jobs in the same order


def _job_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """A store for the next job's process group: the launcher's env:// store (MASTER_ADDR,
    MASTER_PORT; torchrun's agent store) opened once, under a prefix no earlier job used."""
    global _LAUNCHER_STORE, _JOBS_STARTED
    if _LAUNCHER_STORE is None:
        _LAUNCHER_STORE, _, _ = next(rendezvous("env://", rank, world, timeout=timeout))
    _LAUNCHER_STORE.set_timeout(timeout)
    _JOBS_STARTED += 1
    # torchrun keeps its store across the restarts of --max-restarts (and the membership
    # changes of --nnodes=MIN:MAX, which change the world): a restarted worker must not read
    # the gloo addresses the previous attempt's workers left under the same names
    attempt = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-w{world}"
    return dist.PrefixStore(f"meshtron/attempt{attempt}/job{_JOBS_STARTED}", _LAUNCHER_STORE)


def teardown_distributed() -> None:
    """Destroy the default process group (between Hydra multirun jobs, and at exit)."""
    shm_collectives.reset()
    register_peers([])
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_RELEASE_REGISTERED = False


def _release_at_exit() -> None:
    """Once per process: at interpreter exit (atexit, while the interpreter still lives), tear
    down the process groups a caller left up and `release_process_groups`; the bench scripts
    and other entries than train.py's, which releases them itself, get the same clean exit."""
    global _RELEASE_REGISTERED
    if not _RELEASE_REGISTERED:
        _RELEASE_REGISTERED = True
        atexit.register(lambda: (teardown_distributed(), release_process_groups()))


def release_process_groups() -> None:
    """Collect the garbage cycles (a finished run's engine: model, hooks, buckets) that still
    hold process groups after `teardown_distributed`, so each gloo group's destructor joins its
    worker threads now. Left to the interpreter's shutdown, a worker dropping the last work it
    ran (tensors owned by Python) takes the GIL after finalization began, and the process dies
    of SIGABRT ("terminate called without an active exception") instead of exiting with its
    code: seen at about 1 run in 100 on a loaded host. No communication."""
    gc.collect()


_HYDRA_ONLY = {".hydra", "train.log", "main.log"}


def agree_on_run_dir(local_dir: str | os.PathLike) -> Path:
    """Broadcast rank 0's run dir to all ranks; drop this rank's own dir if it differs and
    contains only Hydra's files (nothing a user could lose)."""
    local = Path(local_dir)
    group = world_group()
    if group is None:
        return local
    agreed = Path(broadcast_object(str(local), group, src=0))
    if agreed.resolve() != local.resolve() and local.is_dir():
        entries = {p.name for p in local.iterdir()}
        if entries <= _HYDRA_ONLY:
            shutil.rmtree(local, ignore_errors=True)
            # A multirun job: this rank's own sweep dir (its clock's name) then holds only
            # Hydra's multirun.yaml; the sweep lives in rank 0's.
            sweep = local.parent
            if (
                sweep.is_dir()
                and sweep.resolve() != agreed.parent.resolve()
                and {p.name for p in sweep.iterdir()} <= {"multirun.yaml"}
            ):
                shutil.rmtree(sweep, ignore_errors=True)
    agreed.mkdir(parents=True, exist_ok=True)
    return agreed
