"""Run rules shared by the training entry and the planner, each stated once with its message.

Each rule is a (holds, message) pair; callers raise their own error type (`ConfigError` at the
run's edge, ValueError in library calls) with `raise_first`. Model-shape rules live with the
model (`models/config.py`, `moe/config.py`), layout rules with the mesh (`mpu/mesh.py`).
"""

from __future__ import annotations

Check = tuple[bool, str]

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")  # what a run computes in
PRECISION_SETTINGS = ("auto", *PRECISIONS)  # what trainer.precision accepts: auto is resolved per device
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")  # trainer.compile_mode


def first_failure(checks: list[Check]) -> str | None:
    """The message of the first rule that does not hold, or None."""
    return next((message for ok, message in checks if not ok), None)


def raise_first(checks: list[Check], error: type[Exception] = ValueError) -> None:
    """Raise `error` with the message of the first rule that does not hold (every module that
    validates raises through here, each with the error type of its edge)."""
    message = first_failure(checks)
    if message is not None:
        raise error(message)


def precision_check(precision: str) -> Check:
    """`trainer.precision` names a compute precision meshtron runs, or auto."""
    return (
        precision in PRECISION_SETTINGS,
        f"trainer.precision={precision!r} is unknown; use one of {', '.join(PRECISION_SETTINGS)}",
    )


def compute_precision_check(precision: str) -> Check:
    """A precision a run computes in: auto must be resolved first (`pick_precision`)."""
    if precision == "auto":
        return (False, "trainer.precision=auto is resolved per device first (meshtron.rules.pick_precision)")
    return (precision in PRECISIONS, f"trainer.precision={precision!r} is unknown; use one of {', '.join(PRECISIONS)}")


def pick_precision(precision: str, device_type: str, bf16_supported: bool) -> tuple[str, str]:
    """`trainer.precision` resolved for the device a run computes on: an explicit choice stays;
    auto is bf16 autocast on a CUDA device with bf16 support, fp32 elsewhere (a CPU has no fast
    16-bit matmul). Returns (precision, why) — the why for the run's banner."""
    if precision != "auto":
        return precision, f"trainer.precision={precision}"
    if device_type == "cuda" and bf16_supported:
        return "bf16", "trainer.precision=auto picked bf16: a CUDA device with bf16 support"
    if device_type == "cuda":
        return "fp32", "trainer.precision=auto picked fp32: this CUDA device has no bf16 support"
    return "fp32", f"trainer.precision=auto picked fp32: {device_type} has no fast 16-bit matmul"


def param_dtype_checks(param_dtype: str, precision: str, zero: int, pp: int = 1) -> list[Check]:
    """`optim.param_dtype=bf16` (16-bit resident weights, dp/resident.py) needs bf16 compute and
    is not built for pipeline parallelism yet. (`zero` is kept for rules to come: every stage works.)"""
    if param_dtype == "fp32":
        return []
    return [
        (param_dtype == "bf16", f"optim.param_dtype={param_dtype!r} is unknown; use fp32 or bf16"),
        (  # auto is checked again once resolved for the device (RunConfig.with_precision_for)
            precision in ("bf16", "auto"),
            f"optim.param_dtype=bf16 needs trainer.precision=bf16 (got {precision!r})",
        ),
        (
            pp == 1,
            f"optim.param_dtype=bf16 does not support parallel.pp={pp} yet (tied-embedding sums across "
            f"stages are untested); use parallel.pp=1 or optim.param_dtype=fp32",
        ),
    ]


def compile_moe_checks(
    compile_moe: bool,
    *,
    num_experts: int,
    hidden_size: int,
    moe_ffn_hidden_size: int | None,
    precision: str,
    kernel_backend: str,
    recompute: str,
    zero: int,
) -> list[Check]:
    """`trainer.compile_moe=true` puts each MoE layer under torch.compile: whole where it
    traces, else its router and experts (moe/layer.py `MoELayer.compile_moe`), so any layout
    is accepted. What the compiled expert GEMM, or what is untested with it, rules out is
    refused, each with what to change."""
    if not compile_moe:
        return []
    what = "trainer.compile_moe=true"
    ffn = moe_ffn_hidden_size or 0
    return [
        (num_experts > 0, f"{what} compiles the MoE layers; this model has none (model.num_experts=0)"),
        (
            precision == "bf16",
            f"{what} needs trainer.precision=bf16 (got {precision}): torch's grouped GEMM "
            "traces in bf16 only (its meta function refuses fp32 and fp16)",
        ),
        (
            hidden_size % 8 == 0 and ffn % 8 == 0,
            f"{what} needs model.hidden_size and model.moe_ffn_hidden_size divisible by 8 (got {hidden_size} and "
            f"{ffn}): torch's grouped GEMM wants 16-byte rows, the padded fallback syncs the host",
        ),
        (
            kernel_backend != "triton",
            f"{what} traces torch's grouped GEMM; use kernels.backend=auto or torch (not triton)",
        ),
        (
            recompute != "full",
            f"{what} does not support trainer.recompute=full yet (the replay of a compiled "
            "layer is untested); use none or selective",
        ),
        (
            zero < 3,
            f"{what} does not support optim.zero=3 (its weight gathers around each block are untested "
            "with a compiled layer); use optim.zero<=2",
        ),
    ]


def compile_checks(
    compile: bool,
    *,
    compile_mode: str,
    compile_moe: bool,
    precision: str,
    kernel_backend: str,
    zero: int,
    dropout: float,
) -> list[Check]:
    """`trainer.compile=true` puts every transformer block's body under torch.compile
    (models/gpt.py `Block.compile_body`): inductor generates the blocks' kernels, the
    collectives and the context-parallel ring are graph breaks where they do not trace, so
    every tp/sp/cp/pp/ep layout and recompute mode is accepted. Refused: what it supersedes,
    what it would silently change (hand-written kernels, dropout masks) and what is untested."""
    what = "trainer.compile=true"
    if not compile:
        return [
            (
                compile_mode == "default",
                f"trainer.compile_mode={compile_mode} is a mode of trainer.compile, which is off; "
                "set trainer.compile=true or leave trainer.compile_mode=default",
            )
        ]
    return [
        (
            not compile_moe,
            f"{what} already compiles the MoE layers inside every block; set trainer.compile_moe=false "
            "(trainer.compile supersedes it)",
        ),
        (
            precision != "fp8",
            f"{what} does not support trainer.precision=fp8 yet (the FP8 GEMMs' scaling is untested "
            "under torch.compile); use fp32, bf16 or fp16",
        ),
        (
            kernel_backend != "triton",
            f"{what} lets inductor generate the blocks' kernels; use kernels.backend=auto or torch "
            "(triton forces the hand-written kernels)",
        ),
        (
            zero < 3,
            f"{what} does not support optim.zero=3 (its gathers free the weights' storage between uses, "
            "untested under a compiled block); use optim.zero<=2",
        ),
        (
            dropout == 0,
            f"{what} needs model.dropout=0 and model.attention_dropout=0 (got {dropout:g}): inductor "
            "draws dropout masks from its own random stream, which eager runs and recomputation do not replay",
        ),
    ]


def cuda_graph_checks(
    compile_mode: str,
    *,
    device_type: str,
    num_experts: int,
    ep: int,
    etp: int,
    capacity_factor: float | None,
    precision: str,
    pp: int,
) -> list[Check]:
    """`trainer.compile_mode=reduce-overhead` replays the compiled blocks as CUDA graphs: only
    on CUDA and where the step has no host sync (dense, or dropless MoE at ep = etp = 1 in
    bf16); one pipeline stage (several microbatches' forwards before their backwards are
    untested with the graphs' static buffers)."""
    if compile_mode != "reduce-overhead":
        return []
    what = "trainer.compile_mode=reduce-overhead"
    moe = num_experts > 0
    return [
        (
            device_type == "cuda",
            f"{what} captures CUDA graphs; this run computes on {device_type}: use trainer.compile_mode=default "
            "or max-autotune-no-cudagraphs",
        ),
        (
            not moe or ep * etp == 1,
            f"{what} needs a step without host syncs; the MoE all-to-all at parallel.ep={ep}, parallel.etp={etp} "
            "reads its split sizes on the host: use parallel.ep=etp=1 or trainer.compile_mode=default",
        ),
        (
            not moe or capacity_factor is None,
            f"{what} needs a step without host syncs; model.capacity_factor={capacity_factor} counts the kept "
            "pairs on the host: use model.capacity_factor=null (dropless) or trainer.compile_mode=default",
        ),
        (
            not moe or precision == "bf16",
            f"{what} needs trainer.precision=bf16 for MoE models (got {precision}): the experts' grouped GEMM "
            "pads its groups with a host sync in other precisions",
        ),
        (
            pp == 1,
            f"{what} does not support parallel.pp={pp} yet (microbatches' forwards before their backwards "
            "are untested with CUDA graphs); use parallel.pp=1 or trainer.compile_mode=default",
        ),
    ]


def local_sgd_checks(
    local_steps: int,
    outer_optimizer: str,
    *,
    zero: int,
    offload: bool,
    param_dtype: str,
    num_experts: int,
    checkpoint_dir: str | None,
    dp_mode: str = "allreduce",
) -> list[Check]:
    """Local SGD / DiLoCo (`optim.local_steps` > 1 or an outer optimizer; training/local_sgd.py)
    averages whole replicas' parameters over dp: what shards or hides them from it is refused."""
    if local_steps <= 1 and outer_optimizer == "none":
        return []
    what = f"optim.local_steps={local_steps}" + (
        f" with optim.outer_optimizer={outer_optimizer}" if outer_optimizer != "none" else ""
    )
    return [
        (
            zero == 0,
            f"{what} needs optim.zero=0 (got {zero}): ZeRO shards the optimizer state over the data "
            "replicas that local SGD keeps apart",
        ),
        (
            not offload,
            f"{what} does not support optim.offload=true (the host main weights would miss the parameter averaging)",
        ),
        (
            param_dtype == "fp32",
            f"{what} needs optim.param_dtype=fp32 (the fp32 main weights of "
            f"{param_dtype} resident weights live in the optimizer, outside the averaging)",
        ),
        (
            num_experts == 0,
            f"{what} does not support MoE models yet (expert replicas, edp, mix data replicas "
            "with ranks of one replica); use model.num_experts=0 or optim.local_steps=1",
        ),
        (
            dp_mode == "allreduce",
            f"{what} averages all-reduce data replicas; parallel.dp_mode={dp_mode} has "
            "parameter servers instead: use one of the two",
        ),
        (
            not checkpoint_dir,
            f"{what} does not save its outer state and per-replica optimizer state in "
            "checkpoints yet; unset checkpoint.dir or use optim.local_steps=1",
        ),
    ]


def batch_size_checks(global_batch_size: int, micro_batch_size: int | None) -> list[Check]:
    """Both batch sizes are positive integers (micro may be None: the whole per-rank batch)."""
    return [
        (
            isinstance(global_batch_size, int) and global_batch_size >= 1,
            f"trainer.global_batch_size={global_batch_size} must be a positive integer",
        ),
        (
            micro_batch_size is None or (isinstance(micro_batch_size, int) and micro_batch_size >= 1),
            f"trainer.micro_batch_size={micro_batch_size} must be a positive integer (or null: the whole "
            "per-rank batch)",
        ),
    ]


def batch_checks(
    global_batch_size: int, micro_batch_size: int | None, dp: int, *, pp: int = 1, schedule: str | None = None
) -> list[Check]:
    """The global batch splits into dp ranks x whole microbatches (micro None: one microbatch per
    rank), and the interleaved pipeline schedule gets a multiple of pp microbatches. A failing rule
    ends the list (the rules after it would divide by its numbers)."""
    sizes = batch_size_checks(global_batch_size, micro_batch_size)
    if first_failure(sizes):
        return sizes
    if global_batch_size % dp:
        return [
            (
                False,
                f"trainer.global_batch_size={global_batch_size} is not divisible by dp={dp}; use a multiple of {dp}",
            )
        ]
    per_rank = global_batch_size // dp
    micro = micro_batch_size or per_rank
    per_step = dp * micro
    if per_rank % micro:
        lower = max(per_step, global_batch_size // per_step * per_step)
        return [
            (
                False,
                f"trainer.global_batch_size={global_batch_size} is not divisible by "
                f"trainer.micro_batch_size={micro} * dp={dp} = {per_step}; use a global batch that is a "
                f"multiple of {per_step} (e.g. {lower} or {lower + per_step}), or change "
                "trainer.micro_batch_size / parallel.dp",
            )
        ]
    n_micro = per_rank // micro
    return [
        (
            schedule != "interleaved" or pp == 1 or n_micro % pp == 0,
            f"the interleaved schedule needs the microbatches per rank ({n_micro} = global_batch_size "
            f"{global_batch_size} / dp {dp} / micro_batch_size {micro}) divisible by pp={pp}",
        )
    ]


def microbatches(global_batch_size: int, micro_batch_size: int | None, dp: int) -> tuple[int, int]:
    """(micro batch size, microbatches per rank) of a batch that passed `batch_checks`."""
    per_rank = global_batch_size // dp
    micro = micro_batch_size or per_rank
    return micro, per_rank // micro
