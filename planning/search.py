"""Layout search: every valid layout of a model on a cluster, priced for memory by the dry-run
planner and ranked by the step-time model.

`enumerate_layouts` lists the candidates (tp, pp, vpp, dp, cp with cp_comm, ep, etp, sp, zero,
recompute, micro batch) that pass the cheap shape and batch rules the run itself applies
(`mpu.mesh.ParallelConfig.resolved` and `check_model_fits`, `meshtron.rules.batch_checks` and
`param_dtype_checks`), in a fixed order. Pruned by assumption, and said here: tp larger than a
node (its all-reduces would cross the inter-node link on every layer), and optim.zero > 0 where
it shards nothing (dp*cp = 1 and edp = 1); etp is at most a node, like tp. Where tp > 1 divides
seq_len both sp=true and sp=false are candidates, each priced as it runs: on a GPU ring SP's
all-gather and reduce-scatter cost what the all-reduces they replace cost, SP saves activation
memory (which can decide whether a layout fits) and adds a tp x dp gradient reduction for the
norm weights; on CPU gloo its reduce-scatter is dearer, so plain TP usually ranks first.

`layout_memory` is the planner's figure (`planning.plan.plan_rank`, the model built on the meta
device) for the first and the last pipeline stage (the stages that hold the embedding and the
head; middle stages hold less), the larger of the two.

`search` prices every candidate's step time (`planning.step_time.step_time`, cheap), then its
memory in order of modelled speed, and returns the candidates that fit, fastest first.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from meshtron.models.config import RECOMPUTE_MODES, ExecutionConfig, GPTConfig
from meshtron.models.fits import check_model_fits
from meshtron.mpu.mesh import ParallelConfig, ParallelConfigError
from meshtron.planning.flops import moe_layer_indices, params_per_rank
from meshtron.planning.plan import plan_rank
from meshtron.planning.step_time import Cluster, Layout, ModelCosts, StepTime, step_time
from meshtron.rules import batch_checks, first_failure, param_dtype_checks

__all__ = ["Candidate", "SearchResult", "enumerate_layouts", "layout_memory", "search", "divisors"]

ZERO_STAGES = (0, 1, 2, 3)
CP_COMMS = ("ring", "a2a")


def divisors(n: int) -> list[int]:
    """The positive divisors of `n`, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Candidate:
    """A layout with its planned peak memory per device (bytes, most loaded rank) and its
    modelled step time."""

    layout: Layout
    time: StepTime
    memory_bytes: int | None = None
    memory_source: str = ""
    fits: bool | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.time.tokens_per_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "overrides": self.layout.overrides(),
            "layout": dataclasses.asdict(self.layout),
            "memory_bytes": self.memory_bytes,
            "memory_gib": None if self.memory_bytes is None else self.memory_bytes / 1024**3,
            "memory_source": self.memory_source,
            "tokens_per_s": self.time.tokens_per_s,
            "mfu": self.time.mfu,
            "step_time_s": self.time.total,
            "step_terms": {k: v for k, v in self.time.as_dict().items() if k != "terms"},
        }


def _shape_ok(cfg: GPTConfig, par: ParallelConfig) -> bool:
    """The model splits under the resolved layout `par` (`models.fits.check_model_fits`)."""
    try:
        check_model_fits(par, cfg)
    except ParallelConfigError:
        return False
    return True


def _choices(fixed: dict[str, Any], name: str, values: Iterable) -> list:
    """The values of Layout field `name` to try: the pinned one, else `values`."""
    return [fixed[name]] if name in fixed else list(values)


def _sizes(
    world: int, gpus_per_node: int, fixed: dict[str, Any], param_dtype: str, precision: str
) -> Iterator[tuple[int, int, int, int]]:
    """(tp, cp, pp, dp) of `world` ranks in enumeration order: tp at most a node, pinned sizes
    that divide what is left, and the parameter dtype's rules passed."""
    for tp in _choices(fixed, "tp", [d for d in divisors(world) if d <= gpus_per_node]):
        for cp in _choices(fixed, "cp", divisors(world // tp)):
            for pp in _choices(fixed, "pp", divisors(world // (tp * cp))):
                if world % (tp * cp * pp):  # a pinned size that does not divide what is left
                    continue
                dp = world // (tp * cp * pp)
                if fixed.get("dp", dp) != dp or first_failure(param_dtype_checks(param_dtype, precision, 0, pp)):
                    continue
                yield tp, cp, pp, dp


def _expert_sizes(
    cfg: GPTConfig, world: int, gpus_per_node: int, fixed: dict[str, Any], tp: int, cp: int, pp: int, dp: int
) -> Iterator[tuple[int, int, ParallelConfig]]:
    """(ep, etp, the resolved ParallelConfig) of each expert split whose sizes pass
    ParallelConfig's own rules (etp at most a node; 1 and 1 for a dense model)."""
    experts = cfg.num_experts if cfg.is_moe else 0
    for ep, etp in itertools.product(
        _choices(fixed, "ep", divisors(experts) if experts else [1]),
        _choices(
            fixed, "etp", [d for d in divisors(cfg.moe_ffn_hidden_size) if d <= gpus_per_node] if experts else [1]
        ),
    ):
        try:  # the sizes' own rules, once per shape; the variants below only change vpp, sp, cp_comm
            base = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp).resolved(world)
        except ParallelConfigError:
            continue
        yield ep, etp, base


def _variants(
    cfg: GPTConfig, fixed: dict[str, Any], base: ParallelConfig, tp: int, cp: int, pp: int
) -> Iterator[ParallelConfig]:
    """Copies of `base` with each vpp, sp and cp_comm the model's shape accepts."""
    for vpp, sp, cp_comm in itertools.product(
        _choices(fixed, "vpp", divisors(cfg.num_layers // pp) if pp > 1 else [1]),
        _choices(fixed, "sp", [True, False] if tp > 1 and cfg.seq_len % tp == 0 else [False]),
        _choices(fixed, "cp_comm", CP_COMMS if cp > 1 else ["ring"]),
    ):
        par = copy.copy(base)  # ParallelConfig's field checks cost ~1 ms; the sizes passed them
        par.vpp, par.sp, par.cp_comm = vpp, sp, cp_comm
        par.schedule = "interleaved" if vpp > 1 else "1f1b"
        if _shape_ok(cfg, par):
            yield par


def _batch_layouts(
    fixed: dict[str, Any], par: ParallelConfig, sizes: dict[str, int], global_batch_size: int, experts: int
) -> Iterator[Layout]:
    """Layouts of the parallel config `par` (of `sizes`): each micro batch the batch rules
    accept, each ZeRO stage (0 only where ZeRO has no replicas) and each recompute mode."""
    tp, pp, dp, cp, ep, etp = (sizes[k] for k in ("tp", "pp", "dp", "cp", "ep", "etp"))
    per_rank = global_batch_size // dp if global_batch_size % dp == 0 else 0
    shards = dp * cp > 1 or (experts and dp * cp * tp // (ep * etp) > 1)  # ZeRO has replicas
    zeros = ZERO_STAGES if shards else (0,)
    for mbs in _choices(fixed, "micro_batch_size", divisors(per_rank) if per_rank else []):
        if first_failure(batch_checks(global_batch_size, mbs, dp, pp=pp, schedule=par.schedule)):
            continue
        for zero, rec in itertools.product(
            _choices(fixed, "zero", zeros), _choices(fixed, "recompute", RECOMPUTE_MODES)
        ):
            yield Layout(
                **sizes, vpp=par.vpp, sp=par.sp, cp_comm=par.cp_comm, zero=zero, recompute=rec, micro_batch_size=mbs
            )


def enumerate_layouts(
    cfg: GPTConfig,
    world: int,
    *,
    global_batch_size: int,
    gpus_per_node: int,
    fixed: dict[str, Any] | None = None,
    param_dtype: str = "fp32",
    precision: str = "fp32",
) -> list[Layout]:
    """Every `Layout` of `world` ranks the run's rules accept for `cfg` and the global batch
    (module docstring: what is pruned). `fixed` pins fields of `Layout` (e.g. {"tp": 2,
    "zero": 1}: what the user set on the command line). Pure arithmetic."""
    fixed = dict(fixed or {})
    unknown = set(fixed) - {f.name for f in dataclasses.fields(Layout)}
    if unknown:
        raise ValueError(f"cannot pin {sorted(unknown)}: not a layout field")
    experts = cfg.num_experts if cfg.is_moe else 0
    out: list[Layout] = []
    for tp, cp, pp, dp in _sizes(world, gpus_per_node, fixed, param_dtype, precision):
        for ep, etp, base in _expert_sizes(cfg, world, gpus_per_node, fixed, tp, cp, pp, dp):
            sizes = dict(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp)
            for par in _variants(cfg, fixed, base, tp, cp, pp):
                out.extend(_batch_layouts(fixed, par, sizes, global_batch_size, experts))
    return out


def layout_memory(
    cfg: GPTConfig,
    layout: Layout,
    *,
    global_batch_size: int,
    precision: str = "fp32",
    device: str = "cuda",
    offload: bool = False,
    param_dtype: str = "fp32",
    fused_lm_loss: bool = True,
) -> dict[str, Any]:
    """Planned peak bytes per device of `layout` (the larger of its first and last pipeline
    stage, `planning.plan.plan_rank`; the LM head and loss fused or not, trainer.fused_lm_loss),
    the parameters of that rank by gradient-reduction group and where the figure comes from."""
    world = layout.world
    par = layout.parallel_config()
    execution = ExecutionConfig(recompute=layout.recompute, fused_lm_loss=fused_lm_loss)
    best = None
    for stage in sorted({0, layout.pp - 1}):
        plan = plan_rank(
            cfg,
            par,
            world,
            stage * (world // layout.pp),
            micro_batch_size=layout.micro_batch_size,
            global_batch_size=global_batch_size,
            precision=precision,
            zero=layout.zero,
            offload=offload,
            param_dtype=param_dtype,
            device=device,
            execution=execution,
        )
        total = plan["memory"]["bytes"]["total"]
        if best is None or total > best[0]:
            best = (total, plan["params"]["by_replica_group"])
    source = "planning.plan.plan_rank (meta device), first and last stage"
    return {"bytes": best[0], "grad_elements": dict(best[1]), "source": source}


def _analytic_grad_elements(cfg: GPTConfig, layout: Layout) -> dict[str, int]:
    """Parameters of the most loaded rank by gradient group, for ranking before the planner
    runs (the planner's meta counts replace it for every candidate it prices)."""
    total = params_per_rank(cfg, tp=layout.tp, ep=layout.ep, etp=layout.etp, pp=layout.pp)
    if not cfg.is_moe:
        return {"dp": total}
    per_expert = (2 if cfg.activation == "gelu" else 3) * cfg.hidden_size * cfg.moe_ffn_hidden_size // layout.etp
    moe_layers = -(-len(moe_layer_indices(cfg)) // layout.pp)  # the most loaded stage's
    experts = moe_layers * (cfg.num_experts // layout.ep) * per_expert
    return {"dp": total - experts, "edp": experts}


@dataclass
class SearchResult:
    """Candidates that fit, fastest first, and what the search did."""

    ranked: list[Candidate]
    enumerated: int
    priced: int
    too_big: int
    seconds: float


def _time_layouts(cfg: GPTConfig, cluster: Cluster, layouts: list[Layout], timing: dict[str, Any]) -> list[Candidate]:
    """A `Candidate` of each layout with its step time from the analytic parameter count
    (`timing`: step_time's keyword arguments), fastest first."""
    grads: dict[tuple, dict[str, int]] = {}
    timed = []
    for lay in layouts:
        key = (lay.tp, lay.ep, lay.etp, lay.pp)
        if key not in grads:
            grads[key] = _analytic_grad_elements(cfg, lay)
        timed.append(Candidate(lay, step_time(cfg, lay, cluster, grad_elements=grads[key], **timing)))
    timed.sort(key=lambda c: -c.tokens_per_s)
    return timed


def _price_memory(
    cfg: GPTConfig,
    cluster: Cluster,
    timed: list[Candidate],
    timing: dict[str, Any],
    memory: dict[str, Any],
    limit: int | None,
    max_priced: int | None,
) -> tuple[list[Candidate], int, int]:
    """Price `timed` candidates' memory in order (`memory`: layout_memory's keyword arguments),
    skipping those a variant needing no more memory already ruled out, and retime each that fits
    from the planner's parameter counts. Returns (the fitting candidates, priced, too big)."""
    fitting: list[Candidate] = []
    priced = too_big = 0
    failed: dict[Layout, list[tuple[int, int]]] = {}  # layout sans recompute/micro batch -> (rank, mbs)
    order = {mode: i for i, mode in enumerate(RECOMPUTE_MODES)}
    for cand in timed:
        if (limit is not None and len(fitting) >= limit) or (max_priced is not None and priced >= max_priced):
            break
        lay = cand.layout
        base = dataclasses.replace(lay, recompute="none", micro_batch_size=0)
        if any(r >= order[lay.recompute] and mbs <= lay.micro_batch_size for r, mbs in failed.get(base, [])):
            too_big += 1
            continue
        mem = layout_memory(cfg, cand.layout, **memory)
        priced += 1
        cand.memory_bytes, cand.memory_source = mem["bytes"], mem["source"]
        cand.fits = mem["bytes"] <= cluster.gpu_memory_bytes
        if not cand.fits:
            too_big += 1
            failed.setdefault(base, []).append((order[lay.recompute], lay.micro_batch_size))
            continue
        cand.time = step_time(cfg, cand.layout, cluster, grad_elements=mem["grad_elements"], **timing)
        fitting.append(cand)
    return fitting, priced, too_big


def search(
    cfg: GPTConfig,
    cluster: Cluster,
    *,
    global_batch_size: int,
    precision: str = "fp32",
    param_dtype: str = "fp32",
    offload: bool = False,
    fused_lm_loss: bool = True,
    fixed: dict[str, Any] | None = None,
    limit: int | None = None,
    max_priced: int | None = None,
) -> SearchResult:
    """Rank the layouts of `cfg` on `cluster` that fit its memory by modelled tokens/s.

    Every candidate of `enumerate_layouts` gets a step time from the analytic parameter count;
    the memory planner then runs in order of that speed (cached per layout; `limit`: stop after
    that many fitting candidates, None = price all; `max_priced`: stop after pricing that many)
    and each priced candidate's step time is recomputed from the planner's own parameter counts.
    A candidate is not priced when a variant of it that needs no more memory (more recompute, a
    smaller or equal micro batch, all else equal) did not fit: activation memory grows with the
    micro batch and shrinks with recomputation. Raises ValueError when no layout is valid. No
    communication.
    """
    start = time.perf_counter()
    layouts = enumerate_layouts(
        cfg,
        cluster.gpus,
        global_batch_size=global_batch_size,
        gpus_per_node=cluster.gpus_per_node,
        fixed=fixed,
        param_dtype=param_dtype,
        precision=precision,
    )
    if not layouts:
        raise ValueError(
            f"no valid layout of {cluster.gpus} devices for this model and global batch "
            f"{global_batch_size}" + (f" with {fixed}" if fixed else "")
        )
    timing = dict(
        global_batch_size=global_batch_size, costs=ModelCosts.of(cfg), precision=precision, param_dtype=param_dtype
    )
    timed = _time_layouts(cfg, cluster, layouts, timing)
    memory = dict(
        global_batch_size=global_batch_size,
        precision=precision,
        device=cluster.device,
        offload=offload,
        param_dtype=param_dtype,
        fused_lm_loss=fused_lm_loss,
    )
    fitting, priced, too_big = _price_memory(cfg, cluster, timed, timing, memory, limit, max_priced)
    fitting.sort(key=lambda c: (-c.tokens_per_s, c.memory_bytes))
    return SearchResult(fitting, len(layouts), priced, too_big, time.perf_counter() - start)
