"""Run rules shared by the training entry and the planner, each stated once with its message.

Each rule is a (holds, message) pair; callers raise their own error type (`ConfigError` at the
run's edge, ValueError in library calls) with `raise_first`. Model-shape rules live with the
model (`models/config.py`, `moe/config.py`), layout rules with the mesh (`mpu/mesh.py`).
"""

from __future__ import annotations

Check = tuple[bool, str]

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


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
    """`trainer.precision` names a compute precision meshtron runs."""
    return (precision in PRECISIONS, f"trainer.precision={precision!r} is unknown; use one of {', '.join(PRECISIONS)}")


def param_dtype_checks(param_dtype: str, precision: str, zero: int, pp: int = 1) -> list[Check]:
    """`optim.param_dtype=bf16` (16-bit resident weights, dp/resident.py) needs bf16 compute and
    is not built for pipeline parallelism yet. (`zero` is kept for rules to come: every stage works.)"""
    if param_dtype == "fp32":
        return []
    return [
        (param_dtype == "bf16", f"optim.param_dtype={param_dtype!r} is unknown; use fp32 or bf16"),
        (precision == "bf16", f"optim.param_dtype=bf16 needs trainer.precision=bf16 (got {precision!r})"),
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
