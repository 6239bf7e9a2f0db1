"""Parallel == serial cases for the dense GPT, run inside one gloo world by the harness.

Every case builds the parallel model for its layout and, in the same process, the serial
model (world of one), feeds both the same global batch, and compares logits, loss, every
gradient (all-gathered to full shape, vocabulary padding dropped) after the first step, and
every weight after three AdamW steps.

Errors are tensor-level relative errors ||got - want|| / ||want||. The AdamW used here has
eps=1e-4 and lr=1e-3: Adam divides by sqrt(v) + eps, so gradient elements near the fp32
rounding noise (the key bias is mathematically zero; attention-output biases of deep models
are small) get their noise turned into updates of order lr. Measured serial-vs-serial floors
after 3 steps (the *same* model trained with 1 vs 8 microbatches): 2-layer models 3.5e-4 at
eps=1e-8 and 1e-6 at eps=1e-6; the 8-layer GPT-2 of the pipeline cases 1.6e-4 at eps=1e-6,
2.9e-5 at 1e-5 and 3e-6 at 1e-4. eps=1e-4 keeps the floor well below the 1e-5 tolerance.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.gpt import GPT, init_model_chunks
from meshtron.mpu.init import full_tensor, initialize_parameters  # noqa: F401 (full_tensor: used by the case modules)
from meshtron.mpu.mesh import Mesh, ParallelConfig, build_mesh, single_process_mesh
from meshtron.mpu.random import seed_parallel_rng
from meshtron.training.optim import build_optimizer
from meshtron.training.step import train_step

RTOL = 1e-5
SEED = 1234
GLOBAL_BATCH = 4
STEPS = 3
LR = 1e-3
ADAM_EPS = 1e-4
# The serial references compute the loss from whole logits, while the layouts under test run
# the default fused LM-head loss (kernels/linear_cross_entropy.py): every layout case therefore
# also proves the fused, chunked loss equal to the unfused one.
UNFUSED = ExecutionConfig(fused_lm_loss=False)


# The Hugging Face families' distinguishing features on the Llama test models ("qwen3": an
# RMSNorm over each head's q and k, heads 12 wide at hidden 64 / 8 heads; "qwen2": q/k/v biases
# alone; "llama3": Llama 3.1's RoPE scaling with the 16-position context in all three bands).
FAMILIES = {
    "qwen3": dict(qk_norm=True, kv_channels=12),
    "qwen2": dict(qkv_bias=True),
    # DeepSeek's multi-head latent attention (q latent 24, kv latent 16, heads 8 + 4 rope wide, v 12)
    "mla": dict(
        attention="mla",
        num_kv_heads=None,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=12,
    ),
    "llama3": dict(
        rope_theta=100.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
    ),
}


def family_config(arch: str, base) -> GPTConfig:
    """`base("llama")` with the features of family `arch` (FAMILIES), or `base(arch)`."""
    if arch in FAMILIES:
        return dataclasses.replace(base("llama"), **FAMILIES[arch])
    return base(arch)


def model_config(arch: str) -> GPTConfig:
    # vocab 200 is not a multiple of 128*tp: padding differs between layouts.
    if arch in FAMILIES:
        return family_config(arch, model_config)
    if arch == "llama":
        return GPTConfig(
            arch="llama",
            num_layers=2,
            hidden_size=64,
            num_heads=8,
            num_kv_heads=4,
            ffn_hidden_size=48,
            vocab_size=200,
            seq_len=16,
            tie_embeddings=False,
        )
    return GPTConfig(
        arch="gpt2",
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=64,
        vocab_size=200,
        seq_len=16,
        tie_embeddings=True,
    )


def global_batch(cfg: GPTConfig, step: int, batch: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def microbatches(cfg: GPTConfig, step: int, dp_rank: int, dp: int, micro: int, batch: int = GLOBAL_BATCH):
    inputs, targets = global_batch(cfg, step, batch)
    per_rank = batch // dp
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    inputs, targets = inputs[rows], targets[rows]
    return [(inputs[i : i + micro], targets[i : i + micro]) for i in range(0, per_rank, micro)]


def trim_vocab(name: str, tensor: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    if name in ("embed.weight", "head.weight"):
        return tensor[: cfg.vocab_size]
    return tensor


def relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """||got - want|| / ||want|| (Frobenius), the tensor-level relative error."""
    return (got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-12)


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    err = relative_error(got, want)
    if not (err <= rtol):
        raise AssertionError(
            f"{name}: relative error {err.item():.3e} > {rtol:.0e} (shapes {tuple(got.shape)} vs {tuple(want.shape)})"
        )


def compare_parameters(named, ref_params: dict, mesh: Mesh, cfg: GPTConfig, what: str, rtol: float = RTOL) -> None:
    """Every (name, shard) of `named` all-gathered to full shape equals the serial parameter of
    the same name (`what` = "grad" compares gradients, anything else the weights)."""
    for name, p in named:
        ref = ref_params[name]
        got, want = (p.grad, ref.grad) if what == "grad" else (p, ref)
        assert_close(
            f"{what} {name}",
            trim_vocab(name, full_tensor(got, p.shards, mesh), cfg),
            trim_vocab(name, want, cfg),
            rtol,
        )


def build(cfg: GPTConfig, mesh: Mesh, execution: ExecutionConfig = ExecutionConfig()):
    (model,) = init_model_chunks(cfg, mesh, SEED, execution=execution)
    reducer = DataParallelGradReducer(list(model.named_parameters()), mesh, bucket_mb=0.01)
    optimizer = build_optimizer(model, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
    return model, reducer, optimizer


def check_layout(
    arch: str,
    tp: int,
    sp: bool,
    micro: int = 1,
    kernel_backend: str = "torch",
    *,
    cfg: GPTConfig | None = None,
    recompute: str = "none",
    serial_micro: int = GLOBAL_BATCH,
    eos_id: int | None = None,
    keys: tuple[str, ...] = ("loss", "grad_norm"),
) -> None:
    """Compare one parallel layout (dp = world / tp), with `kernel_backend` kernels and
    `recompute`, against the serial model with the torch kernels: logits of this rank's rows,
    the StepResult `keys` of every step (the serial run takes microbatches of `serial_micro`
    sequences: the MoE statistics are per microbatch), every gradient after the first step and
    every weight after STEPS AdamW steps. `cfg`: the model (default `model_config(arch)`)."""
    cfg = cfg or model_config(arch)
    mesh = build_mesh(ParallelConfig(tp=tp, sp=sp), cfg)
    serial_mesh = single_process_mesh()
    model, reducer, optimizer = build(cfg, mesh, ExecutionConfig(kernel_backend=kernel_backend, recompute=recompute))
    ref, ref_reducer, ref_optimizer = build(cfg, serial_mesh, UNFUSED)

    # Forward: logits of this rank's rows and loss of the global batch.
    inputs, targets = microbatches(cfg, 0, mesh.dp_rank, mesh.dp_size, GLOBAL_BATCH)[0]
    full_inputs, _ = global_batch(cfg, 0)
    with torch.no_grad():
        got = model.full_logits(model(inputs))
        want = ref.full_logits(ref(full_inputs))
    rows = slice(mesh.dp_rank * inputs.shape[0], (mesh.dp_rank + 1) * inputs.shape[0])
    assert_close("logits", got, want[rows])

    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()]
    for step in range(STEPS):
        mine = microbatches(cfg, step, mesh.dp_rank, mesh.dp_size, micro)
        out = train_step(model, reducer, optimizer, mine, mesh, lr=LR, max_grad_norm=1.0, eos_id=eos_id)
        serial = microbatches(cfg, step, 0, 1, serial_micro)
        ref_out = train_step(
            ref, ref_reducer, ref_optimizer, serial, serial_mesh, lr=LR, max_grad_norm=1.0, eos_id=eos_id
        )
        for key in keys:
            assert_close(f"step {step} {key}", getattr(out, key), getattr(ref_out, key))
        if step == 0:
            # Gradients are post-clipping on both sides; same coefficient since norms match.
            compare_parameters(model.named_parameters(), dict(ref.named_parameters()), mesh, cfg, "grad")
    compare_parameters(model.named_parameters(), dict(ref.named_parameters()), mesh, cfg, f"weight after {STEPS} steps")
    reducer.remove_hooks()


def _make_case(arch: str, tp: int, sp: bool, micro: int = 1):
    def case() -> None:
        check_layout(arch, tp, sp, micro)

    case.__name__ = f"{arch}_tp{tp}_{'sp' if sp else 'nosp'}_mb{micro}"
    return case


def triton_kernels_llama_tp2_sp() -> None:
    """The Triton kernels (interpreter, set by the harness) inside TP/SP layers give the serial
    torch results."""
    check_layout("llama", dist.get_world_size(), True, 2, kernel_backend="triton")


def fp8_llama_tp2_sp() -> None:
    """trainer.precision=fp8 under tp=2 with sequence parallelism tracks the serial fp8 run:
    the column-parallel forward quantizes the same rows as one process, the row-parallel one
    and the input gradients scale over this rank's slice of the reduction, so the runs agree
    to FP8's rounding (2%), not bit for bit; every TP linear ran its GEMMs in FP8."""
    import dataclasses

    from meshtron.mpu import fp8
    from meshtron.training.precision import Precision

    cfg = dataclasses.replace(model_config("llama"), ffn_hidden_size=64)  # every TP shard's GEMM a multiple of 16
    mesh = build_mesh(ParallelConfig(tp=dist.get_world_size(), sp=True), cfg)
    serial_mesh = single_process_mesh()
    model, reducer, optimizer = build(cfg, mesh)
    ref, ref_reducer, ref_optimizer = build(cfg, serial_mesh)
    calls, real = [], fp8._scaled_mm
    fp8._scaled_mm = lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
    try:
        for step in range(STEPS):
            out = train_step(model, reducer, optimizer, microbatches(cfg, step, 0, 1, 2), mesh, lr=LR,
                             max_grad_norm=1.0, precision=Precision("fp8", "cpu"))  # fmt: skip
            parallel_calls = len(calls)
            ref_out = train_step(ref, ref_reducer, ref_optimizer, microbatches(cfg, step, 0, 1, 2), serial_mesh,
                                 lr=LR, max_grad_norm=1.0, precision=Precision("fp8", "cpu"))  # fmt: skip
            assert parallel_calls > 0 and len(calls) == 2 * parallel_calls, (parallel_calls, len(calls))
            calls.clear()
            assert_close(f"step {step} fp8 loss", out.loss, ref_out.loss, rtol=2e-2)
    finally:
        fp8._scaled_mm = real
    compare_parameters(model.named_parameters(), dict(ref.named_parameters()), mesh, cfg, "fp8 weights", 2e-2)
    reducer.remove_hooks()


def cases_for_world(world_size: int) -> list[str]:
    """Names of the cases that run in a world of `world_size` processes (dp = world / tp)."""
    names = []
    for tp in (1, 2, 4):
        if world_size % tp or world_size // tp > 2:
            continue
        for arch in ("gpt2", "llama"):
            for sp in (False, True) if tp > 1 else (False,):
                names.append(f"{arch}_tp{tp}_{'sp' if sp else 'nosp'}_mb1")
    if world_size == 2:
        names += [
            "gpt2_tp1_nosp_mb2",
            "llama_tp2_sp_mb2",
            "collectives_per_layer",
            "recompute_matches_with_dropout",
            "triton_kernels_llama_tp2_sp",
            "fp8_llama_tp2_sp",
            "qwen3_tp2_sp_mb1",
            "qwen2_tp2_sp_mb2",
            "llama3_tp2_nosp_mb1",
        ]
    return names


for _arch in ("gpt2", "llama", *FAMILIES):
    for _tp in (1, 2, 4):
        for _sp in (False, True):
            for _micro in (1, 2):
                _case = _make_case(_arch, _tp, _sp, _micro)
                globals()[_case.__name__] = _case


def _count_collectives(cfg: GPTConfig, mesh: Mesh) -> dict[str, int]:
    """Collectives issued by one forward + backward of the loss, by kind."""
    counts = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    import meshtron.mpu.mappings as mappings_mod
    import meshtron.mpu.shm_collectives as shm_mod

    originals = (
        mappings_mod.dist.all_reduce,
        mappings_mod._all_gather_into,
        mappings_mod._reduce_scatter_into,
        shm_mod.all_reduce,
        shm_mod.all_gather_into,
        shm_mod.reduce_scatter_into,
    )

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)

        return wrapper

    model = GPT(cfg, mesh)
    initialize_parameters(model, SEED, mesh)
    inputs, targets = global_batch(cfg, 0)
    dist.all_reduce = counted("all_reduce", originals[0])
    mappings_mod._all_gather_into = counted("all_gather", originals[1])
    mappings_mod._reduce_scatter_into = counted("reduce_scatter", originals[2])
    shm_mod.all_reduce = counted("all_reduce", originals[3])  # CPU ranks of one host: shared memory
    shm_mod.all_gather_into = counted("all_gather", originals[4])
    shm_mod.reduce_scatter_into = counted("reduce_scatter", originals[5])
    try:
        model.loss_per_token(model(inputs), targets).sum().backward()
    finally:
        dist.all_reduce = originals[0]
        mappings_mod._all_gather_into, mappings_mod._reduce_scatter_into = originals[1], originals[2]
        shm_mod.all_reduce, shm_mod.all_gather_into, shm_mod.reduce_scatter_into = originals[3:]
    return counts


def collectives_per_layer() -> None:
    """Per transformer layer at tp>1: 2 all-reduces forward + 2 backward without SP; with SP
    2 all-gathers + 2 reduce-scatters forward and the same backward, nothing else (both
    families: SwiGLU's gate and up share one input collective)."""
    tp = dist.get_world_size()
    for arch in ("gpt2", "llama"):
        for sp in (False, True):
            mesh = build_mesh(ParallelConfig(tp=tp, sp=sp), model_config(arch))
            base = model_config(arch)
            small = _count_collectives(GPTConfig(**{**base.__dict__, "num_layers": 2}), mesh)
            big = _count_collectives(GPTConfig(**{**base.__dict__, "num_layers": 3}), mesh)
            per_layer = {k: big[k] - small[k] for k in big}
            want = (
                {"all_reduce": 0, "all_gather": 4, "reduce_scatter": 4}
                if sp
                else {"all_reduce": 4, "all_gather": 0, "reduce_scatter": 0}
            )
            if per_layer != want:
                raise AssertionError(f"{arch} sp={sp}: collectives per layer {per_layer}, want {want}")
            if not sp and small["all_gather"] != 1:  # the loss: one all-gather of [3, tokens] statistics
                raise AssertionError(f"{arch}: {small['all_gather']} all-gathers, want 1 (the cross-entropy's)")


def recompute_matches_with_dropout() -> None:
    """Full and selective recomputation give the gradients of no recomputation, with dropout
    0.1 inside and outside TP regions (tp = world size, with and without SP)."""
    tp = dist.get_world_size()
    for sp in (False, True):
        grads = {}
        for mode in ("none", "selective", "full"):
            cfg = GPTConfig(**{**model_config("gpt2").__dict__, "dropout": 0.1})
            mesh = build_mesh(ParallelConfig(tp=tp, sp=sp), cfg)
            seed_parallel_rng(SEED, mesh.tp_rank, mesh.pp_rank)
            model = GPT(cfg, mesh, execution=ExecutionConfig(recompute=mode))
            initialize_parameters(model, SEED, mesh)
            inputs, targets = global_batch(cfg, 0)
            model.loss_per_token(model(inputs), targets).mean().backward()
            grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
        for mode in ("selective", "full"):
            for name, grad in grads["none"].items():
                if not torch.allclose(grads[mode][name], grad, rtol=1e-6, atol=1e-8):
                    raise AssertionError(f"sp={sp} recompute={mode}: gradient of {name} differs")
        # Dropout really is on: a different seed changes the gradients.
        seed_parallel_rng(SEED + 1, mesh.tp_rank, mesh.pp_rank)
        model.zero_grad()
        model.loss_per_token(model(inputs), targets).mean().backward()
        if torch.allclose(model.layers["0"].attn.qkv.weight.grad, grads["full"]["layers.0.attn.qkv.weight"]):
            raise AssertionError("dropout had no effect; the test would prove nothing")
