"""Parameter-server data parallelism (`parallel.dp_mode=ps`): bulk-synchronous (bsp),
stale-synchronous (ssp, `optim.staleness=s`) and asynchronous (asp) updates over
torch.distributed point-to-point messages (isend/irecv; gloo on CPU).

Layout. The world is W*M worker ranks followed by S = `parallel.servers` server ranks (the
last S). Worker w owns the M = tp consecutive ranks [w*M, (w+1)*M) and is a model-parallel
group of its own (tp, sp, and MoE ep/etp inside it; its mesh has dp=1, built by
`block_mesh`); it never talks to another worker. The servers are outside every training
mesh. pp > 1, cp > 1, ZeRO, offload, 16-bit resident weights, fp16 loss scaling, bf16
gradient compression, async checkpoints, init_from, MoE expert-bias balancing and
non-microbatch aux-loss scopes are refused with one line (`ps_config_checks`).

Shards. Each worker rank keeps its local parameters (its tp/ep shard) as one flat fp32
vector in a fixed order: weight-decayed parameters (ndim >= 2) first, then the rest.
Worker rank (w, t) exchanges only its own vector with the servers: server s holds the s-th
of S contiguous, nearly equal ranges of tp position t's vector for every t, with the AdamW
moments of that range (torch's AdamW, `dp.adamw.adamw`, over the decayed and non-decayed
pieces of the range: the update is element-wise, so it equals the replicated AdamW).

Messages (per step, worker rank -> every server, then back): a float64 header (kind, step,
parameter version the gradient was computed on, token count, loss, finite flag, the worker's
gradient norm) and the fp32 gradient range; the reply is a header (version, grad norm, loss,
staleness statistics, the server's state bytes, start step) and the parameter range. Servers
receive headers from any source (dp/param_server_comm.py), so they serve pushes in arrival order.

Synchronisation. Each worker normalises its loss by the token count N of the step's whole
global batch, which it counts from the data itself (`_global_tokens`), and averages MoE aux
terms over the W workers too (train_step's `token_count`, `outer_replicas`): its gradient g_w
is exactly an all-reduce DP rank's local gradient.
  bsp  a server keeps every worker's gradient of step k until all have arrived, then applies
       one update with g = sum_w g_w (w in index order: a fixed order of summation), clipped
       by the global norm (summed over the servers: one all-reduce of a scalar per step), at
       lr_at(k): bsp equals all-reduce data parallelism.
  ssp  the same per-step (clock) updates; a worker's push of step k is answered with the
       parameters of version k - s + 1 (clocks 0..k-s applied), so a worker may start step
       k+1 only when the slowest worker has pushed step k-s: it runs at most s steps ahead.
       Replies hand out exactly that version (servers keep snapshots of the last s versions),
       which makes every server and tp rank of a worker read one consistent version and makes
       ssp deterministic; s = 0 is bsp (the same code path).
  asp  a server applies each worker's gradient when all M ranks of that worker have pushed it,
       as its own AdamW step on g_w (about 1/W of the worker's mean gradient: its share of the
       global batch's normalisation), clipped by g_w's own norm (measured by the worker), at
       lr_at(updates // W), and answers at once with whatever parameters it holds (with S > 1
       servers a worker may read shards of different versions: that is asynchrony).
Staleness of a gradient = server updates (clocks under bsp/ssp, single worker updates under
asp) applied between the version it was computed on and its own application: 0 under bsp,
<= s under ssp. Replies carry the servers' running max and mean; the loop logs them as
`staleness_max`/`staleness_mean`, beside `server_state_bytes` (params + moments + buffered
gradients and snapshots of the largest server) and `worker_state_bytes` (model + gradients).

Logging: global rank 0 (worker 0, tp rank 0) writes metrics.jsonl. Under bsp (and ssp with
s=0) `loss` and `grad_norm` are the global batch's (as all-reduce DP logs them); under ssp
(s>0) and asp they are worker 0's own batch mean and its gradient's norm. `val_loss` is worker
0's parameters on the held-out batches.

Checkpoints: with `checkpoint.dir`, each server writes its shard, moments and version to
`<dir>/ps_step_<N>/server_<s>_of_<S>.pt` (atomically: temporary file, then rename) every
`checkpoint.every` steps and at the end; workers hold no state. A killed worker stops the run
but leaves the last complete set intact; `checkpoint.resume=auto` (or a ps_step_N folder)
loads it and every worker restarts at step N with the data position N * global batch.
bsp resumes exactly; ssp/asp restart from the servers' current parameters (the snapshots and
in-flight pushes are not saved).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import signal
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from meshtron.dp.adamw import TrainingOptimizer, adamw
from meshtron.dp.grad_norm import global_grad_norm, scale_to_max_norm
from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.dp.param_server_comm import PSChannel
from meshtron.errors import ConfigError, say_one_line
from meshtron.mpu.cross_entropy import IGNORE_INDEX
from meshtron.mpu.mappings import all_reduce_stats, barrier, world_group
from meshtron.mpu.mesh import Mesh, ParallelConfig, ParallelConfigError, collective_device, dim_groups
from meshtron.training.checkpoint import RESUME_MAY_CHANGE, config_diff, hold_checkpoint_dir
from meshtron.training.checkpoint_files import CheckpointError, check_file_crc, warn_checkpoint
from meshtron.training.preemption import StopRequest
from meshtron.training.run_checks import check_run_config

HEADER = 12
HELLO, PUSH, DONE = 0.0, 1.0, 2.0
TAG_HEAD, TAG_BODY, TAG_REPLY_HEAD, TAG_REPLY_BODY = 71, 72, 73, 74
# push header fields (P_STOP: this rank caught SIGTERM; on a DONE: the run aborts, nothing saved)
P_KIND, P_STEP, P_VERSION, P_TOKENS, P_LOSS, P_FINITE, P_NORM, P_STOP = range(8)
# reply header fields (R_STOP: stop after this step; R_SKIPPED: the update answered was skipped)
R_VERSION, R_NORM, R_LOSS, R_STALE_MAX, R_STALE_SUM, R_STALE_COUNT, R_BYTES, R_START, R_STOP, R_SKIPPED = range(10)

DELAY_ENV = "MESHTRON_PS_TEST_DELAY"  # test hook: "worker:seconds" sleeps before each of its steps
KILL_ENV = "MESHTRON_PS_TEST_KILL"  # test hook: "worker:step" SIGKILLs that worker's ranks at that step
KILL_SERVER_ENV = "MESHTRON_PS_TEST_KILL_SERVER"  # test hook: "server:version" SIGKILLs that server there
PS_FORMAT = "meshtron-ps-checkpoint"
_PS_FILE = re.compile(r"^server_(\d+)_of_(\d+)\.pt$")


class PSPeerLost(RuntimeError):
    """A peer of a parameter-server run is gone (one line: which rank, which exchange)."""


# ----------------------------------------------------------------------------- configuration


def ps_config_checks(run) -> list[tuple[bool, str]]:
    """(holds, message) pairs for a parameter-server run (`parallel.dp_mode=ps`): what the
    workers and servers do not support is refused before any process group exists."""
    p, o, t, c, m = run.parallel, run.optim, run.trainer, run.checkpoint, run.model
    why = "with parallel.dp_mode=ps"
    return [
        (p.pp == 1, f"parallel.pp={p.pp} {why}: pipeline stages inside a worker are not supported; use pp=1"),
        (p.cp == 1, f"parallel.cp={p.cp} {why}: context parallelism inside a worker is not supported; use cp=1"),
        (o.zero == 0, f"optim.zero={o.zero} {why}: the servers already shard the AdamW state; use optim.zero=0"),
        (not o.offload, f"optim.offload=true {why}: the AdamW state lives on the servers; use optim.offload=false"),
        (o.param_dtype == "fp32", f"optim.param_dtype={o.param_dtype} {why}: servers keep fp32 weights; use fp32"),
        (
            o.grad_comm_dtype == "fp32",
            f"optim.grad_comm_dtype={o.grad_comm_dtype} {why}: gradients are pushed in fp32; use fp32",
        ),
        (t.precision != "fp16", f"trainer.precision=fp16 {why}: loss scaling is not supported; use bf16 or fp32"),
        (not c.async_, f"checkpoint.async=true {why}: servers write their shards synchronously; use false"),
        (not t.tensorboard, f"trainer.tensorboard=true {why}: the ps loop writes metrics.jsonl only; use false"),
        (
            getattr(o, "local_steps", 1) == 1,
            f"optim.local_steps={getattr(o, 'local_steps', 1)} {why}: local SGD "
            "averages over all-reduce; use optim.local_steps=1",
        ),
        (
            getattr(p, "dp_hierarchical", "auto") is not True,
            f"parallel.dp_hierarchical=true {why}: workers reduce nothing over dp; leave it at auto",
        ),
        (not c.init_from, f"checkpoint.init_from {why} is not supported; start fresh or resume a ps checkpoint"),
        (
            getattr(m, "router_bias_update_rate", 0.0) == 0.0,
            f"model.router_bias_update_rate={getattr(m, 'router_bias_update_rate', 0.0)} {why}: each worker would "
            "update its own expert bias; use 0",
        ),
        (
            not m.num_experts or getattr(m, "aux_loss_scope", "microbatch") == "microbatch",
            f"model.aux_loss_scope={getattr(m, 'aux_loss_scope', None)} {why}: only the per-microbatch scope is "
            "independent of the workers; use microbatch",
        ),
    ]


def check_ps_run(run, world_size: int) -> tuple[ParallelConfig, int, int, int]:
    """Validate a ps run for `world_size` processes; return (worker layout with dp=1,
    workers W, ranks per worker M, micro batch size). Raises ConfigError (one line)."""
    for holds, message in ps_config_checks(run):
        if not holds:
            raise ConfigError(message)
    if world_size <= run.parallel.servers:
        raise ConfigError(
            f"parallel.servers={run.parallel.servers} leaves no worker rank in world size {world_size}; "
            "start more processes or use fewer servers"
        )
    # the allreduce checks, with dp = workers
    workers_only = dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, dp_mode="allreduce", servers=0))
    par, micro, _ = check_run_config(workers_only, world_size - run.parallel.servers)
    workers, per_worker = par.dp, par.tp
    fields = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in par.__dict__.items()}
    fields.update(dp=1, dp_mode="allreduce", servers=0)
    try:
        worker_par = ParallelConfig(**fields).resolved(per_worker)
    except ParallelConfigError as err:
        raise ConfigError(f"one worker of parallel.tp={par.tp} ranks: {err}") from err
    return worker_par, workers, per_worker, micro


# ----------------------------------------------------------------------------- meshes


def block_mesh(par: ParallelConfig, offsets: list[int], rank: int) -> Mesh | None:
    """The mesh of `par` (pp=1, cp=1; resolved for its own size n) on each block of ranks
    [offset, offset + n) for `offsets`: every process of the world must call this (groups are
    created collectively, in the same order); returns this rank's block's mesh (coordinates
    relative to the block), or None when this rank is in no block. Communicates over the
    default group (group creation only)."""
    if par.pp != 1 or par.cp != 1:
        raise ValueError("block_mesh supports pp=1, cp=1 layouts only")
    n = par.tp * par.dp
    groups = dim_groups(par, n)
    mine = None
    for offset in offsets:
        inside = offset <= rank < offset + n
        mesh = Mesh(par, n, rank - offset, create_groups=False) if inside else None

        def make(members: list[int], offset: int = offset, inside: bool = inside):
            if len(members) == 1:
                return None
            group = dist.new_group([offset + r for r in members])
            return group if inside and (rank - offset) in members else None

        def pick(name: str):
            found = None
            for members in groups[name]:
                group = make(members)
                found = group if group is not None else found
            return found

        tp, dp, ep, etp, edp = pick("tp"), pick("dp"), pick("ep"), pick("etp"), pick("edp")
        tp_dp = make(list(range(n)))
        ep_etp = None
        width = par.ep * par.etp
        for index in range(n // width):
            group = make(list(range(index * width, (index + 1) * width)))
            ep_etp = group if group is not None else ep_etp
        if inside:
            mesh.tp, mesh.dp, mesh.ep, mesh.etp, mesh.edp = tp, dp, ep, etp, edp
            mesh.tp_dp, mesh.ep_etp, mesh.dp_cp, mesh.tp_cp = tp_dp, ep_etp, dp, tp
            mine = mesh
    return mine


# ----------------------------------------------------------------------------- flat layout


@dataclass
class FlatLayout:
    """A worker rank's local parameters as one flat vector: `params` in vector order
    (weight-decayed first), the decayed prefix length `boundary`, and `counted`: whether each
    parameter's squares enter the global gradient norm from this rank (tp-replicated ones only
    on tp rank 0, expert shards only on edp rank 0: dp/grad_norm.py counts them once)."""

    params: list[nn.Parameter]
    boundary: int
    counted: list[bool]

    @property
    def numels(self) -> list[int]:
        return [p.numel() for p in self.params]

    @property
    def total(self) -> int:
        return sum(self.numels)

    def meta(self) -> dict:
        return {"numels": self.numels, "boundary": self.boundary, "counted": self.counted}


def flat_layout(chunks: list[nn.Module], mesh: Mesh) -> FlatLayout:
    """The vector order of this rank's trainable parameters (see FlatLayout). No communication."""
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    rest = [p for p in params if p.ndim < 2]

    def counted(p) -> bool:
        if getattr(p, "expert", False):
            return mesh.edp_rank == 0
        return getattr(p, "tp_shard_dim", None) is not None or mesh.tp_rank == 0

    ordered = decay + rest
    return FlatLayout(ordered, sum(p.numel() for p in decay), [counted(p) for p in ordered])


def shard_range(total: int, servers: int, index: int) -> tuple[int, int]:
    """[lo, hi) of server `index`'s contiguous range of a vector of `total` elements."""
    size = math.ceil(total / servers)
    return min(index * size, total), min((index + 1) * size, total)


def _counted_mask(meta: dict, lo: int, hi: int) -> torch.Tensor:
    mask = torch.zeros(hi - lo, dtype=torch.bool)
    offset = 0
    for numel, counted in zip(meta["numels"], meta["counted"]):
        a, b = max(offset, lo), min(offset + numel, hi)
        if a < b and counted:
            mask[a - lo : b - lo] = True
        offset += numel
    return mask


# ----------------------------------------------------------------------------- roles


@dataclass
class Roles:
    """Who is who: W workers of M ranks (global ranks w*M + t), then S servers."""

    workers: int
    per_worker: int
    servers: int

    def worker_rank(self, w: int, t: int) -> int:
        return w * self.per_worker + t

    def server_rank(self, s: int) -> int:
        return self.workers * self.per_worker + s

    def peer_of(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.per_worker)

    @property
    def server_ranks(self) -> list[int]:
        return [self.server_rank(s) for s in range(self.servers)]


def _env_hook(name: str) -> dict[int, float]:
    """{worker: value} from a test hook variable "w:value[,w:value]"."""
    out = {}
    for item in filter(None, os.environ.get(name, "").split(",")):
        w, value = item.split(":")
        out[int(w)] = float(value)
    return out


# ----------------------------------------------------------------------------- server


@dataclass
class ServerResult:
    """What a server did: final version, staleness statistics and, per push from a worker's
    tp rank 0 (bsp/ssp/asp alike), (worker, step, answered steps of every worker at arrival)."""

    version: int
    stale_max: int
    stale_mean: float
    trace: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    state_bytes: int = 0


class ParameterServer:
    """Server `index` of `roles.servers`: holds range `index` of every tp position's flat
    vector with its AdamW moments, and serves the workers' pushes (module doc). Talks P2P to
    every worker rank and all-reduces one scalar per clock over `server_group` (bsp/ssp)."""

    def __init__(self, run, roles: Roles, index: int, server_group, schedule, channel: PSChannel):
        self.run, self.roles, self.index, self.group, self.channel = run, roles, index, server_group, channel
        self.sync = run.optim.sync
        self.s = run.optim.staleness if self.sync == "ssp" else 0
        self.lr_at = schedule
        self.version = 0
        self.stale_max, self.stale_sum, self.stale_count = 0, 0.0, 0
        self.trace: list = []
        self.answered = [0] * roles.workers
        self.last_norm, self.last_loss = 0.0, 0.0
        self.pending: dict[int, dict[int, tuple]] = {}  # bsp/ssp: clock -> {peer rank: (header, body)}
        self.asp_pending: dict[tuple[int, int], dict] = {}  # asp: (worker, step) -> {t: (header, body)}
        self.deferred: list[tuple[int, int]] = []  # (peer rank, step) waiting for a version
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.sends: list = []
        self.saved_version = -1
        self.stop = False  # sticky: a worker rank or this server caught SIGTERM (or a worker aborts)
        self.abort = False  # a worker stops the run for trainer.max_skipped: nothing is saved
        self.last_skipped = False
        self.stopper = StopRequest(enabled=run.checkpoint.dir is not None)
        self.kill_at = _env_hook(KILL_SERVER_ENV).get(index)

    # --- setup
    def setup(self) -> int:
        """Receive worker 0's layout and initial parameters, build the shards and AdamW, load
        a checkpoint when resuming; returns the step the workers start at."""
        r, M = self.roles, self.roles.per_worker
        self.meta, self.lo, self.hi, self.params, self.masks = [], [], [], [], []
        for t in range(M):
            meta = self.channel.recv_object(r.worker_rank(0, t))
            lo, hi = shard_range(sum(meta["numels"]), r.servers, self.index)
            self.meta.append(meta)
            self.lo.append(lo)
            self.hi.append(hi)
            self.masks.append(_counted_mask(meta, lo, hi))
            self.params.append(torch.zeros(hi - lo))
        decay, rest = [], []
        self.pieces = []  # per t: [(a, b, parameter view)]
        for t in range(M):
            boundary, lo, hi = self.meta[t]["boundary"], self.lo[t], self.hi[t]
            pieces = []
            for a, b, out in ((lo, min(hi, boundary), decay), (max(lo, boundary), hi, rest)):
                if a < b:
                    view = nn.Parameter(self.params[t][a - lo : b - lo])  # shares the flat buffer
                    pieces.append((a - lo, b - lo, view))
                    out.append(view)
            self.pieces.append(pieces)
        o = self.run.optim
        groups = [
            g
            for g in ({"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0})
            if g["params"]
        ]
        self.optimizer = adamw(groups, lr=o.lr, betas=o.betas, eps=o.eps) if groups else None
        # hello from every worker rank: worker 0's bodies are the initial parameters
        for _ in range(r.workers * M):
            header, src, body = self._receive()
            w, t = r.peer_of(src)
            if header[P_KIND] != HELLO:
                raise RuntimeError(f"parameter server {self.index}: expected a hello from rank {src}")
            if w == 0:
                self.params[t].copy_(body)
        start = 0
        resume = resume_dir(self.run.checkpoint, r.servers)
        if resume is not None:
            try:
                start = self._load(resume)
            except CheckpointError as err:  # checked before any group; changed since: one line here
                say_one_line(f"meshtron: checkpoint error: {err}")
                raise SystemExit(2) from None
        self.answered = [start] * r.workers
        if self.s > 0:
            self.snapshots[self.version] = [p.clone() for p in self.params]
        self.start = start
        for rank in range(r.workers * M):
            self._reply(rank, None)
        return start

    def _receive(self) -> tuple[torch.Tensor, int, torch.Tensor]:
        header = torch.empty(HEADER, dtype=torch.float64)
        try:
            src = self.channel.recv_any(header, TAG_HEAD)
            _, t = self.roles.peer_of(src)
            body = torch.empty(self.hi[t] - self.lo[t])
            self.channel.recv(body, src, TAG_BODY)
        except RuntimeError as err:
            cause = _cause(err)
            raise PSPeerLost(
                f"parameter server {self.index}: a worker rank is gone at version {self.version} ({cause}); "
                "resume from the last ps_step_N checkpoint with checkpoint.resume=auto"
            ) from None
        return header, src, body

    # --- serving
    def serve(self) -> ServerResult:
        r = self.roles
        peers = r.workers * r.per_worker
        done = 0
        while done < peers:
            header, src, body = self._receive()
            if header[P_KIND] == DONE:
                done += 1
                if header[P_STOP]:  # a worker stopped the run (trainer.max_skipped): no save
                    self.stop = self.abort = True
                if self.stop:  # pushes waiting for a stopped worker's clocks: answer them now
                    self._flush_deferred()
                continue
            w, t = r.peer_of(src)
            step = int(header[P_STEP])
            self.stop = self.stop or bool(header[P_STOP])
            if t == 0:
                self.trace.append((w, step, tuple(self.answered)))
            if self.sync == "asp":
                self._asp_push(w, t, step, header, body)
            else:
                self._clock_push(src, step, header, body)
        self._drain()
        if self.stop and hasattr(self.stopper, "disarm"):
            self.stopper.disarm()  # every worker is done: the save below may take its time
        self.stopper.close()
        if self.run.checkpoint.dir and self.saved_version != self.version and not self.abort:
            self._save()
        mean = self.stale_sum / self.stale_count if self.stale_count else 0.0
        return ServerResult(self.version, self.stale_max, mean, self.trace, self.state_bytes())

    def _clock_push(self, src: int, step: int, header, body) -> None:
        r = self.roles
        self.pending.setdefault(step, {})[src] = (header, body)
        self.deferred.append((src, step))
        while self.version in self.pending and len(self.pending[self.version]) == r.workers * r.per_worker:
            self._apply_clock(self.pending.pop(self.version))
        self._answer_ready()

    def _needed(self, step: int) -> int:
        """The parameter version a push of `step` is answered with (clocks 0..step-s applied)."""
        return max(0, step - self.s + 1)

    def _flush_deferred(self) -> None:
        """Answer every waiting push with the current parameters (the run is stopping: the
        clocks they wait for will never complete)."""
        for src, _ in self.deferred:
            self._reply(src, None)
        self.deferred = []

    def _answer_ready(self) -> None:
        still = []
        for src, step in self.deferred:
            version = self._needed(step)
            if version <= self.version:
                # A resumed ssp run has no snapshots of the versions before it: current parameters
                snapshot = self.snapshots.get(version) if version < self.version else None
                self._reply(src, snapshot, version if snapshot is not None else None)
                self.answered[self.roles.peer_of(src)[0]] += self.roles.peer_of(src)[1] == 0
            else:
                still.append((src, step))
        self.deferred = still
        if self.snapshots:  # drop versions no push can still ask for
            lowest = min([self._needed(step) for _, step in self.deferred] + [self._needed(a) for a in self.answered])
            for version in [v for v in self.snapshots if v < lowest]:
                del self.snapshots[version]

    def _apply_clock(self, pushes: dict[int, tuple]) -> None:
        """One update from every worker's gradient of clock `self.version` (bsp/ssp)."""
        r = self.roles
        clock = self.version
        heads = {w: pushes[r.worker_rank(w, 0)][0] for w in range(r.workers)}
        grads = []
        for t in range(r.per_worker):
            acc = torch.zeros_like(self.params[t])
            for w in range(r.workers):  # fixed order of summation, as a sum over the dp ranks
                acc.add_(pushes[r.worker_rank(w, t)][1])
            grads.append(acc)
        loss = float(sum(torch.tensor(float(heads[w][P_LOSS]), dtype=torch.float32) for w in range(r.workers)))
        finite = all(float(pushes[src][0][P_FINITE]) == 1.0 for src in pushes)
        for w in range(r.workers):
            self._staleness(clock - int(heads[w][P_VERSION]))
        self.stop = self.stop or self.stopper.requested  # taken into replies only here: one clock for all
        self._update(grads, self._global_norm(grads), finite, self.lr_at(clock))
        self.last_loss = loss
        self.version = clock + 1
        self._kill_hook()
        if self.s > 0:
            self.snapshots[self.version] = [p.clone() for p in self.params]
        every = self.run.checkpoint.every
        if self.run.checkpoint.dir and every and self.version % every == 0:
            self._save()

    def _global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm of the averaged gradient of the full model: this server's counted squares,
        summed over the servers (one all-reduce over `self.group`)."""
        sq = torch.zeros((), dtype=torch.float32)
        for grad, mask in zip(grads, self.masks):
            if grad.numel():
                sq = sq + grad[mask].pow(2).sum()
        return all_reduce_stats(sq, self.group).sqrt()

    def _update(self, grads: list[torch.Tensor], norm: torch.Tensor, finite: bool, lr: float) -> None:
        """Clip `grads` to trainer.max_grad_norm by `norm` (as dp/grad_norm.py), then one
        AdamW step of the shards at `lr`; nothing when the step is not finite."""
        finite = finite and bool(torch.isfinite(norm))
        self.last_norm = float(norm)
        self.last_skipped = not finite
        if not finite or self.optimizer is None:
            return
        scale_to_max_norm(grads, norm, self.run.trainer.max_grad_norm)
        for t, pieces in enumerate(self.pieces):
            for a, b, view in pieces:
                view.grad = grads[t][a:b]
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def _asp_push(self, w: int, t: int, step: int, header, body) -> None:
        r = self.roles
        entry = self.asp_pending.setdefault((w, step), {})
        entry[t] = (header, body)
        if len(entry) < r.per_worker:
            return
        del self.asp_pending[(w, step)]
        head = entry[0][0]
        self._staleness(self.version - int(head[P_VERSION]))
        grads = [entry[t][1] for t in range(r.per_worker)]  # already ~1/W of the worker's mean gradient
        norm = torch.tensor(float(head[P_NORM]))
        finite = all(float(entry[t][0][P_FINITE]) == 1.0 for t in entry)
        self.stop = self.stop or self.stopper.requested
        self._update(grads, norm, finite, self.lr_at(self.version // r.workers))
        self.last_loss = float(head[P_LOSS]) * r.workers
        self.version += 1
        self._kill_hook()
        every = self.run.checkpoint.every
        if self.run.checkpoint.dir and every and self.version % (every * r.workers) == 0:
            self._save()
        for tt in range(r.per_worker):
            self._reply(r.worker_rank(w, tt), None)
        self.answered[w] += 1

    def _kill_hook(self) -> None:
        """The tests' hook MESHTRON_PS_TEST_KILL_SERVER: this server dies without a word at a version."""
        if self.kill_at is not None and self.version == int(self.kill_at):
            os.kill(os.getpid(), signal.SIGKILL)

    def _staleness(self, value: int) -> None:
        self.stale_max = max(self.stale_max, value)
        self.stale_sum += value
        self.stale_count += 1

    def _reply(self, rank: int, params: list[torch.Tensor] | None, version: int | None = None) -> None:
        _, t = self.roles.peer_of(rank)
        source = self.params if params is None else params
        header = torch.zeros(HEADER, dtype=torch.float64)
        header[R_VERSION] = self.version if version is None else version
        header[R_NORM], header[R_LOSS] = self.last_norm, self.last_loss
        header[R_STALE_MAX], header[R_STALE_SUM] = self.stale_max, self.stale_sum
        header[R_STALE_COUNT] = self.stale_count
        header[R_BYTES], header[R_START] = self.state_bytes(), getattr(self, "start", 0)
        header[R_STOP], header[R_SKIPPED] = float(self.stop), float(self.last_skipped)
        body = source[t].clone()
        self.sends.append((self.channel.isend(header, rank, TAG_REPLY_HEAD), header))
        self.sends.append((self.channel.isend(body, rank, TAG_REPLY_BODY), body))
        if len(self.sends) > 64:
            self._drain()

    def _drain(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends = []

    def state_bytes(self) -> int:
        """Parameter shards, AdamW moments, buffered gradients and ssp snapshots held now."""
        params = sum(p.numel() for p in self.params) * 4
        moments = self.optimizer.state_bytes() if self.optimizer is not None else 0
        buffered = sum(b.numel() * 4 for clock in self.pending.values() for _, b in clock.values())
        buffered += sum(b.numel() * 4 for entry in self.asp_pending.values() for _, b in entry.values())
        snapshots = sum(p.numel() * 4 for snap in self.snapshots.values() for p in snap)
        return params + moments + buffered + snapshots

    # --- checkpoints
    def _step_of_version(self) -> int:
        return self.version // self.roles.workers if self.sync == "asp" else self.version

    def _save(self) -> None:
        """Write this server's shard, moments and version to `ps_step_<step>/server_<s>_of_<S>.pt`
        and, next to it, `server_<s>_of_<S>.json`: the file's size and CRC32 (computed from the
        bytes written), the step, the server count, tp and the model config a resume checks
        (`check_ps_folder`). Each file goes in atomically (temporary file, then rename); the
        .pt first, the .json last, so a shard without its description is incomplete."""
        step = self._step_of_version()
        folder = Path(self.run.checkpoint.dir) / f"ps_step_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"server_{self.index}_of_{self.roles.servers}.pt"
        state = {
            "version": self.version,
            "step": step,
            "sync": self.sync,
            "params": self.params,
            "layout": [(sum(m["numels"]), lo, hi) for m, lo, hi in zip(self.meta, self.lo, self.hi)],
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "staleness": (self.stale_max, self.stale_sum, self.stale_count),
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        description = {
            "format": PS_FORMAT,
            "step": step,
            "version": self.version,
            "servers": self.roles.servers,
            "server": self.index,
            "tp": self.roles.per_worker,
            "sync": self.sync,
            "model": dataclasses.asdict(self.run.model),
            "file": {"name": path.name, "bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"},
        }
        _write_durably(path, data)
        _write_durably(path.with_suffix(".json"), json.dumps(description, indent=1, sort_keys=True).encode())
        self.saved_version = self.version
        keep = self.run.checkpoint.keep
        if keep:
            folders = sorted(_ps_folders(Path(self.run.checkpoint.dir)), key=lambda f: f[0])
            for _, old in folders[:-keep]:
                (old / path.with_suffix(".json").name).unlink(missing_ok=True)  # description first
                (old / path.name).unlink(missing_ok=True)
                try:
                    old.rmdir()
                except OSError:
                    pass  # another server's file is still there

    def _load(self, folder: Path) -> int:
        path = folder / f"server_{self.index}_of_{self.roles.servers}.pt"
        try:
            state = torch.load(path, weights_only=False)
        except Exception as err:  # noqa: BLE001 (verified before any group: changed since)
            raise CheckpointError(f"checkpoint file {path} cannot be read ({err}); use another checkpoint") from None
        layout = [(sum(m["numels"]), lo, hi) for m, lo, hi in zip(self.meta, self.lo, self.hi)]
        if [tuple(x) for x in state["layout"]] != layout:
            raise CheckpointError(
                f"checkpoint file {path} holds the ranges {state['layout']} but this run's model needs "
                f"{layout}: the model differs from the checkpoint's; resume with its model settings"
            )
        for mine, saved in zip(self.params, state["params"]):
            mine.copy_(saved)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.stale_max, self.stale_sum, self.stale_count = state["staleness"]
        self.saved_version = self.version
        return int(state["step"])


def _write_durably(path: Path, data: bytes) -> None:
    """`data` into `path` through a temporary file, fsynced, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a killed run leaves the previous file or the new one, never half of one


def _ps_folders(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return [
        (int(p.name.split("_")[-1]), p)
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith("ps_step_") and p.name.split("_")[-1].isdigit()
    ]


def _server_count(folder: Path) -> int | None:
    """The S of the `server_s_of_S` files in `folder` (the largest when several; None: none)."""
    counts = [int(m.group(2)) for f in folder.iterdir() if (m := _PS_FILE.match(f.name))]
    return max(counts) if counts else None


def check_ps_folder(folder: Path, servers: int | None = None) -> list[dict]:
    """The descriptions of a ps_step_N folder's shards after checking that it is complete (a
    shard and its description for every one of its S servers) and that every shard has the
    size and CRC32 recorded at save; `servers`: S expected (None: the folder's own). Raises
    CheckpointError naming the file. No communication."""
    count = _server_count(folder) if servers is None else servers
    if count is None:
        raise CheckpointError(f"{folder} holds no server_s_of_S.pt file; it is not a parameter-server checkpoint")
    descriptions = []
    for s in range(count):
        path = folder / f"server_{s}_of_{count}.pt"
        side = path.with_suffix(".json")
        if not path.is_file() or not side.is_file():
            missing = path if not path.is_file() else side
            raise CheckpointError(
                f"checkpoint {folder} is incomplete: {missing.name} is missing (the save did not finish)"
            )
        try:
            description = json.loads(side.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"checkpoint file {side} is unreadable ({err}); the checkpoint is corrupt") from None
        entry = description.get("file", {}) if isinstance(description, dict) else {}
        if description.get("format") != PS_FORMAT or not {"bytes", "crc32"} <= entry.keys():
            raise CheckpointError(f"checkpoint file {side} is not a parameter-server shard description")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path} has {size} bytes, {entry['bytes']} were written (truncated or "
                "modified); the checkpoint is corrupt, use another"
            )
        check_file_crc(folder, path.name, entry)
        descriptions.append(description)
    return descriptions


def latest_complete(root: Path, servers: int) -> Path | None:
    """The newest ps_step_N folder of `root` holding every server's shard and description (None: none)."""
    for _, folder in sorted(_ps_folders(root), reverse=True):
        if all(
            (folder / f"server_{s}_of_{servers}{suffix}").exists()
            for s in range(servers)
            for suffix in (".pt", ".json")
        ):
            return folder
    return None


def resume_dir(c, servers: int) -> Path | None:
    """The ps_step_N folder a run resumes from: `checkpoint.resume` as `resolve_ps_resume` left
    it (a folder, checked before any process group), or None."""
    if not c.resume:
        return None
    if c.resume != "auto":
        return Path(c.resume)
    return latest_complete(Path(c.dir), servers) if c.dir else None


def resolve_ps_resume(run):
    """`run` with checkpoint.resume resolved to the verified ps_step_N folder to load (or None:
    a fresh start), before any process group, alike on every rank: "auto" takes the newest
    intact folder of checkpoint.dir, skipping a corrupt or incomplete one with a warning; a
    folder given must be intact; a checkpoint.dir given as resume is taken as "auto" there.
    The folder must come from this server count, tp and model (else one line saying which
    setting changed). Raises CheckpointError."""
    c = run.checkpoint
    if not c.resume:
        return run
    root = Path(c.dir) if c.resume == "auto" else Path(c.resume)
    if c.resume == "auto" and c.dir is None:
        raise CheckpointError("checkpoint.resume=auto needs checkpoint.dir (where to look for checkpoints)")
    if c.resume != "auto" and not root.is_dir():
        raise CheckpointError(f"checkpoint.resume={root} does not exist or is not a directory")
    if (root / "meshtron.json").is_file():
        raise CheckpointError(
            f"{root} is an all-reduce checkpoint (step_N): a parameter-server run resumes a ps_step_N folder; "
            "resume it with parallel.dp_mode=allreduce or give a ps_step_N folder"
        )
    if c.resume != "auto" and _server_count(root) is not None:  # one ps_step_N folder
        found = _check_for_run(root, run)
    else:
        found = None
        problems = []
        for _, folder in sorted(_ps_folders(root), reverse=True):
            try:
                check_ps_folder(folder)
            except CheckpointError as err:
                problems.append(str(err))
                warn_checkpoint(f"skipping checkpoint {folder}: {err}")
                continue
            found = _check_for_run(folder, run)
            if problems:
                warn_checkpoint(f"resuming from the previous checkpoint {found}")
            break
        if found is None and problems:
            raise CheckpointError(
                f"no intact parameter-server checkpoint in {root} (newest: {problems[0]}); delete the corrupt "
                "ones or start fresh without checkpoint.resume"
            )
        if found is None and any(p.name.startswith("step_") for p in root.iterdir()):
            raise CheckpointError(
                f"{root} holds all-reduce checkpoints (step_N) and no ps_step_N folder: resume them with "
                "parallel.dp_mode=allreduce, or give this run another checkpoint.dir"
            )
        if found is None and c.resume != "auto":
            raise CheckpointError(f"checkpoint.resume={root} holds no ps_step_N checkpoint")
    return dataclasses.replace(run, checkpoint=dataclasses.replace(c, resume=None if found is None else str(found)))


def _check_for_run(folder: Path, run) -> Path:
    """`folder` after checking its shards (`check_ps_folder`) and that this run can load them:
    the same parallel.servers and parallel.tp (the shards are ranges of each tp rank's flat
    vector, cut for that server count) and the same model. Raises CheckpointError."""
    descriptions = check_ps_folder(folder)
    saved = descriptions[0]
    if saved["servers"] != run.parallel.servers:
        raise CheckpointError(
            f"checkpoint {folder} was saved with parallel.servers={saved['servers']} but this run has "
            f"parallel.servers={run.parallel.servers}: the server state is cut into that many shards; resume "
            f"with parallel.servers={saved['servers']} (and one process more or less), or start fresh"
        )
    if saved["tp"] != run.parallel.tp:
        raise CheckpointError(
            f"checkpoint {folder} was saved with parallel.tp={saved['tp']} but this run has "
            f"parallel.tp={run.parallel.tp}: the shards are per tp rank; resume with parallel.tp={saved['tp']}"
        )
    current = dataclasses.asdict(run.model)
    changed = {k: v for k, v in saved.get("model", {}).items() if k not in RESUME_MAY_CHANGE}  # as an all-reduce resume
    diff = config_diff(changed, current)
    if diff:
        raise CheckpointError(
            f"checkpoint {folder} was saved for another model (model.{diff.replace(', ', ', model.')}); "
            "resume with the checkpoint's model settings"
        )
    return folder


# ----------------------------------------------------------------------------- worker client


@dataclass
class Reply:
    """What a worker rank learnt from the servers after an exchange."""

    version: int
    grad_norm: float
    loss: float
    stale_max: float
    stale_mean: float
    server_bytes: int
    start: int
    stop: bool = False
    skipped: bool = False


class ParameterServerClient(TrainingOptimizer):
    """The `TrainingOptimizer` of a worker rank: `clip_grad_norm` only measures the worker's
    gradient norm (the servers clip), `update` records the lr; `exchange` (called by the loop
    after each step) pushes the gradient ranges to every server and installs the parameter
    ranges of the replies. P2P with the servers only; the norm all-reduces over the worker's tp."""

    def __init__(self, chunks: list[nn.Module], mesh: Mesh, roles: Roles, worker: int, channel: PSChannel):
        self.layout = flat_layout(chunks, mesh)
        self.channel = channel
        self.mesh, self.roles, self.worker = mesh, roles, worker
        self.param_groups = [{"lr": 0.0}]
        self.version = 0
        self.local_norm = torch.zeros(())
        total = self.layout.total
        self.ranges = [shard_range(total, roles.servers, s) for s in range(roles.servers)]

    def step(self) -> None:
        """Nothing: the exchange with the servers happens in `exchange`, after the step's loss is known."""

    def clip_grad_norm(self, chunks, max_norm: float, mesh: Mesh) -> torch.Tensor:
        """The worker's own global gradient norm (dp/grad_norm.py over its tp/ep groups), not clipped."""
        self.local_norm = global_grad_norm(self.layout.params, mesh)
        return self.local_norm

    def param_moments(self):
        raise RuntimeError("a parameter-server worker holds no optimizer state: the servers checkpoint it")

    def load_param_moments(self, moments, step):
        raise RuntimeError("a parameter-server worker holds no optimizer state: the servers checkpoint it")

    def state_bytes(self) -> int:
        return 0

    def hello(self) -> Reply:
        """Send the layout (worker 0 only) and this rank's parameters, install the servers'
        parameters (fresh or resumed); returns the reply (its `start`: the first step)."""
        if self.worker == 0:
            for s, server in enumerate(self.roles.server_ranks):
                try:
                    self.channel.send_object(self.layout.meta(), server)
                except RuntimeError as err:
                    raise PSPeerLost(_lost(s, server, "the hello", err)) from None
        flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in self.layout.params])
        return self._exchange(HELLO, 0, 0.0, 0.0, True, flat)

    def exchange(self, step: int, tokens: float, loss: float, finite: bool, stop: bool = False) -> Reply:
        """Push this step's gradient (and whether this rank caught SIGTERM); wait for and install
        the parameters the servers answer with."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.layout.params]
        flat = torch.cat([g.detach().reshape(-1).float().cpu() for g in grads])
        return self._exchange(PUSH, step, tokens, loss, finite, flat, stop)

    def done(self, abort: bool = False) -> None:
        """Tell every server this rank is finished (`abort`: the run stops without a save)."""
        header = torch.zeros(HEADER, dtype=torch.float64)
        header[P_KIND], header[P_STOP] = DONE, float(abort)
        works = []
        for s, server in enumerate(self.roles.server_ranks):
            lo, hi = self.ranges[s]
            works += [
                self.channel.isend(header, server, TAG_HEAD),
                self.channel.isend(torch.zeros(hi - lo), server, TAG_BODY),
            ]
        self._wait(works, "the end of the run")

    def _wait(self, works: list, what: str) -> None:
        """Wait for `works` (4 per server, in server order, or 2 for `done`); a server that is
        gone raises PSPeerLost naming it instead of gloo's traceback."""
        per = len(works) // max(1, self.roles.servers)
        for i, work in enumerate(works):
            try:
                work.wait()
            except RuntimeError as err:
                s = i // per
                raise PSPeerLost(_lost(s, self.roles.server_rank(s), what, err)) from None

    def _exchange(
        self, kind: float, step: int, tokens: float, loss: float, finite: bool, flat: torch.Tensor, stop: bool = False
    ) -> Reply:
        header = torch.zeros(HEADER, dtype=torch.float64)
        header[P_KIND], header[P_STEP], header[P_VERSION] = kind, step, self.version
        header[P_TOKENS], header[P_LOSS], header[P_FINITE] = tokens, loss, 1.0 if finite else 0.0
        header[P_NORM], header[P_STOP] = float(self.local_norm), float(stop)
        works, heads, bodies = [], [], []
        for s, server in enumerate(self.roles.server_ranks):
            lo, hi = self.ranges[s]
            body = flat[lo:hi].contiguous()
            works += [self.channel.isend(header, server, TAG_HEAD), self.channel.isend(body, server, TAG_BODY)]
            heads.append(torch.empty(HEADER, dtype=torch.float64))
            bodies.append(torch.empty(hi - lo))
            works += [
                self.channel.irecv(heads[-1], server, TAG_REPLY_HEAD),
                self.channel.irecv(bodies[-1], server, TAG_REPLY_BODY),
            ]
        self._wait(works, "the hello" if kind == HELLO else f"the exchange of step {step + 1}")
        versions = {int(h[R_VERSION]) for h in heads}
        self.version = min(versions)
        fresh = torch.cat(bodies)
        with torch.no_grad():
            for p, piece in zip(self.layout.params, torch.split(fresh, self.layout.numels)):
                p.copy_(piece.view_as(p))
        first = heads[0]
        return Reply(
            self.version,
            float(first[R_NORM]),
            float(first[R_LOSS]),
            max(float(h[R_STALE_MAX]) for h in heads),
            float(first[R_STALE_SUM]) / float(first[R_STALE_COUNT]) if first[R_STALE_COUNT] else 0.0,
            int(max(float(h[R_BYTES]) for h in heads)),
            int(first[R_START]),
            any(float(h[R_STOP]) for h in heads),
            any(float(h[R_SKIPPED]) for h in heads),
        )


def _cause(err: BaseException) -> str:
    """A short cause for a lost peer: gloo's known phrase, else the error's type."""
    text = str(err)
    for phrase in ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out"):
        if phrase in text:
            return phrase.lower()
    return type(err).__name__


def _lost(server: int, rank: int, what: str, err: BaseException) -> str:
    cause = _cause(err)
    return (
        f"parameter server {server} (global rank {rank}) is gone during {what} ({cause}); the run stops: "
        "resume from the last ps_step_N checkpoint with checkpoint.resume=auto"
    )


# ----------------------------------------------------------------------------- the run


def run_parameter_server(run, run_dir) -> dict:
    """train.py's entry for `parallel.dp_mode=ps` (training/loop.py branches here): check the
    config before any process group, start the world, then serve or train (`train_ps`)."""
    from meshtron.textdata.data import build_dataset
    from meshtron.training.distributed import agree_on_run_dir, init_distributed, launcher_env, teardown_distributed

    world_size, _, _, _ = launcher_env()
    check_ps_run(run, world_size)
    if not run.trainer.dry_run:
        try:  # every rank alike, before any process group: one line for a bad checkpoint
            run = resolve_ps_resume(run)
        except CheckpointError as err:
            raise ConfigError(f"checkpoint.resume: {err}") from err
    if run.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but this machine has no usable CUDA device; use auto or cpu")
    dataset = None
    if not run.trainer.dry_run:
        try:
            dataset = build_dataset(run.data, run.model.seq_len, run.trainer.seed, run.model.vocab_size)
        except (OSError, ValueError) as err:
            raise ConfigError(f"data: {err}") from err
    env = init_distributed(
        run.trainer.device, timeout_s=run.trainer.collective_timeout_s, num_threads=run.trainer.num_threads
    )
    try:
        run_dir = agree_on_run_dir(run_dir)
        if run.trainer.dry_run:
            return ps_dry_run(run, env, run_dir)
        with hold_checkpoint_dir(run.checkpoint.dir):  # one writer per dir, as the all-reduce path
            return train_ps(run, env, run_dir, dataset)
    except PSPeerLost as err:  # a dead peer: one line, not gloo's traceback (the others are gone too)
        say_one_line(f"meshtron: {err}")
        os._exit(1)  # the groups cannot be torn down cleanly with a peer gone
    finally:
        teardown_distributed()


def train_ps(run, env, run_dir, dataset) -> dict:
    """Every rank of the world: build the worker meshes and the servers' group (collectively),
    then serve (the last `parallel.servers` ranks) or train. Returns the worker's summary
    (history of logged records) or {"server": ServerResult}. Needs the default group."""
    from meshtron.training.precision import device_has_fast_bf16
    from meshtron.training.reporting import lr_schedule

    # trainer.precision=auto, resolved as run_training does
    run, _ = run.with_precision_for(env.device.type, device_has_fast_bf16(env.device.type))
    worker_par, workers, per_worker, micro = check_ps_run(run, env.world_size)
    roles = Roles(workers, per_worker, run.parallel.servers)
    rank = env.rank
    channel = PSChannel()  # the messages' group (host memory; gloo)
    mesh = block_mesh(worker_par, [roles.worker_rank(w, 0) for w in range(workers)], rank)
    server_group = dist.new_group(roles.server_ranks, backend="gloo") if roles.servers > 1 else None
    schedule = lr_schedule(run)
    if mesh is None:
        server = ParameterServer(run, roles, rank - roles.server_rank(0), server_group, schedule, channel)
        start = server.setup()
        if env.is_main:
            print(f"meshtron: parameter server starting at step {start}", flush=True)
        result = server.serve()
        barrier(world_group())
        return {"server": result}
    out = _train_worker(run, env, Path(run_dir), dataset, mesh, roles, micro, schedule, channel)
    barrier(world_group())
    if out.get("aborted"):  # trainer.max_skipped: every rank has finished its part, nothing saved
        if mesh.tp_rank == 0:
            say_one_line(f"meshtron: {out['aborted']}")
        raise SystemExit(1)
    return out


@dataclass
class _WorkerRun:
    """What a worker rank's step loop uses: the run, this rank's place in it (mesh, roles,
    worker index), its data, and what was built for it (the Engine, whose optimizer is the
    parameter-server client, the step reporter, the SIGTERM stopper). `bsp`: bsp, or ssp with
    staleness 0 (the servers' global loss and norm, and skips of a whole clock)."""

    run: object
    env: object
    dataset: object
    mesh: Mesh
    roles: Roles
    worker: int
    micro: int
    eos_id: int | None
    schedule: object
    engine: object
    reporter: object
    stopper: object
    bsp: bool


def _train_worker(
    run, env, run_dir: Path, dataset, mesh: Mesh, roles: Roles, micro: int, schedule, channel: PSChannel
) -> dict:
    """A worker rank's steps: its slice of each global batch through the Engine (with the
    parameter-server client as its optimizer), metrics from worker 0 (training/reporting.py)."""
    from meshtron.textdata.data import document_end_id

    worker, _ = roles.peer_of(env.rank)
    eos_id = document_end_id(run.data, run.model.vocab_size)
    engine = _build_worker_engine(run, env, mesh, roles, worker, micro, eos_id, channel)
    client = engine.optimizer
    start = client.hello().start
    reporter = _worker_reporter(run, env, run_dir, roles, start)
    if env.is_main:
        print(_worker_banner(run, roles, mesh, start, run_dir), flush=True)
    stopper = StopRequest(enabled=run.checkpoint.dir is not None)
    bsp = run.optim.sync == "bsp" or (run.optim.sync == "ssp" and run.optim.staleness == 0)
    loop = _WorkerRun(run, env, dataset, mesh, roles, worker, micro, eos_id, schedule, engine, reporter, stopper, bsp)
    try:
        stopped_after, aborted = _worker_steps(loop, start)
        client.done(abort=aborted is not None)
    finally:
        stopper.close()
        reporter.close()
        engine.close()
    if aborted is not None:
        return {"aborted": aborted}
    return _worker_summary(loop, run_dir, stopped_after)


def _build_worker_engine(run, env, mesh: Mesh, roles: Roles, worker: int, micro: int, eos_id, channel: PSChannel):
    """This worker rank's Engine on the worker's own mesh (dp=1), with the parameter-server
    client (talking to the servers over `channel`) as its optimizer. Whatever building
    communicates stays inside the worker's mesh groups; nothing is sent to the servers yet."""
    from meshtron.training.engine import Engine, EngineConfig
    from meshtron.training.precision import Precision

    def reducer_and_client(chunks, mesh_):
        reducer = DataParallelGradReducer([(n, p) for c in chunks for n, p in c.named_parameters()], mesh_)
        return reducer, ParameterServerClient(chunks, mesh_, roles, worker, channel)

    return Engine.build(
        EngineConfig.from_run(run, run.execution("torch"), micro, eos_id),
        mesh,
        env.device,
        precision=Precision(run.trainer.precision, env.device.type, None),
        optimizer_factory=reducer_and_client,
    )


def _worker_reporter(run, env, run_dir: Path, roles: Roles, start: int):
    """The worker rank's StepReporter: throughput against the peak of all the workers' ranks
    (the peak as loop.py takes it), records from step `start + 1`, written and shown by global
    rank 0 only. No communication."""
    from meshtron.planning.flops import model_flops_per_token
    from meshtron.planning.peak import peak_flops
    from meshtron.training.reporting import StepReporter

    cfg, t = run.model, run.trainer
    peak, _ = peak_flops(env.device, torch.bfloat16 if env.device.type == "cuda" else torch.float32)  # as loop.py
    return StepReporter(
        run_dir,
        t,
        tokens_per_step=t.global_batch_size * cfg.seq_len,
        flops_per_token=model_flops_per_token(cfg),
        peak_flops=peak * roles.workers * roles.per_worker,
        first=start + 1,
        write=env.is_main,
        show=env.is_main,
    )


def _worker_steps(loop: _WorkerRun, start: int) -> tuple[int | None, str | None]:
    """Steps `start` .. trainer.max_steps of this worker rank; returns (stopped_after: the step
    after which a SIGTERM stopped the run, or None; aborted: the trainer.max_skipped message, or
    None). Per step: collectives over the worker's own mesh groups, P2P with every server."""
    t = loop.run.trainer
    skipped_total = skipped_in_a_row = 0
    for step in range(start, t.max_steps):
        _test_hooks(loop.worker, step)
        out, reply, share, own, total = _worker_step(loop, step)
        loop.reporter.tick()
        # bsp: the servers skipped the whole clock (any worker's gradient or the global norm
        # not finite): every worker counts it; ssp/asp: this worker's own step
        skipped, stop = _agree_in_worker(loop.mesh, reply.skipped if loop.bsp else out.skipped, reply.stop)
        if skipped:
            skipped_total, skipped_in_a_row = skipped_total + 1, skipped_in_a_row + 1
            aborted = _report_skip(loop, step, skipped_in_a_row, skipped_total)
            if aborted is not None:
                return None, aborted
        else:
            skipped_in_a_row = 0
        if loop.reporter.log_due(step + 1):
            _log_worker_step(loop, step, reply, share, own, total, skipped_total)
        if stop and hasattr(loop.stopper, "disarm"):
            loop.stopper.disarm()  # agreed: the servers save once every worker is done
        if stop and step + 1 < t.max_steps:  # SIGTERM (a worker's or a server's): the servers save
            return step + 1, None
    return None, None


def _worker_step(loop: _WorkerRun, step: int):
    """Train this worker's slice of global batch `step`, then exchange with the servers; returns
    (the Engine's step output, the servers' reply, this worker's share of the global batch's
    mean loss, its own token count, the global batch's token count). The step communicates over
    the worker's own mesh groups; the exchange is P2P with every server (PSChannel)."""
    from meshtron.training.reporting import split_microbatches

    t, device = loop.run.trainer, loop.env.device
    inputs, targets = loop.dataset.local_batch_at(
        step * t.global_batch_size, t.global_batch_size, loop.worker, loop.roles.workers
    )
    microbatches = split_microbatches(inputs.to(device), targets.to(device), loop.micro)
    own = float(sum((y != IGNORE_INDEX).sum() for _, y in microbatches))
    total = _global_tokens(loop.dataset, step, t.global_batch_size, loop.micro, loop.mesh, loop.eos_id).to(device)
    out = loop.engine.step(microbatches, loop.schedule(step), token_count=total, outer_replicas=loop.roles.workers)
    share = float(out.loss)  # this worker's share of the global batch's mean loss
    reply = loop.engine.optimizer.exchange(step, own, share, finite=not out.skipped, stop=loop.stopper.requested)
    return out, reply, share, own, total


def _report_skip(loop: _WorkerRun, step: int, in_a_row: int, total: int) -> str | None:
    """Print a skipped step's line (global rank 0; under ssp/asp also each worker's tp rank 0);
    returns the abort message once more than trainer.max_skipped steps in a row were skipped,
    else None. No communication."""
    max_skipped = loop.run.trainer.max_skipped
    if loop.env.is_main or (loop.mesh.tp_rank == 0 and not loop.bsp):
        print(
            f"meshtron: step {step + 1} skipped: non-finite loss or gradient norm "
            f"({in_a_row} in a row, {total} in total)",
            flush=True,
        )
    if in_a_row > max_skipped:
        return (
            f"{in_a_row} consecutive steps had a non-finite loss or gradient norm "
            f"(trainer.max_skipped={max_skipped}); lower optim.lr or check the data "
            "(nothing was saved at this step)"
        )
    return None


def _log_worker_step(
    loop: _WorkerRun, step: int, reply, share: float, own: float, total: torch.Tensor, skipped_total: int
) -> None:
    """A logged step's record, with worker 0's held-out loss when evaluation is due, emitted by
    worker 0. The evaluation communicates over worker 0's own mesh groups."""
    from meshtron.training.reporting import val_microbatches

    engine, reporter = loop.engine, loop.reporter
    record = _worker_record(loop.run, engine, reporter, step, loop.schedule(step), reply, share, own, total)
    record["skipped_steps"] = skipped_total
    if reporter.eval_due(step + 1) and loop.worker == 0:  # worker 0's parameters on the whole held-out batches
        val = val_microbatches(loop.dataset, loop.run.trainer, 0, 1, loop.micro, loop.env.device)
        record["val_loss"] = float(engine.evaluate(val))
    if loop.worker == 0:
        reporter.emit(record)


def _worker_summary(loop: _WorkerRun, run_dir: Path, stopped_after: int | None) -> dict:
    """Rank 0's closing lines and the worker's summary (history of logged records), after the
    loop (the reporter and the Engine closed). No communication."""
    env, t = loop.env, loop.run.trainer
    if stopped_after is not None and env.is_main:
        print(
            f"meshtron: SIGTERM: stopped after step {stopped_after}; the servers save ps_step_N; resume with "
            "checkpoint.resume=auto",
            flush=True,
        )
    steps = t.max_steps if stopped_after is None else stopped_after
    summary = loop.reporter.summary(steps, run_dir, model=loop.engine.chunks, stopped_early=stopped_after is not None)
    if env.is_main and summary["history"]:
        print(
            f"meshtron: {'stopped' if stopped_after else 'done'}; loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}; "
            f"metrics in {run_dir / 'metrics.jsonl'}",
            flush=True,
        )
    return summary


def _agree_in_worker(mesh: Mesh, skipped: bool, stop: bool) -> tuple[bool, bool]:
    """(skipped, stop) agreed by every rank of this worker (MAX over its tp ranks): replies
    reach a worker's ranks at different moments, and they must leave the loop together."""
    if mesh.tp_dp is None:
        return skipped, stop
    flags = torch.tensor([float(skipped), float(stop)], device=collective_device())
    flags = all_reduce_stats(flags, mesh.tp_dp, "max")
    return bool(flags[0]), bool(flags[1])


def _worker_banner(run, roles: Roles, mesh: Mesh, start: int, run_dir: Path) -> str:
    """Rank 0's line before the workers' first step: workers, servers, sync, start, run dir."""
    staleness = f" staleness={run.optim.staleness}" if run.optim.sync == "ssp" else ""
    return (
        f"meshtron: parameter servers: {roles.workers} worker(s) of {roles.per_worker} rank(s) (tp={mesh.tp_size}), "
        f"{roles.servers} server(s), optim.sync={run.optim.sync}{staleness}; starting at step {start}; "
        f"run dir {run_dir}"
    )


def _test_hooks(worker: int, step: int) -> None:
    """The tests' fault hooks (MESHTRON_PS_TEST_DELAY / _KILL): a slow worker, a worker that
    dies without a word at a given step."""
    delay, kill = _env_hook(DELAY_ENV).get(worker, 0.0), _env_hook(KILL_ENV).get(worker)
    if kill is not None and step == int(kill):
        os.kill(os.getpid(), signal.SIGKILL)
    if delay:
        time.sleep(delay)


def _worker_record(
    run, engine, reporter, step: int, lr: float, reply, share: float, own: float, total: torch.Tensor
) -> dict:
    """A logged step's record: under bsp (or ssp with staleness 0) the servers' global loss and
    norm, else this worker's own (its share rescaled to its own batch)."""
    bsp = run.optim.sync == "bsp" or (run.optim.sync == "ssp" and run.optim.staleness == 0)
    local_loss = share * float(total) / max(own, 1.0)  # the mean over this worker's own batch
    worker_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters()) * 2  # weights + grad buckets
    return {
        "step": step + 1,
        "loss": reply.loss if bsp else local_loss,
        "lr": lr,
        "grad_norm": reply.grad_norm if bsp else float(engine.optimizer.local_norm) * float(total) / own,
        **reporter.throughput(),
        "staleness_max": reply.stale_max,
        "staleness_mean": reply.stale_mean,
        "server_state_bytes": reply.server_bytes,
        "worker_state_bytes": worker_bytes,
        "version": reply.version,
    }


def ps_dry_run(run, env, run_dir: Path) -> dict:
    """Per-role memory of a ps layout, printed and written to plan.json by rank 0: each
    server's parameter shard + AdamW moments (12 bytes per element) and the gradients it may
    buffer (bsp: one per worker; ssp: s+1 clocks of them plus s parameter snapshots; asp: up
    to one per worker), and each worker rank's weights + gradients (8 bytes per parameter).
    Activation memory of a worker is the planner's (`trainer.dry_run` without ps), not repeated here."""
    import json

    from meshtron.planning.plan import meta_param_counts

    worker_par, workers, per_worker, _ = check_ps_run(run, env.world_size)
    servers = run.parallel.servers
    counts = [meta_param_counts(run.model, worker_par, per_worker, t)["total"] for t in range(per_worker)]
    shard = [sum(shard_range(n, servers, s)[1] - shard_range(n, servers, s)[0] for n in counts) for s in range(servers)]
    s_ = run.optim.staleness if run.optim.sync == "ssp" else 0
    buffered = workers * (s_ + 1)
    roles = {
        "servers": [
            {
                "server": s,
                "elements": shard[s],
                "params_and_moments_bytes": 12 * shard[s],
                "buffered_gradient_bytes": 4 * shard[s] * buffered,
                "snapshot_bytes": 4 * shard[s] * s_,
                "total_bytes": 4 * shard[s] * (3 + buffered + s_),
            }
            for s in range(servers)
        ],
        "worker_ranks": [
            {"tp_rank": t, "parameters": counts[t], "weights_and_grads_bytes": 8 * counts[t]} for t in range(per_worker)
        ],
    }
    plan = {
        "dp_mode": "ps",
        "sync": run.optim.sync,
        "workers": workers,
        "ranks_per_worker": per_worker,
        "servers": servers,
        "roles": roles,
    }
    if env.is_main:
        for entry in roles["servers"]:
            print(
                f"[dry run] server {entry['server']}: {entry['elements']:,} elements, "
                f"{entry['total_bytes'] / 2**20:.1f} MiB (params+moments "
                f"{entry['params_and_moments_bytes'] / 2**20:.1f}, "
                f"buffered grads {entry['buffered_gradient_bytes'] / 2**20:.1f}, snapshots "
                f"{entry['snapshot_bytes'] / 2**20:.1f})",
                flush=True,
            )
        for entry in roles["worker_ranks"]:
            print(
                f"[dry run] worker tp rank {entry['tp_rank']}: {entry['parameters']:,} parameters, weights+grads "
                f"{entry['weights_and_grads_bytes'] / 2**20:.1f} MiB",
                flush=True,
            )
        (run_dir / "plan.json").write_text(json.dumps(plan, indent=2))
    return {"dry_run": True, "plan": plan, "run_dir": str(run_dir)}


def _global_tokens(dataset, step: int, global_batch: int, micro: int, mesh: Mesh, eos_id) -> torch.Tensor:
    """The token count of step `step`'s whole global batch, counted as training/step.py counts
    it, from the data alone: a worker (mesh of one data replica) normalises its loss by it as an
    all-reduce DP rank would, without talking to the other workers. Reads every row of the
    global batch (the targets only matter)."""
    from meshtron.training.packing import local_microbatches
    from meshtron.training.reporting import split_microbatches
    from meshtron.training.step import global_token_count

    inputs, targets = dataset.local_batch_at(step * global_batch, global_batch, 0, 1)
    return global_token_count(local_microbatches(split_microbatches(inputs, targets, micro), mesh, eos_id), mesh)
