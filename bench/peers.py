"""meshtron beside torchtitan and Megatron-Core on the same device (issue 37): one process, one
model / batch / sequence / optimizer, rounds alternating between the three, tokens/s, MFU and
peak memory, one record per target.

    python bench/peers.py --cpu-rehearsal                     # tiny shapes, 2 steps, prints the records
    python bench/peers.py --models dense_1b --raw-dir P --no-records   # one model's raw figures -> P/dense_1b.json
    python bench/peers.py --merge-only --raw-dir P --out-dir D        # D/<UTC date>-<device>-peers.json

What each side runs (same shape, micro-batch 1, seq 4,096, fp32 weights with bf16 autocast
on CUDA, AdamW lr 3e-4 betas (0.9, 0.95) eps 1e-8 weight decay 0.1, gradient clipping at 1.0,
random tokens from one seed, the LM head tied to the embedding):

* meshtron: its real training step, `training.engine.Engine` (fused LM head + loss, kernels
  `auto` on CUDA, every block under torch.compile where `trainer.compile` exists, else MoE
  layers under `trainer.compile_moe`).
* torchtitan 0.3.x: its model classes built from its own config builders
  (`Llama3Model` for dense; `Qwen3Model` with Llama-style attention, no qk-norm, for MoE: its
  `MoE` with a softmax top-k router, grouped experts, a shared expert), its per-block
  `torchtitan.distributed.compile.apply_compile` (inductor, fullgraph), its FlexAttention
  with the causal + document mask its trainer builds, its `CrossEntropyLoss` component,
  `torch.optim.AdamW(fused=True)` as its optimizer container builds it, and `torch.autocast`
  as its single-device trainer does. Not its `Trainer`: that one needs a tokenizer and a
  dataset download, which the lent machine cannot reach.
* Megatron-Core (newest wheel: 0.19.2): `GPTModel` with the local layer spec
  (`get_gpt_layer_local_spec`, no Transformer Engine: unfused DotProductAttention; MoE:
  SequentialMLP experts, alltoall dispatcher, aux loss 0.01), `parallel_state` for one rank,
  plain `torch.optim.AdamW` under the same autocast (not its DistributedOptimizer).

FLOPs (one formula for all three; `flops_per_token`, meshtron.planning.flops): training FLOPs
per token = 6 * N + 12 * L * h * s, where N counts the weights every token multiplies: per
layer the fused QKV h*(a + 2g)*d, the output projection h*h, the SwiGLU MLP 3*h*f (MoE: the
router h*E and top_k + shared experts of 3*h*f_moe each), plus the LM head h*V once (tied or
not; embeddings lookups, norms and softmax are not counted), and 12*L*h*s the attention
scores and values over the full s x s square (causal masking ignored), the convention of
Megatron-LM's and torchtitan's MFU. MFU = FLOPs/token * tokens/s / the device's bf16 dense
peak (meshtron.planning.peak: datasheet on known GPUs; measured on CPU).

Shapes (`MODELS`; parameters as meshtron.planning.flops.param_count counts them, the three
sides build the same count): dense_1b (Llama-3.2-1B: h 2048, 16 layers, 32 heads, 8 kv heads,
ffn 8192, vocab 128256; 1.24 B), dense_3b (h 3072, 28 layers, 24 heads, 8 kv, ffn 8192; 3.21 B),
moe_fine (h 2048, 6 layers, 32 heads, 8 kv, 64 experts of ffn 1024, top-8, one shared expert of
ffn 1024; 2.78 B, 0.67 B active) and moe_mixtral (h 2048, 6 layers, 32 heads, 8 kv, 8 experts of
ffn 8192, top-2; 2.74 B, 0.93 B active); all at seq 4,096 and micro-batch 1, sized so that one
side's fp32 weights, gradients and AdamW state (16 bytes a parameter: 20 GB, 51 GB, 44 GB,
44 GB) and its activations fit one 80 GB GPU. The sides stay resident and alternate every round
where they fit together; otherwise each side runs its rounds alone, in turn, and is freed before
the next is built (`rounds` in the records says which).

Records (`bench/results/gpu/<UTC date>-<device>-peers.json`, the DESIGN.md output contract, the
fields and `met` rule of bench/kernel_records.py): per model its tokens/s ratio to torchtitan
with compile on (dense, target 1.10) or to the faster peer (MoE, target 1.10), meshtron's MFU
(dense, target 0.50), its tokens/s ratio to Megatron-Core (dense, informative) and its peak
memory against the smaller of the peers' (ratio = peer / meshtron, target 1.0). A model whose
part did not run or finish leaves its records "not measured".

Peer packages are found on sys.path, then in `.peers-cpu/` (git-ignored: `pip install --target
.peers-cpu`, see docs/performance.md), then in $PEERS_SITE.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))
for _site in (os.environ.get("PEERS_SITE"), str(ROOT / ".peers-cpu")):
    if _site and Path(_site).is_dir() and _site not in sys.path:
        sys.path.append(_site)  # after the interpreter's own packages: a newer install wins

from bench.kernel_records import Target, current_env, device_slug, record_of  # noqa: E402
from bench.kernel_records import check as check_records  # noqa: E402

SIDES = ("meshtron", "torchtitan", "megatron")
SEED = 1234
DATA_SEED = 4321
LR = 3e-4
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
MAX_GRAD_NORM = 1.0
ROPE_THETA = 500000.0
AUX_LOSS_COEF = 0.01
FLOP_FORMULA = (
    "6*N + 12*L*h*s per token; N = per layer h*(a+2g)*d + h*h + 3*h*f (MoE: h*E + (top_k + shared)*3*h*f_moe) "
    "summed over layers, plus h*V for the LM head once"
)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model of the comparison; `experts` 0 = dense SwiGLU MLPs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256
    seq: int = 4096
    batch: int = 1
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_experts: int = 0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


MODELS: dict[str, Shape] = {
    "dense_1b": Shape(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192),
    "dense_3b": Shape(layers=28, hidden=3072, heads=24, kv_heads=8, ffn=8192),
    "moe_fine": Shape(
        layers=6, hidden=2048, heads=32, kv_heads=8, ffn=1024, experts=64, top_k=8, moe_ffn=1024, shared_experts=1
    ),
    "moe_mixtral": Shape(layers=6, hidden=2048, heads=32, kv_heads=8, ffn=8192, experts=8, top_k=2, moe_ffn=8192),
}
# The CPU rehearsal's shapes: every code path once, nothing measured.
TINY: dict[str, Shape] = {
    "dense_1b": Shape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32),
    "dense_3b": Shape(layers=2, hidden=96, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32),
    "moe_fine": Shape(
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        ffn=32,
        vocab=256,
        seq=32,
        experts=8,
        top_k=4,
        moe_ffn=32,
        shared_experts=1,
    ),
    "moe_mixtral": Shape(
        layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=32, experts=4, top_k=2, moe_ffn=128
    ),
}


# --------------------------------------------------------------------------- FLOPs


def gpt_config(shape: Shape):
    """meshtron's GPTConfig of `shape` (llama: RMSNorm, SwiGLU, RoPE, no biases, tied LM head)."""
    from meshtron.models.config import GPTConfig

    kw = dict(
        arch="llama",
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        ffn_hidden_size=shape.ffn,
        vocab_size=shape.vocab,
        seq_len=shape.seq,
        dropout=0.0,
        tie_embeddings=True,
        rope_theta=ROPE_THETA,
    )
    if shape.is_moe:
        kw.update(
            num_experts=shape.experts,
            top_k=shape.top_k,
            moe_ffn_hidden_size=shape.moe_ffn,
            shared_experts=shape.shared_experts,
            aux_loss_coef=AUX_LOSS_COEF,
        )
    return GPTConfig(**kw)


def flops_per_token(shape: Shape) -> float:
    """Training FLOPs per token of `shape` (`FLOP_FORMULA`), the one figure all three sides'
    MFU divides by: meshtron.planning.flops.model_flops_per_token of the same model."""
    from meshtron.planning.flops import model_flops_per_token

    return model_flops_per_token(gpt_config(shape))


# --------------------------------------------------------------------------- the sides


def _batches(shape: Shape, count: int, device) -> list[tuple]:
    import torch

    gen = torch.Generator().manual_seed(DATA_SEED)
    out = []
    for _ in range(count):
        t = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=gen)
        out.append((t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)))
    return out


def _autocast(device, bf16: bool):
    import torch

    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _update(loss, model, optimizer):
    """A peer's backward and update, as meshtron's step does them: clip at MAX_GRAD_NORM, AdamW."""
    import torch

    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _adamw(params, device):
    import torch

    return torch.optim.AdamW(
        params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True if device.type == "cuda" else None
    )


class MeshtronSide:
    """meshtron's Engine step (the one train.py runs)."""

    def __init__(self, shape: Shape, device, bf16: bool, compile: bool):
        from meshtron.models.config import ExecutionConfig
        from meshtron.mpu.mesh import ParallelConfig, build_mesh
        from meshtron.training.config import OptimConfig
        from meshtron.training.engine import Engine, EngineConfig
        from meshtron.training.precision import Precision

        cfg = gpt_config(shape)
        execution = dict(kernel_backend="auto" if device.type == "cuda" else "torch", compile=compile)
        how = "every block under torch.compile (trainer.compile)" if compile else "eager"
        self.engine = Engine.build(
            EngineConfig(
                model=cfg,
                micro_batch_size=shape.batch,
                seed=SEED,
                execution=ExecutionConfig(**execution),
                optim=OptimConfig(lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, eps=EPS),
                max_grad_norm=MAX_GRAD_NORM,
            ),
            build_mesh(ParallelConfig(), cfg, device_type=device.type),
            device,
            precision=Precision("bf16" if bf16 else "fp32", device.type),
        )
        self.system = f"meshtron Engine, kernels {execution['kernel_backend']}, {how}"

    def step(self, x, y):
        return self.engine.step([(x, y)], LR).loss

    def close(self):
        self.engine.close()


class TorchtitanSide:
    """torchtitan's model classes, per-block compile, loss component; torch AdamW."""

    def __init__(self, shape: Shape, device, bf16: bool, compile: bool):
        from functools import partial
        from importlib.metadata import version

        import torch
        import torch.nn as nn
        from torchtitan.components.loss import CrossEntropyLoss
        from torchtitan.config import CompileConfig
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.common.config_utils import (
            get_attention_config,
            make_ffn_config,
            make_gqa_config,
            make_moe_config,
            make_routed_experts_config,
            make_router_config,
        )

        init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
        norm = {"weight": nn.init.ones_}
        h = shape.hidden
        rope = ComplexRoPE.Config(dim=shape.head_dim, max_seq_len=shape.seq, theta=ROPE_THETA, scaling="none")
        # Its language models' attention is FlexAttention (causal + document mask from the
        # positions, as its trainer builds it); flex has no backward on the CPU, so the CPU
        # rehearsal takes its maskless causal SDPA module instead.
        flex = device.type == "cuda"
        if flex:
            inner = get_attention_config("flex")
        else:
            from torchtitan.models.common.attention import ScaledDotProductAttention

            inner = ScaledDotProductAttention.Config()

        def attention():
            return make_gqa_config(
                dim=h,
                n_heads=shape.heads,
                n_kv_heads=shape.kv_heads,
                wqkv_param_init=init,
                wo_param_init=init,
                inner_attention=inner,
                fuse_qkv=True,
                rope=rope,
            )

        def ffn(hidden):
            return make_ffn_config(dim=h, hidden_dim=hidden, w1_param_init=init, w2w3_param_init=init)

        common = dict(
            dim=h,
            vocab_size=shape.vocab,
            enable_weight_tying=True,
            tok_embeddings=Embedding.Config(num_embeddings=shape.vocab, embedding_dim=h, param_init=init),
            norm=RMSNorm.Config(normalized_shape=h, param_init=norm),
            lm_head=Linear.Config(in_features=h, out_features=shape.vocab, param_init=init),
        )
        if not shape.is_moe:
            from torchtitan.models.llama3 import Llama3Model
            from torchtitan.models.llama3.model import Llama3TransformerBlock

            layers = [
                Llama3TransformerBlock.Config(
                    attention_norm=RMSNorm.Config(normalized_shape=h, param_init=norm),
                    ffn_norm=RMSNorm.Config(normalized_shape=h, param_init=norm),
                    attention=attention(),
                    feed_forward=ffn(shape.ffn),
                )
                for _ in range(shape.layers)
            ]
            config = Llama3Model.Config(**common, layers=layers)
        else:
            from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

            experts_init = {k: init["weight"] for k in ("w1_EFD", "w2_EDF", "w3_EFD")}
            layers = [
                Qwen3TransformerBlock.Config(
                    attention_norm=RMSNorm.Config(normalized_shape=h, param_init=norm),
                    ffn_norm=RMSNorm.Config(normalized_shape=h, param_init=norm),
                    attention=attention(),
                    moe=make_moe_config(
                        num_experts=shape.experts,
                        router=make_router_config(
                            dim=h,
                            num_experts=shape.experts,
                            gate_param_init=init,
                            top_k=shape.top_k,
                            score_func="softmax",
                            route_norm=True,
                        ),
                        routed_experts=make_routed_experts_config(
                            dim=h,
                            hidden_dim=shape.moe_ffn,
                            num_experts=shape.experts,
                            top_k=shape.top_k,
                            param_init=experts_init,
                            comm_backend="standard",
                        ),
                        shared_experts=ffn(shape.moe_ffn * shape.shared_experts) if shape.shared_experts else None,
                    ),
                )
                for _ in range(shape.layers)
            ]
            config = Qwen3Model.Config(**common, layers=layers)
        with torch.device("meta"):
            model = config.build()
        compile_config = CompileConfig(enable=compile)
        if compile:
            from torchtitan.distributed.compile import apply_compile
            from torchtitan.distributed.parallel_dims import ParallelDims

            dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
            apply_compile(model, compile_config=compile_config, parallel_dims=dims)
        torch.manual_seed(SEED)
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        model.train()
        self.model, self.device, self.bf16 = model, device, bf16
        self.loss_fn = CrossEntropyLoss(CrossEntropyLoss.Config(), compile_config=compile_config)
        self.optimizer = _adamw(model.parameters(), device)
        positions = torch.arange(shape.seq, device=device).expand(shape.batch, shape.seq)
        masks = model.get_attention_masks(positions=positions) if flex else None
        self.kwargs = dict(positions=positions, attention_masks=masks)
        how = "per-block compile" if compile else "eager"
        self.system = f"torchtitan {version('torchtitan')}, {how}, {'flex' if flex else 'sdpa'} attention"

    def step(self, x, y):
        import torch

        with _autocast(self.device, self.bf16):
            pred = self.model(x, **self.kwargs)
            loss, _ = self.loss_fn(pred, y, torch.tensor(y.numel(), device=self.device))
        del pred
        return _update(loss, self.model, self.optimizer)

    def close(self):
        del self.model, self.optimizer


def _init_one_rank(device) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)


class MegatronSide:
    """Megatron-Core GPTModel, local layer spec, one rank; torch AdamW under autocast.

    On a CPU-only torch Megatron-Core 0.19 needs these workarounds (found by
    ../shared/peers/mcore_gpt.py and mcore_moe.py, applied only without CUDA):
    GlobalMemoryBuffer and `torch.cuda.current_device` on the CPU, an explicit causal mask,
    a no-op RNG tracker, and the alltoall dispatcher's CUDA stream and device-to-host copy."""

    def __init__(self, shape: Shape, device, bf16: bool, compile: bool):
        from importlib.metadata import version

        import torch
        import torch.nn.functional as F
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
        _init_one_rank(device)
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=1)
        self.workarounds = [] if cuda else _megatron_cpu_workarounds(shape)
        if cuda:
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(SEED)
        moe = {}
        if shape.is_moe:
            moe = dict(
                num_moe_experts=shape.experts,
                moe_router_topk=shape.top_k,
                moe_ffn_hidden_size=shape.moe_ffn,
                moe_shared_expert_intermediate_size=shape.moe_ffn * shape.shared_experts or None,
                moe_token_dispatcher_type="alltoall",
                moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=AUX_LOSS_COEF,
                moe_router_pre_softmax=False,
                moe_permute_fusion=False,
                moe_router_fusion=False,
            )
        cfg = TransformerConfig(
            num_layers=shape.layers,
            hidden_size=shape.hidden,
            num_attention_heads=shape.heads,
            num_query_groups=shape.kv_heads,
            ffn_hidden_size=shape.ffn,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=torch.float32,
            use_cpu_initialization=not cuda,
            bias_activation_fusion=False,
            gradient_accumulation_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
            bias_dropout_fusion=False,
            **moe,
        )
        torch.manual_seed(SEED)
        spec = get_gpt_layer_local_spec(
            num_experts=shape.experts or None, moe_grouped_gemm=False, normalization="RMSNorm"
        )
        model = GPTModel(
            cfg,
            transformer_layer_spec=spec,
            vocab_size=shape.vocab,
            max_sequence_length=shape.seq,
            position_embedding_type="rope",
            rotary_base=int(ROPE_THETA),
            share_embeddings_and_output_weights=True,
        )
        self.model = model.to(device).train()
        self.device, self.bf16 = device, bf16
        self.optimizer = _adamw(self.model.parameters(), device)
        self.position_ids = torch.arange(shape.seq, device=device).expand(shape.batch, shape.seq)
        self.mask = (
            None if cuda else torch.triu(torch.ones(shape.seq, shape.seq, dtype=torch.bool), diagonal=1)[None, None]
        )
        self.system = f"Megatron-Core {version('megatron-core')} GPTModel, local spec, eager"

    def step(self, x, y):

        with _autocast(self.device, self.bf16):
            loss = self.model(x, self.position_ids, self.mask, labels=y).float().mean()
        return _update(loss, self.model, self.optimizer)

    def close(self):
        del self.model, self.optimizer


def _megatron_cpu_workarounds(shape: Shape) -> list[str]:
    """Let Megatron-Core 0.19 run on a CPU-only torch (the rehearsal only); returns what it did."""
    import operator
    from functools import reduce

    import megatron.core.utils as mcu
    import torch
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    def get_tensor_cpu(self, tensor_shape, dtype, name, mem_alloc_context=None):
        n = reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < n:
            self.buffer[(name, dtype)] = buf = torch.empty(n, dtype=dtype)
        return buf[0:n].view(*tensor_shape)

    mcu.GlobalMemoryBuffer.get_tensor = get_tensor_cpu
    initialize_rng_tracker(inference_rng_tracker=True)
    # RoPE's inv_freq, the router's weight and the dispatcher move to torch.cuda.current_device()
    torch.cuda.current_device = lambda: torch.device("cpu")
    done = [
        "GlobalMemoryBuffer on the CPU",
        "no-op RNG tracker",
        "explicit CPU causal mask",
        "cuda.current_device -> cpu",
    ]
    if shape.is_moe:
        import numpy as np
        from megatron.core.transformer.moe import token_dispatcher as td

        td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()

        def dtoh_cpu(self, point, tokens_per_expert=None):
            for name in ("input_splits", "output_splits"):
                value = getattr(self, name, None)
                if isinstance(value, torch.Tensor):
                    setattr(self, name, np.asarray(value.tolist()))
            return tokens_per_expert

        td.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = dtoh_cpu
        done += ["alltoall dispatcher without CUDA streams"]
    return done


BUILDERS = {"meshtron": MeshtronSide, "torchtitan": TorchtitanSide, "megatron": MegatronSide}
PEER_MODULES = {"torchtitan": "torchtitan", "megatron": "megatron.core"}


def importable(side: str) -> str | None:
    """None when `side` can run here, else why not."""
    if side == "meshtron":
        return None
    import importlib

    try:
        importlib.import_module(PEER_MODULES[side])
    except Exception as exc:  # noqa: BLE001 - any import failure means the side is skipped
        return f"{PEER_MODULES[side]} not importable: {type(exc).__name__}: {exc}"
    return None


# --------------------------------------------------------------------------- running one model


def _memory(device) -> tuple[int, int]:
    import torch

    if device.type != "cuda":
        return 0, 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_model(
    name: str,
    shape: Shape,
    sides: list[str],
    device,
    *,
    bf16: bool,
    compile: bool,
    warmup: int,
    steps: int,
    rounds: int,
    save=None,
) -> dict:
    """Build each side, warm it up, then `rounds` rounds of `steps` timed steps each, the
    side order reversed every round. Sides stay resident while the device holds them (CUDA:
    the last side's need, resident state + step peak, fits in the free memory); otherwise the
    sides built so far play their rounds and leave the device before the next is built, and a
    side whose build runs out of memory beside others is built again alone. `save(raw)` is
    called after every phase, so a part cut off by its time cap leaves what it measured."""
    import torch

    from meshtron.planning.peak import peak_flops

    peak, peak_source = peak_flops(device, torch.bfloat16 if (bf16 and device.type == "cuda") else torch.float32)
    raw = {
        "model": name,
        "shape": dataclasses.asdict(shape),
        "device_type": device.type,
        "tokens_per_step": shape.batch * shape.seq,
        "flops_per_token": flops_per_token(shape),
        "flop_formula": FLOP_FORMULA,
        "peak_flops": peak,
        "peak_source": peak_source,
        "precision": "bf16 autocast, fp32 weights" if bf16 else "fp32",
        "compile": compile,
        "steps": {"warmup": warmup, "per_round": steps, "rounds": rounds},
        "rounds": "alternating",
        "sides": {},
    }
    batches = _batches(shape, 4, device)
    built: dict[str, object] = {}
    resident: dict[str, int] = {}

    def record(side: str, **kw):
        entry = raw["sides"].setdefault(side, {"times_s": [], "losses": [], "peak_bytes": None})
        entry.update(kw)
        if entry["times_s"]:
            entry["tokens_per_s"] = raw["tokens_per_step"] / statistics.median(entry["times_s"])
            entry["mfu"] = raw["flops_per_token"] * entry["tokens_per_s"] / peak
        if save:
            save(raw)

    def timed(side: str, count: int, timing: bool):
        entry, obj = raw["sides"][side], built[side]
        others = _memory(device)[0] - resident.get(side, 0)
        _reset_peak(device)
        for i in range(count):
            x, y = batches[i % len(batches)]
            t0 = time.perf_counter()
            loss = obj.step(x, y)
            _sync(device)
            dt = time.perf_counter() - t0
            if timing:
                entry["times_s"].append(dt)
            entry["losses"].append(float(loss))
        if device.type == "cuda":
            entry["peak_bytes"] = max(entry["peak_bytes"] or 0, _memory(device)[1] - others)
        record(side)

    def build(side: str, compiled: bool = compile) -> bool:
        """Build, warm up and time the first round of `side` (so a part cut off later keeps a
        figure); a compile failure is recorded and the side built again eager, saying so."""
        why = importable(side)
        if why:
            record(side, ok=False, error=why)
            return False
        before = _memory(device)[0]
        _reset_peak(device)
        t0 = time.perf_counter()
        try:
            built[side] = obj = BUILDERS[side](shape, device, bf16, compiled)
            resident[side] = _memory(device)[0] - before
            module = getattr(obj, "model", None) or obj.engine.model
            params = sum(p.numel() for p in module.parameters())
            workarounds = getattr(obj, "workarounds", [])
            record(side, ok=True, error=None, oom=False, system=obj.system, params=params, workarounds=workarounds)
            timed(side, warmup, timing=False)  # compiles, autotunes, allocates the AdamW state
            resident[side] = _memory(device)[0] - before
            record(side, build_s=round(time.perf_counter() - t0, 2), resident_bytes=resident[side])
            timed(side, steps, timing=True)  # round 0, in build order
            return True
        except Exception as exc:  # noqa: BLE001 - an OOM or an API break of one side leaves the others measured
            oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
            error = f"{type(exc).__name__}: {str(exc)[:400]}"
            record(side, ok=False, error=error, oom=oom)
            print(traceback.format_exc(), file=sys.stderr)
            release(side)
            if compiled and not oom and side != "megatron":  # Megatron-Core runs eager anyway
                raw["sides"][side] = {"times_s": [], "losses": [], "peak_bytes": None, "compile_error": error}
                if build(side, compiled=False):
                    record(side, system=built[side].system + " (its compile failed: see compile_error)")
                    return True
            return False

    def release(side: str) -> None:
        obj = built.pop(side, None)
        if obj is not None:
            with contextlib.suppress(Exception):
                obj.close()
            del obj
        _free(device)

    def fits_beside(last: str) -> bool:
        if device.type != "cuda":
            return True
        free, _total = torch.cuda.mem_get_info(device)
        need = resident.get(last, 0) + (raw["sides"][last].get("peak_bytes") or 0)
        return free > 1.15 * need

    groups: list[list[str]] = []

    def play() -> None:  # the resident sides' timed rounds, the order reversed every round
        group = list(built)
        groups.append(group)
        for r in range(1, rounds):  # round 0 ran right after each side's warm-up
            for side in group if r % 2 == 0 else group[::-1]:
                timed(side, steps, timing=True)
        for side in group:
            release(side)
        if compile:
            torch._dynamo.reset()  # compiled code keeps its module's tensors alive; no side is left to recompile
        _free(device)
        raw["rounds"] = (
            "alternating"
            if len(groups) == 1
            else "alternating within the groups that fit on the device together: "
            + " | ".join(", ".join(g) for g in groups)
        )

    for side in sides:
        if built and not fits_beside(list(built)[-1]):
            play()
        ok = build(side)
        if not ok and built and raw["sides"][side].get("oom"):
            play()
            ok = build(side)  # again, alone on the device
    if built:
        play()
    return raw


# --------------------------------------------------------------------------- records

DENSE_TARGETS = (("tokens/s vs torchtitan (compiled)", 1.10), ("MFU", 0.50), ("tokens/s vs Megatron-Core", None))
MOE_TARGETS = (("tokens/s vs the faster peer", 1.10), ("MFU", None))
MEMORY = ("peak memory vs the peers", 1.0)


def target_names(model: str) -> list[tuple[str, float | None]]:
    """The (record name, target) pairs of one model, in order."""
    base = DENSE_TARGETS if not MODELS[model].is_moe else MOE_TARGETS
    return [(f"{model} {what}", target) for what, target in (*base, MEMORY)]


def _record(name, metric, unit, target, env, meshtron=None, baseline=None, ratio=None, note=None, **extra):
    """One record (bench/kernel_records.py `record_of`); every peer target is "higher is better"."""
    t = Target(name, metric, unit, target, "higher", part=name.split()[0])
    ratio = None if ratio is None else round(ratio, 4)
    return record_of(t, meshtron, baseline, ratio, env=env, note=note, **extra)


def _ok(raw: dict, side: str) -> dict | None:
    entry = raw["sides"].get(side) or {}
    return entry if entry.get("ok") and entry.get("tokens_per_s") else None


def _why(raw: dict, side: str) -> str:
    entry = raw["sides"].get(side)
    if entry is None:
        return f"{side} did not run"
    return entry.get("error") or f"{side} did not finish its timed steps"


def model_records(model: str, raw: dict | None, env: dict) -> list[dict]:
    """The records of one model from its raw figures (None: its part did not run)."""
    names = target_names(model)
    if raw is None:
        return [
            _record(
                n, n[len(model) + 1 :], "", t, env, note=f"not measured: part {model!r} did not run or did not finish"
            )
            for n, t in names
        ]
    me = _ok(raw, "meshtron")
    shape = f"{model}: " + ", ".join(f"{k} {v}" for k, v in raw["shape"].items() if v)
    extra = dict(shape=shape, rounds=raw.get("rounds"), precision=raw.get("precision"))
    extra["systems"] = {s: e.get("system") or e.get("error") for s, e in raw["sides"].items()}
    extra["tokens_per_s"] = {s: e.get("tokens_per_s") for s, e in raw["sides"].items()}
    out = []
    tps = "training tokens/s (median step), " + raw.get("precision", "")

    def rate_vs(name, target, peers, label):
        got = [(raw["sides"][p]["tokens_per_s"], p) for p in peers if _ok(raw, p)]
        if me is None or not got:
            why = _why(raw, "meshtron") if me is None else "; ".join(_why(raw, p) for p in peers)
            return _record(name, tps + label, "tokens/s", target, env, me and me["tokens_per_s"], note=why, **extra)
        best, who = max(got)
        return _record(
            name, tps + label, "tokens/s", target, env, me["tokens_per_s"], best, me["tokens_per_s"] / best,
            peer=who, **extra,
        )  # fmt: skip

    for name, target in names:
        what = name[len(model) + 1 :]
        if what == "tokens/s vs torchtitan (compiled)":
            out.append(rate_vs(name, target, ["torchtitan"], " vs torchtitan with per-block compile"))
        elif what == "tokens/s vs Megatron-Core":
            out.append(rate_vs(name, target, ["megatron"], " vs Megatron-Core local spec"))
        elif what == "tokens/s vs the faster peer":
            out.append(rate_vs(name, target, ["torchtitan", "megatron"], " vs the faster of torchtitan, Megatron-Core"))
        elif what == "MFU":
            metric = f"model FLOPs utilisation ({FLOP_FORMULA}) / {raw['peak_source']}"
            if me is None:
                out.append(_record(name, metric, "fraction", target, env, note=_why(raw, "meshtron"), **extra))
                continue
            peers = {p: round(raw["sides"][p]["mfu"], 4) for p in ("torchtitan", "megatron") if _ok(raw, p)}
            out.append(
                _record(name, metric, "fraction", target, env, me["mfu"], None, me["mfu"], peer_mfu=peers, **extra)
            )
        else:  # peak memory
            metric = "peak device memory of the step (torch.cuda.max_memory_allocated), the smaller peer / meshtron"
            mine = me and me.get("peak_bytes")
            got = [
                (raw["sides"][p]["peak_bytes"], p)
                for p in ("torchtitan", "megatron")
                if (_ok(raw, p) or {}).get("peak_bytes")
            ]
            ooms = [p for p in ("torchtitan", "megatron") if (raw["sides"].get(p) or {}).get("oom")]
            if not mine or not got:
                if raw.get("device_type") == "cpu":
                    why = "not measured on the CPU (device memory only)"
                elif not mine:
                    why = _why(raw, "meshtron")
                else:
                    why = "no peer finished: " + "; ".join(_why(raw, p) for p in ("torchtitan", "megatron"))
                out.append(_record(name, metric, "bytes", target, env, mine or None, note=why, peers_oom=ooms, **extra))
                continue
            least, who = min(got)
            out.append(
                _record(
                    name, metric, "bytes", target, env, mine, least, least / mine, peer=who, peers_oom=ooms, **extra
                )
            )
    return out


def merge(raws: dict[str, dict], env: dict) -> list[dict]:
    """One record per target of every model in `MODELS` order; a model without raw figures
    leaves its targets "not measured"."""
    return [rec for model in MODELS for rec in model_records(model, raws.get(model), env)]


def check(records) -> list[str]:
    """Problems of a peers results file (bench/kernel_records.py `check` against this issue's
    `target_names`): every key of the contract, known names, `met` consistent with ratio and target."""
    known = {n: Target(n, "", "", t, "higher", part=m) for m in MODELS for n, t in target_names(m)}
    return check_records(records, known, "issue 37 (bench/peers.py target_names)")


def results_name(date: str, device: str) -> str:
    return f"{date}-{device_slug(device)}-peers.json"


# --------------------------------------------------------------------------- CLI


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-rehearsal", action="store_true", help="tiny shapes on the CPU, fp32, 2 steps")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=None, help="default: all")
    p.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--warmup", type=int, default=None, help="default 3 (rehearsal 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per round (default 4; rehearsal 1)")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (rehearsal 1)")
    p.add_argument("--no-compile", action="store_true", help="every side eager (the CPU's default)")
    p.add_argument("--compile", action="store_true", help="compile on the CPU too (inductor's C++ kernels)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on the CPU too (CUDA always has it)")
    p.add_argument("--raw-dir", type=Path, default=None, help="write each model's raw figures to DIR/<model>.json")
    p.add_argument("--out-dir", type=Path, default=None, help="write the records to DIR/<date>-<device>-peers.json")
    p.add_argument("--no-records", action="store_true", help="raw figures only (a part of gpu_session.sh peers)")
    p.add_argument("--merge-only", action="store_true", help="records from --raw-dir's files, nothing run")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    models = args.models or list(MODELS)
    raws: dict[str, dict] = {}
    env = None
    if args.merge_only:  # no torch import unless no part left figures (then this process's env)
        for path in sorted(args.raw_dir.glob("*.json")) if args.raw_dir is not None else []:
            try:
                raw = json.loads(path.read_text())
                raws[raw["model"]] = raw
                env = env or raw.get("env")
            except (OSError, ValueError, KeyError) as err:
                print(f"{path}: unreadable ({err}); its records are 'not measured'", file=sys.stderr)
        env = env or current_env(rehearsal=args.cpu_rehearsal or None)
    else:
        import torch

        env = current_env(rehearsal=args.cpu_rehearsal or None)
        if args.cpu_rehearsal:
            device = torch.device("cpu")
        elif args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
            device = torch.device("cuda", 0)
        else:
            device = torch.device("cpu")
        tiny = args.cpu_rehearsal or device.type == "cpu"
        bf16 = device.type == "cuda" or args.bf16
        compile = not args.no_compile and (device.type == "cuda" or args.compile)
        defaults = (1, 1, 1) if tiny else (3, 4, 3)
        warmup, steps, rounds = (
            v if v is not None else d for v, d in zip((args.warmup, args.steps, args.rounds), defaults)
        )
        for model in models:
            shape = (TINY if tiny else MODELS)[model]

            def save(raw, model=model):
                raw["env"] = env
                if args.raw_dir is not None:
                    args.raw_dir.mkdir(parents=True, exist_ok=True)
                    (args.raw_dir / f"{model}.json").write_text(json.dumps(raw, indent=1) + "\n")

            t0 = time.perf_counter()
            raws[model] = run_model(
                model, shape, args.sides, device, bf16=bf16, compile=compile, warmup=warmup, steps=steps,
                rounds=rounds, save=save,
            )  # fmt: skip
            print(f"== {model}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            _free(device)
    if args.no_records:
        return 0
    records = merge(raws, env)
    problems = check(records)
    text = json.dumps(records, indent=1, ensure_ascii=False)
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / results_name(env["date"], env["device"])
        path.write_text(text + "\n")
        met = sum(r["met"] is True for r in records)
        measured = sum(r["meshtron"] is not None for r in records)
        print(f"{path}: {len(records)} records, {measured} with a figure, {met} targets met", file=sys.stderr)
    else:
        print(text)
    for line in problems:
        print(f"schema: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
