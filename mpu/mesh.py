"""The device mesh: dense dims pp x dp x cp x tp and expert dims pp x edp x ep x etp over the same ranks.

Ranks are laid out with tp fastest-varying (a TP group sits inside one node), then cp
(context parallelism: each rank of a cp group holds 2 of the 2*cp load-balanced chunks of
every sequence, `mpu.context_parallel`), then dp. Expert layers fold the same ranks into
pp x edp x ep x etp (etp fastest), independently of the dense layout, so 8 ranks can run
attention at tp=4, dp=2 and experts at ep=8 ("parallel folding"); cp folds in the way dp
does (edp = dp*cp*tp / (ep*etp)), so MoE layers see distinct tokens on every rank.

Groups that follow from cp: parameters replicated over cp see different tokens on each cp
rank, so their gradients are summed over `dp_cp` (dp x cp), as are the loss and the token
count of the global batch; the ranks holding one microbatch's sequence are `tp_cp`.

`ParallelConfig` checks its fields when built (meshtron/schema.py) and `resolved` every size
against the world and raises
`ParallelConfigError` with a message that names the numbers and what to change.
A `Mesh` with world size 1 needs no process group at all: every group is `None` and every
collective in `mpu` is skipped for groups of size 1.

Placement over nodes: torchrun gives each node (agent) consecutive global ranks, so with
`ranks_per_node` (LOCAL_WORLD_SIZE, checked equal on every node by training/distributed.py)
node = rank // ranks_per_node. The rank order is never changed: tp (fastest-varying) stays
inside a node exactly when tp divides ranks_per_node, and ep x etp likewise. `placement`
computes from the groups' rank lists which groups span nodes; `Mesh.describe` shows it and
`Mesh.placement_warnings` names tp/ep/etp groups that cross nodes. A spanning layout is
warned about, never refused: it runs correctly, only slower, and a user may want it (e.g. ep
across nodes for many experts, or tp=2 over two single-GPU machines).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshtron.rules import Check, raise_first
from meshtron.schema import Allowed, field_checks, setting

# The pipeline schedules `parallel.schedule` may name (meshtron.pipeline.schedules builds them;
# the names live here so the config's check needs nothing above mpu).
SCHEDULES = ("gpipe", "1f1b", "interleaved")


class ParallelConfigError(ValueError):
    """A parallel layout that cannot work; the message says what to change."""


@dataclass
class ParallelConfig:
    """Parallel sizes. `dp=None` means world // (tp * cp * pp); `ep`/`etp` describe the expert
    mesh; `cp`/`cp_comm` context parallelism (ring: KV blocks passed around the cp group;
    a2a: Ulysses all-to-all from sequence to head shards)."""

    tp: int = setting(1, ge=1, help="tensor-parallel size")
    pp: int = setting(1, ge=1, help="pipeline-parallel stages")
    dp: int | None = setting(None, ge=1, help="null = world / (tp * cp * pp)")
    cp: int = setting(
        1, ge=1, help="context parallelism: each sequence split over cp ranks (2*cp load-balanced chunks)"
    )
    cp_comm: str = setting(
        "ring",
        choices=("ring", "a2a"),
        help="ring (KV blocks passed around the cp group) | a2a (Ulysses: heads all-to-all)",
    )
    ep: int = setting(1, ge=1, help="expert parallelism: the experts split over ep ranks")
    etp: int = setting(1, ge=1, help="expert tensor parallelism: each expert's ffn split over etp ranks")
    sp: bool = setting(
        False, help="sequence parallelism: with tp > 1, activations outside the tp regions split over tp"
    )
    vpp: int = setting(1, ge=1, help="virtual pipeline stages per rank (with schedule=interleaved)")
    schedule: str = setting("1f1b", choices=SCHEDULES, help="gpipe | 1f1b | interleaved (with vpp > 1)")
    # "dp" gradient buckets: reduce-scatter in a node, all-reduce across nodes, all-gather
    # (dp/hierarchical.py); auto = when the dp x cp groups span nodes with > 1 rank on each
    dp_hierarchical: bool | str = setting(
        "auto",
        choices=(True, False, "auto"),
        help="true = dp gradient all-reduce in 3 stages (reduce-scatter in a node, all-reduce across nodes, "
        "all-gather); auto = when dp spans nodes with > 1 rank on each (ZeRO 0/1)",
    )
    # pp * vpp entries
    stage_layers: list[int] | None = setting(
        None, items=Allowed(ge=1), help="layers per virtual stage, e.g. [3, 5]; null = even split"
    )
    # allreduce: gradients all-reduced over dp; ps: `servers` extra ranks (the last ones) hold the
    # parameters and AdamW state, dp = the workers (training/param_server.py)
    dp_mode: str = setting(
        "allreduce",
        choices=("allreduce", "ps"),
        help="allreduce | ps (parameter servers: the last `servers` ranks hold weights + AdamW state)",
    )
    servers: int = setting(
        0, ge=0, help="parameter-server ranks (dp_mode=ps needs >= 1); workers = (world - servers) / (tp*cp*pp)"
    )

    def __post_init__(self) -> None:
        raise_first(
            [
                *field_checks("parallel", self),
                (
                    self.vpp == 1 or self.schedule == "interleaved",
                    f"parallel.vpp={self.vpp} needs parallel.schedule=interleaved",
                ),
                (
                    self.dp_mode != "ps" or self.servers >= 1,
                    "parallel.dp_mode=ps needs parallel.servers >= 1 (ranks holding the parameters)",
                ),
                (
                    self.dp_mode == "ps" or self.servers == 0,
                    f"parallel.servers={self.servers} needs parallel.dp_mode=ps (or set parallel.servers=0)",
                ),
            ],
            ParallelConfigError,
        )

    def resolved(self, world_size: int) -> ParallelConfig:
        """Return a copy with dp filled in and every size checked against `world_size`."""
        out = ParallelConfig(**{k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in self.__dict__.items()})
        if out.dp_mode == "ps":  # the server ranks are outside the training mesh; dp counts the workers
            if world_size <= out.servers:
                raise ParallelConfigError(
                    f"parallel.servers={out.servers} leaves no worker rank in world size "
                    f"{world_size}; start more processes or use fewer servers"
                )
            world_size -= out.servers
        model = out.tp * out.cp * out.pp
        if world_size % model != 0:
            sizes = (
                f"tp*cp*pp={model} (tp={out.tp}, cp={out.cp}, pp={out.pp})"
                if out.cp > 1
                else f"tp*pp={model} (tp={out.tp}, pp={out.pp})"
            )
            raise ParallelConfigError(
                f"world size {world_size} is not divisible by {sizes}; "
                f"change parallel.tp/parallel.pp{'/parallel.cp' if out.cp > 1 else ''} or the number of processes"
            )
        if out.dp is None:
            out.dp = world_size // model
        if out.dp < 1 or model * out.dp != world_size:
            names = "tp*cp*pp*dp" if out.cp > 1 else "tp*pp*dp"
            values = f"{out.tp}*{out.cp}*{out.pp}*{out.dp}" if out.cp > 1 else f"{out.tp}*{out.pp}*{out.dp}"
            raise ParallelConfigError(
                f"{names}={values}={model * out.dp} does not equal "
                f"world size {world_size}; set parallel.dp={world_size // model} or leave it unset"
            )
        if (world_size // out.pp) % (out.ep * out.etp) != 0:
            raise ParallelConfigError(
                f"ep*etp={out.ep}*{out.etp}={out.ep * out.etp} does not divide the {world_size // out.pp} "
                f"ranks of a pipeline stage (world size {world_size} / pp={out.pp}); "
                f"change parallel.ep/parallel.etp"
            )
        return out

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: ranks per stage not used by ep*etp."""
        assert self.dp is not None, "call resolved() first"
        return self.dp * self.cp * self.tp // (self.ep * self.etp)


def expert_shard_checks(
    num_experts: int, moe_ffn_hidden_size: int, shared_experts: int, *, ep: int, etp: int, tp: int
) -> list[tuple[bool, str]]:
    """How experts split over the expert mesh, as (holds, message) pairs: experts over ep, each
    expert's ffn over etp, the shared experts' width (tensor-parallel) over tp."""
    shared = moe_ffn_hidden_size * shared_experts
    return [
        (num_experts % ep == 0, f"ep={ep} does not divide num_experts={num_experts}; choose parallel.ep dividing it"),
        (moe_ffn_hidden_size % etp == 0, f"etp={etp} does not divide moe_ffn_hidden_size={moe_ffn_hidden_size}"),
        (
            shared % tp == 0,
            f"tp={tp} does not divide the shared experts' width moe_ffn_hidden_size * shared_experts = {shared} "
            "(they are tensor-parallel); choose parallel.tp dividing it",
        ),
    ]


class FitsLayout(Protocol):
    """A model config that says whether a layout can split it (models.config.GPTConfig, whose
    rules live in models/fits.py: the mesh does not know model shapes)."""

    def layout_checks(self, par: ParallelConfig) -> list[Check]: ...


def dim_groups(par: ParallelConfig, world_size: int) -> dict[str, list[list[int]]]:
    """The rank lists of every group of each mesh dim (`par` resolved for `world_size`), in the
    order torch's DeviceMesh forms them: dense pp x dp x cp x tp, expert pp x edp x ep x etp."""
    ranks = torch.arange(world_size)
    dense = ranks.view(par.pp, par.dp, par.cp, par.tp)
    expert = ranks.view(par.pp, par.edp, par.ep, par.etp)

    def groups(grid: torch.Tensor, dim: int) -> list[list[int]]:
        moved = grid.movedim(dim, -1)
        return moved.reshape(-1, moved.shape[-1]).tolist()

    return {
        "tp": groups(dense, 3),
        "cp": groups(dense, 2),
        "dp": groups(dense, 1),
        "pp": groups(dense, 0),
        "ep": groups(expert, 2),
        "etp": groups(expert, 3),
        "edp": groups(expert, 1),
    }


@dataclass(frozen=True)
class DimPlacement:
    """How the groups of one mesh dim lie over nodes: `spanning` of `groups` groups hold
    ranks of more than one node, the widest over `max_nodes` nodes."""

    name: str
    size: int
    groups: int
    spanning: int
    max_nodes: int

    @property
    def intra_node(self) -> bool:
        return self.spanning == 0

    def label(self) -> str:
        """e.g. "tp=2 (intra-node)", "dp=4 (spans 2 nodes)", "tp=3 (2 of 4 groups span 2 nodes)"."""
        if self.size == 1:
            return f"{self.name}=1"
        if self.intra_node:
            return f"{self.name}={self.size} (intra-node)"
        if self.spanning == self.groups:
            return f"{self.name}={self.size} (spans {self.max_nodes} nodes)"
        return f"{self.name}={self.size} ({self.spanning} of {self.groups} groups span {self.max_nodes} nodes)"


def placement(par: ParallelConfig, world_size: int, ranks_per_node: int) -> dict[str, DimPlacement]:
    """For each mesh dim, which of its groups span nodes when node = rank // ranks_per_node
    (torchrun's assignment); computed from the rank lists, no process group needed."""
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise ParallelConfigError(f"{ranks_per_node} ranks per node do not divide world size {world_size}")
    out = {}
    for name, groups in dim_groups(par, world_size).items():
        nodes = [len({r // ranks_per_node for r in g}) for g in groups]
        out[name] = DimPlacement(name, len(groups[0]), len(groups), sum(n > 1 for n in nodes), max(nodes))
    return out


# dims whose groups should stay inside a node, and what crossing the inter-node link costs
_INTRA_NODE_DIMS = {
    "tp": "TP all-reduces cross the inter-node link",
    "ep": "expert all-to-alls cross the inter-node link (allowed; common when experts need many ranks)",
    "etp": "expert TP all-reduces cross the inter-node link",
}


def placement_warnings(par: ParallelConfig, world_size: int, ranks_per_node: int) -> list[str]:
    """One line per tp/ep/etp dim with a group spanning nodes, e.g. "parallel.tp=8 spans 2
    nodes of 4 ranks: TP all-reduces cross the inter-node link; use tp <= 4"."""
    lines = []
    of = f"of {ranks_per_node} rank{'s' if ranks_per_node > 1 else ''}"
    for name, where in placement(par, world_size, ranks_per_node).items():
        if name not in _INTRA_NODE_DIMS or where.intra_node:
            continue
        if where.spanning == where.groups:
            span = f"spans {where.max_nodes} nodes {of}"
        else:
            span = f"has {where.spanning} of {where.groups} groups spanning {where.max_nodes} nodes {of}"
        line = f"parallel.{name}={where.size} {span}: {_INTRA_NODE_DIMS[name]}"
        if name != "ep":
            line += (
                f"; use {name} <= {ranks_per_node}"
                if where.size > ranks_per_node
                else f"; use a {name} that divides {ranks_per_node}"
            )
        lines.append(line)
    return lines


@dataclass(eq=False, frozen=True)
class VirtualGroup:
    """A group of a layout planned without processes (`virtual_mesh`): its planned `size` and
    this rank's place in it (`rank`). No process communicates over it, so `group_size` and
    `group_rank` read it as the trivial group of one; only the collectives of `mpu.mappings`
    read `size` and `rank`, and only on tensors without data (meta or fake: the planner's
    shape-only tracing), to return outputs shaped as the real collective's."""

    size: int
    rank: int


def group_size(group) -> int:
    """Size of a process group; `None` (no distributed setup) and a `VirtualGroup` stand for a
    group of one."""
    return 1 if group is None or isinstance(group, VirtualGroup) else dist.get_world_size(group)


def group_rank(group) -> int:
    """This process's rank in `group`; 0 for the trivial group `None` and a `VirtualGroup`."""
    return 0 if group is None or isinstance(group, VirtualGroup) else dist.get_rank(group)


def collective_device(group=None) -> torch.device:
    """The device whose tensors collectives and point-to-point ops over `group` (torch's
    convention: None is the default, world group) must use: the current CUDA device on NCCL,
    the CPU on gloo and without any process group. Every mesh group is created with the
    world's backend, so for them the answer is the world's."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Mesh:
    """Process groups of one parallel layout.

    Attributes are torch process groups (or None when the dim has size 1 and no
    communication is needed): `tp`, `cp`, `dp`, `pp`, `ep`, `etp`, `edp`, `dp_cp` (dp x cp:
    gradients of replicated parameters, the global batch's loss and token count), `tp_cp`
    (cp x tp: the ranks holding one microbatch's sequence; MoE routing statistics), `tp_dp`
    (every rank of a stage, dp x cp x tp: gradients of sequence-parallel replicated
    parameters, global MoE statistics), `ep_etp` (one replica's expert shards: expert gradient
    norm) and `embedding` (first and last pipeline stage of one (dp, cp, tp) position: tied
    embeddings). Without cp, `dp_cp` is `dp` and `tp_cp` is `tp` (the same group objects).
    Coordinates: `tp_rank`, `cp_rank`, `dp_rank`, `pp_rank`, `edp_rank`, `ep_rank`, `etp_rank`.
    """

    def __init__(
        self,
        par: ParallelConfig,
        world_size: int,
        rank: int,
        device_type: str = "cpu",
        create_groups: bool = True,
        ranks_per_node: int | None = None,
    ):
        self.par = par
        self.world_size = world_size
        self.rank = rank
        self.device_type = device_type
        # node = rank // ranks_per_node (torchrun's consecutive ranks per agent); None: one node
        self.ranks_per_node = ranks_per_node or world_size
        if world_size % self.ranks_per_node:
            raise ParallelConfigError(f"{self.ranks_per_node} ranks per node do not divide world size {world_size}")
        self.num_nodes = world_size // self.ranks_per_node
        self.node = rank // self.ranks_per_node
        self._set_coordinates()
        self.dense_mesh: DeviceMesh | None = None
        self.expert_mesh: DeviceMesh | None = None
        self.tp = self.dp = self.pp = self.ep = self.etp = self.edp = self.tp_dp = self.ep_etp = None
        self.cp = self.dp_cp = self.tp_cp = None
        self.embedding = None
        if world_size == 1 or not create_groups:
            return
        self._create_groups()

    def _set_coordinates(self) -> None:
        """This rank's coordinates on the dense (pp, dp, cp, tp) and expert (pp, edp, ep, etp)
        grids, tp and etp fastest-varying. No communication."""
        par = self.par
        dp, cp, tp = par.dp, par.cp, par.tp
        ep, etp, edp = par.ep, par.etp, par.edp
        self.pp_rank, rem = divmod(self.rank, dp * cp * tp)
        self.dp_rank, rem = divmod(rem, cp * tp)
        self.cp_rank, self.tp_rank = divmod(rem, tp)
        _, rem = divmod(self.rank, edp * ep * etp)
        self.edp_rank, rem = divmod(rem, ep * etp)
        self.ep_rank, self.etp_rank = divmod(rem, etp)

    def _create_groups(self) -> None:
        """Every process group of the layout, created by every rank in the same order (torch
        requires it), keeping the ones that hold this rank: the two device meshes' dims, then
        the flattened groups (`_create_flattened_groups`)."""
        par, device_type = self.par, self.device_type
        pp, dp, cp, tp = par.pp, par.dp, par.cp, par.tp
        ep, etp, edp = par.ep, par.etp, par.edp
        ranks = torch.arange(self.world_size)
        self.dense_mesh = DeviceMesh(device_type, ranks.view(pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
        self.expert_mesh = DeviceMesh(
            device_type, ranks.view(pp, edp, ep, etp), mesh_dim_names=("pp", "edp", "ep", "etp")
        )
        dense, expert = self.dense_mesh, self.expert_mesh
        self.tp = dense.get_group("tp") if tp > 1 else None
        self.dp = dense.get_group("dp") if dp > 1 else None
        self.cp = dense.get_group("cp") if cp > 1 else None
        self.pp = dense.get_group("pp") if pp > 1 else None
        self.ep = expert.get_group("ep") if ep > 1 else None
        self.etp = expert.get_group("etp") if etp > 1 else None
        self.edp = expert.get_group("edp") if edp > 1 else None
        self._create_flattened_groups(ranks)

    def _create_flattened_groups(self, ranks: torch.Tensor) -> None:
        """The groups across mesh dims: a pipeline stage's ranks (`tp_dp`), dp x cp and cp x tp,
        the first and last stage's tied-embedding pairs, and ep x etp. Every rank creates all
        of them, in this order."""
        par, rank = self.par, self.rank
        pp, dp, cp, tp = par.pp, par.dp, par.cp, par.tp
        ep, etp, edp = par.ep, par.etp, par.edp
        # dp x cp x tp flattened: every rank of a pipeline stage.
        self.tp_dp = None
        if tp * cp * dp > 1:
            for stage in range(pp):
                members = ranks.view(pp, dp * cp * tp)[stage].tolist()
                group = dist.new_group(members)
                if stage == self.pp_rank:
                    self.tp_dp = group
        # Without cp these are the dp and tp groups themselves (no extra communicators).
        self.dp_cp, self.tp_cp = self.dp, self.tp
        if cp > 1:
            self.dp_cp = self._flattened_groups(ranks.view(pp, dp, cp, tp).permute(0, 3, 1, 2).reshape(-1, dp * cp))
            self.tp_cp = self._flattened_groups(ranks.view(-1, cp * tp))
        # First and last pipeline stage at the same (dp, cp, tp) position: tied embedding copies.
        if pp > 1:
            grid = ranks.view(pp, dp * cp * tp)
            for position in range(dp * cp * tp):
                members = [int(grid[0, position]), int(grid[pp - 1, position])]
                group = dist.new_group(members)
                if rank in members:
                    self.embedding = group
        # ep x etp flattened: the ranks holding distinct expert shards (one edp replica).
        if ep * etp > 1:
            blocks = ranks.view(pp * edp, ep * etp)
            for index in range(pp * edp):
                group = dist.new_group(blocks[index].tolist())
                if rank in blocks[index].tolist():
                    self.ep_etp = group

    def _flattened_groups(self, rows: torch.Tensor):
        """Create one group per row of `rows` (every rank takes part in every creation, as torch
        requires) and return the one holding this rank (None when a row has one rank)."""
        mine = None
        for row in rows.tolist():
            if len(row) == 1:
                continue
            group = dist.new_group(row)
            if self.rank in row:
                mine = group
        return mine

    @functools.cached_property
    def nodes(self) -> dict[str, DimPlacement]:
        """Per mesh dim: how many of its groups span nodes (computed on first use: the planner
        builds a virtual mesh per rank and never asks)."""
        return placement(self.par, self.world_size, self.ranks_per_node)

    @property
    def tp_size(self) -> int:
        return self.par.tp

    @property
    def dp_size(self) -> int:
        return self.par.dp

    @property
    def pp_size(self) -> int:
        return self.par.pp

    @property
    def cp_size(self) -> int:
        return self.par.cp

    @property
    def dp_cp_size(self) -> int:
        """Ranks of a stage holding distinct tokens at one tp position: the gradient replicas."""
        return self.par.dp * self.par.cp

    @property
    def sequence_parallel(self) -> bool:
        return bool(self.par.sp and self.par.tp > 1)

    def describe(self) -> str:
        p = self.par
        cp, cp_rank = (f"cp={p.cp} ", f"cp_rank={self.cp_rank} ") if p.cp > 1 else ("", "")
        return (
            f"rank {self.rank}/{self.world_size}: dense pp={p.pp} dp={p.dp} {cp}tp={p.tp} "
            f"(pp_rank={self.pp_rank} dp_rank={self.dp_rank} {cp_rank}tp_rank={self.tp_rank}); "
            f"expert edp={p.edp} ep={p.ep} etp={p.etp}; sp={self.sequence_parallel}; {self.describe_placement()}"
        )

    def describe_placement(self) -> str:
        """Nodes x ranks per node and, per dim (dense | expert), whether its groups stay inside a
        node, e.g. "placement 2 nodes x 4 ranks: tp=2 (intra-node) dp=4 (spans 2 nodes) pp=1 |
        edp=8 (spans 2 nodes) ep=1 etp=1"."""
        n = self.num_nodes
        r = self.ranks_per_node
        head = f"placement {n} node{'s' if n > 1 else ''} x {r} rank{'s' if r > 1 else ''}"
        if n == 1:
            return head + " (every group intra-node)"
        dense = " ".join(self.nodes[d].label() for d in ("tp", "cp", "dp", "pp") if d != "cp" or self.par.cp > 1)
        expert = " ".join(self.nodes[d].label() for d in ("edp", "ep", "etp"))
        return f"{head}: {dense} | {expert}"

    def placement_warnings(self) -> list[str]:
        """tp/ep/etp dims with groups spanning nodes, one line each (printed once by rank 0)."""
        return placement_warnings(self.par, self.world_size, self.ranks_per_node)


def build_mesh(
    par: ParallelConfig,
    model_cfg: FitsLayout | None = None,
    device_type: str = "cpu",
    ranks_per_node: int | None = None,
) -> Mesh:
    """Validate `par` (and the model shape) against the current world, then build the groups.
    `ranks_per_node` (LOCAL_WORLD_SIZE, equal on every node) places ranks on nodes for
    `describe` and the placement warnings; None means one node.

    Requires `torch.distributed` to be initialized when the world has more than one process.
    Validation happens identically on every rank before any group is created, so a bad
    layout raises everywhere instead of hanging.
    """
    if dist.is_available() and dist.is_initialized():
        world_size, rank = dist.get_world_size(), dist.get_rank()
    else:
        world_size, rank = 1, 0
    resolved = par.resolved(world_size)
    if model_cfg is not None:
        raise_first(model_cfg.layout_checks(resolved), ParallelConfigError)
    return Mesh(resolved, world_size, rank, device_type, ranks_per_node=ranks_per_node)


def virtual_mesh(par: ParallelConfig, world_size: int, rank: int) -> Mesh:
    """Coordinates of `rank` in a layout without any process group: for planning on the meta
    device (building a rank's shards without running collectives). Each group of more than one
    rank is a `VirtualGroup` of its planned size and this rank's place in it."""
    mesh = Mesh(par.resolved(world_size), world_size, rank, create_groups=False)
    p = mesh.par

    def group(size: int, index: int) -> VirtualGroup | None:
        return VirtualGroup(size, index) if size > 1 else None

    mesh.tp, mesh.dp, mesh.pp = group(p.tp, mesh.tp_rank), group(p.dp, mesh.dp_rank), group(p.pp, mesh.pp_rank)
    mesh.cp = group(p.cp, mesh.cp_rank)
    mesh.ep, mesh.etp, mesh.edp = group(p.ep, mesh.ep_rank), group(p.etp, mesh.etp_rank), group(p.edp, mesh.edp_rank)
    mesh.tp_dp = group(p.tp * p.cp * p.dp, (mesh.dp_rank * p.cp + mesh.cp_rank) * p.tp + mesh.tp_rank)
    mesh.dp_cp = group(p.dp * p.cp, mesh.dp_rank * p.cp + mesh.cp_rank) if p.cp > 1 else mesh.dp
    mesh.tp_cp = group(p.cp * p.tp, mesh.cp_rank * p.tp + mesh.tp_rank) if p.cp > 1 else mesh.tp
    mesh.ep_etp = group(p.ep * p.etp, mesh.ep_rank * p.etp + mesh.etp_rank)
    if p.pp > 1 and mesh.pp_rank in (0, p.pp - 1):
        mesh.embedding = VirtualGroup(2, 0 if mesh.pp_rank == 0 else 1)
    return mesh


def single_process_mesh(par: ParallelConfig | None = None) -> Mesh:
    """A world-of-one mesh (no process groups); `par` may only hold size-1 dims."""
    return Mesh((par or ParallelConfig()).resolved(1), 1, 0)
