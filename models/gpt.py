"""GPT built from tensor/sequence-parallel layers; both GPT-2 and Llama families.

Activations inside the model are [s, b, h] (sequence-sharded [s/tp, b, h] between TP
regions under SP). Per layer at tp > 1 there is exactly one fused QKV column-parallel
projection and one row-parallel output projection in attention, and one column/row pair in
the MLP, so two all-reduces forward and two backward (or the SP all-gather/reduce-scatter
pairs). All communication goes through `mpu` over the mesh's TP group.

Context parallelism (`mesh.cp`): every rank holds 2 of the 2*cp load-balanced chunks of each
sequence ([s/cp(/tp), b, h]); attention runs `mpu.context_parallel` (ring or all-to-all) and
positions (learned, RoPE) are the tokens' global positions. Packed documents: `doc_ids` /
`positions` per token (from `mpu.attention_blocks.document_ids`, sharded like the tokens)
restrict attention to each document and restart positions at every document.

Fused QKV weight layout (full, layout-independent): rows are grouped per KV head,
[kv_group 0: q heads of the group, k, v | kv_group 1: ... ], each head_dim rows, so a
contiguous TP chunk holds whole query groups with their k and v (tp must divide num_kv_heads).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from meshtron.eager import prepare_for_compile
from meshtron.errors import ConfigError
from meshtron.kernels import selfcheck
from meshtron.kernels.backend import plain_gemm_backend
from meshtron.kernels.linear_cross_entropy import linear_cross_entropy_sum
from meshtron.models.attention_core import causal_attention
from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.mla import MLAttention
from meshtron.models.mtp import MTPDepth, depth_batch
from meshtron.models.rope import apply_rope, rope_tables
from meshtron.moe.layer import MoELayer
from meshtron.moe.router import pooled_aux_loss
from meshtron.mpu import fp8
from meshtron.mpu.context_parallel import sequence_positions
from meshtron.mpu.cross_entropy import vocab_parallel_cross_entropy
from meshtron.mpu.document_attention import sliding_window_checks
from meshtron.mpu.init import constant_init, initialize_parameters, normal_init, tag
from meshtron.mpu.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, enter_tp_region
from meshtron.mpu.mappings import all_reduce_stats, column_parallel_linear, gather_from_region
from meshtron.mpu.mesh import Mesh
from meshtron.mpu.random import get_rng_tracker, seed_parallel_rng
from meshtron.mpu.recompute import recompute
from meshtron.rules import raise_first


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the last dim; replicated over TP (sequence-parallel under SP).
    With a Triton backend it runs `kernels.norms` (self-checked under triton_checked).

    `norm(x)` returns the normed x; `norm(x, delta)` (or `norm.residual(x, delta)`) adds the
    residual first and returns `(x + delta, norm(x + delta))`: the torch backend computes exactly
    `s = x + delta` then the norm of s, the Triton backends one fused kernel each way
    (`kernels.norms.residual_layer_norm` / `residual_rms_norm`, self-checked as
    "residual_layer_norm" / "residual_rms_norm"). Both go through the module call, so forward
    hooks see the residual form too (its output is the pair)."""

    def __init__(self, cfg: GPTConfig, mesh: Mesh, device=None, dtype=None, *, backend: str = "torch"):
        super().__init__()
        h, sp = cfg.hidden_size, mesh.sequence_parallel
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        self.backend = backend
        self.weight = tag(
            nn.Parameter(torch.empty(h, device=device, dtype=dtype)), constant_init((h,), 1.0), sequence_parallel=sp
        )
        self.bias = None
        if cfg.norm == "layernorm" and cfg.bias:
            self.bias = tag(
                nn.Parameter(torch.empty(h, device=device, dtype=dtype)), constant_init((h,), 0.0), sequence_parallel=sp
            )

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        kernel = "layer_norm" if self.kind == "layernorm" else "rms_norm"
        if delta is None:
            return selfcheck.dispatch(kernel, self.backend, self._triton, self._torch, x, self.weight, self.bias)
        return selfcheck.dispatch(
            "residual_" + kernel,
            self.backend,
            self._triton_residual,
            self._torch_residual,
            x,
            delta,
            self.weight,
            self.bias,
            check_fns=(_stacked(self._triton_residual), _stacked(self._torch_residual)),
        )

    def residual(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, norm(s)) with s = x + delta: the residual add fused with this norm (`forward`)."""
        return self(x, delta)

    def _triton(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from meshtron.kernels import norms

        if self.kind == "layernorm":
            return norms.layer_norm(x, weight, bias, self.eps, backend="triton")
        return norms.rms_norm(x, weight, self.eps, backend="triton")

    def _torch(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = (x.shape[-1],)
        if self.kind == "layernorm":
            return F.layer_norm(x, shape, weight, bias, self.eps)
        return F.rms_norm(x, shape, weight, self.eps)

    def _triton_residual(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from meshtron.kernels import norms

        if self.kind == "layernorm":
            return norms.residual_layer_norm(x, delta, weight, bias, self.eps, backend="triton")
        return norms.residual_rms_norm(x, delta, weight, self.eps, backend="triton")

    def _torch_residual(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s = x + delta  # the unfused block's ops, in its order: the torch backend is bit-identical
        return s, self._torch(s, weight, bias)


def _stacked(fn):
    """`fn`'s (s, y) pair as one fp32 tensor [2, ...]: the self-check compares one output (and
    sends a random gradient into both halves, so the backward is checked with both flowing)."""

    def stacked(*args):
        s, y = fn(*args)
        return torch.stack((s.float(), y.float()))

    return stacked


def _dropout(x: torch.Tensor, p: float, training: bool, mesh: Mesh) -> torch.Tensor:
    """Dropout on [s, b, h]; sequence shards (SP) draw from the per-TP-rank stream."""
    if p == 0.0 or not training:
        return x
    if mesh.sequence_parallel:
        with get_rng_tracker().fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


class Attention(nn.Module):
    """Causal self-attention with heads split over TP; grouped-query when num_kv_heads < num_heads.
    `selective`: recompute the attention core in backward instead of saving its internals."""

    def __init__(
        self,
        cfg: GPTConfig,
        mesh: Mesh,
        device=None,
        dtype=None,
        *,
        selective: bool = False,
        backend: str = "auto",
    ):
        super().__init__()
        self.cfg, self.mesh, self.selective = cfg, mesh, selective
        self.backend = backend  # packed documents' attention (mpu/document_attention.py)
        # Mistral's sliding window when it restricts (< seq_len): any cp, not varlen
        self.window = cfg.attention_window
        raise_first(sliding_window_checks(backend, self.window, mesh.cp_size, mesh.par.cp_comm), ConfigError)
        self.head_dim = cfg.head_dim
        self.q_per_group = cfg.num_heads // cfg.num_kv_heads
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size, qkv_out, mesh, bias=cfg.qkv_bias, init_std=cfg.init_std, device=device, dtype=dtype
        )
        self.proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim,
            cfg.hidden_size,
            mesh,
            bias=cfg.bias,
            init_std=out_std,
            device=device,
            dtype=dtype,
        )
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:  # Qwen3: one RMSNorm weight per head width, shared by every head
            # Each tp rank norms its own heads, so its gradient is a partial sum over the
            # heads: summed over every rank of the stage (tp x dp x cp), as SP's norms are.
            d, split = cfg.head_dim, mesh.tp_size > 1
            self.q_norm, self.k_norm = (
                tag(
                    nn.Parameter(torch.empty(d, device=device, dtype=dtype)),
                    constant_init((d,), 1.0),
                    sequence_parallel=split,
                )
                for _ in range(2)
            )

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        qkv = self.qkv(x)  # [s, b, groups_local * (q_per_group + 2) * d]
        qkv = rearrange(qkv, "s b (g r d) -> b g r s d", r=self.q_per_group + 2, d=self.head_dim)
        q = rearrange(qkv[:, :, : self.q_per_group], "b g r s d -> b (g r) s d")
        k, v = qkv[:, :, self.q_per_group], qkv[:, :, self.q_per_group + 1]
        if self.q_norm is not None:
            eps = self.cfg.norm_eps
            q = F.rms_norm(q, (self.head_dim,), self.q_norm.to(q.dtype), eps)
            k = F.rms_norm(k, (self.head_dim,), self.k_norm.to(k.dtype), eps)
        if rope is not None:
            cos, sin = rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.training and self.selective:
            out = recompute(self._core, q, k, v, doc_ids)
        else:
            out = self._core(q, k, v, doc_ids)
        return self.proj(rearrange(out, "b h s d -> s b (h d)"))

    def _core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal mask) v over this rank's heads (models/attention_core.py:
        dropout, packed documents `doc_ids` [b, s], the sliding window `self.window` at any cp,
        context parallelism over mesh.cp)."""
        p = self.cfg.attention_dropout_p if self.training else 0.0
        return causal_attention(
            q, k, v, self.mesh, doc_ids=doc_ids, dropout_p=p, backend=self.backend, window=self.window,
            enable_gqa=self.q_per_group > 1,
        )  # fmt: skip


class MLP(nn.Module):
    """GeLU MLP (h -> ffn -> h) or SwiGLU (gate and up column-parallel, down row-parallel)."""

    def __init__(self, cfg: GPTConfig, mesh: Mesh, device=None, dtype=None, *, backend: str = "torch"):
        super().__init__()
        self.cfg, self.mesh, self.backend = cfg, mesh, backend
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        kw = dict(bias=cfg.bias, init_std=cfg.init_std, device=device, dtype=dtype)
        self.up = ColumnParallelLinear(h, f, mesh, **kw)
        self.gate = ColumnParallelLinear(h, f, mesh, **kw) if cfg.activation == "swiglu" else None
        self.down = RowParallelLinear(f, h, mesh, bias=cfg.bias, init_std=out_std, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = self.backend
        if self.gate is None and backend == "torch":
            # One node for the region entry and the GEMM: backward overlaps the input gradient's
            # all-reduce with the weight-gradient GEMM (same math as _linear_gelu_torch).
            return self.down(F.gelu(self.up(x), approximate="tanh"))
        x = enter_tp_region(x, self.mesh)  # one collective shared by gate and up
        gemm = plain_gemm_backend(backend, x.device.type)  # the fused kernels' backward dX, dW GEMMs
        if self.gate is None:
            triton_fn = functools.partial(_linear_gelu_triton, gemm_backend=gemm)
            hidden = selfcheck.dispatch(
                "linear_gelu", backend, triton_fn, _linear_gelu_torch, x, self.up.weight, self.up.bias
            )
        else:
            hidden = selfcheck.dispatch(
                "linear_swiglu",
                backend,
                functools.partial(_linear_swiglu_triton, gemm_backend=gemm),
                _linear_swiglu_torch,
                x,
                self.gate.weight,
                self.gate.bias,
                self.up.weight,
                self.up.bias,
            )
        return self.down(hidden)


def _linear_gelu_torch(x, weight, bias):
    return F.gelu(fp8.linear(x, weight, bias), approximate="tanh")


def _linear_gelu_triton(x, weight, bias, gemm_backend="triton"):
    from meshtron.kernels import linear_act

    return linear_act.linear_gelu(x, weight, bias, approximate="tanh", backend="triton", gemm_backend=gemm_backend)


def _linear_swiglu_torch(x, w_gate, b_gate, w_up, b_up):
    return F.silu(fp8.linear(x, w_gate, b_gate)) * fp8.linear(x, w_up, b_up)


def _linear_swiglu_triton(x, w_gate, b_gate, w_up, b_up, gemm_backend="triton"):
    from meshtron.kernels import linear_act

    return linear_act.linear_swiglu(x, w_gate, b_gate, w_up, b_up, backend="triton", gemm_backend=gemm_backend)


BLOCK_VARIANTS_LIMIT = 64  # compiled variants of the shared block body before dynamo gives up (Block.compile_body)


class Block(nn.Module):
    """Pre-norm transformer block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)));
    the MLP is an MoE layer for the layers `cfg.is_moe_layer` selects. The attention residual
    add and norm2 are one call (`Norm.residual`: one fused kernel each way on the Triton
    backends). The MLP residual add stays apart from the next block's norm1: the block boundary
    is where pipeline stages split and full recomputation checkpoints (kernels/norms.py)."""

    def __init__(
        self,
        cfg: GPTConfig,
        mesh: Mesh,
        index: int,
        device=None,
        dtype=None,
        *,
        execution: ExecutionConfig = ExecutionConfig(),
    ):
        super().__init__()
        self.cfg, self.mesh = cfg, mesh
        self.mode = execution.layer_mode(index)
        # compiled: inductor generates the block's kernels from the torch paths (Block.compile_body)
        backend = "torch" if execution.compile else execution.kernel_backend
        self.norm1 = Norm(cfg, mesh, device, dtype, backend=backend)
        attention = MLAttention if cfg.attention == "mla" else Attention  # models/mla.py: DeepSeek's latent attention
        self.attn = attention(
            cfg, mesh, device, dtype, selective=self.mode == "selective", backend=execution.attention_backend
        )
        self.norm2 = Norm(cfg, mesh, device, dtype, backend=backend)
        self.index = index
        self.mlp = (
            MoELayer(cfg.moe(), mesh, device, dtype, backend=backend, dispatch_chunks=execution.moe_dispatch_chunks)
            if cfg.is_moe_layer(index)
            else MLP(cfg, mesh, device, dtype, backend=backend)
        )
        self.compiled = execution.compile
        if execution.compile:  # supersedes compile_moe (meshtron/rules.py compile_checks)
            self.compile_body(execution.compile_mode)
        elif execution.compile_moe and isinstance(self.mlp, MoELayer):
            # fused elementwise kernels, far fewer launches: the whole layer where it traces,
            # else its router and experts (MoELayer.compile_moe)
            self.mlp.compile_moe()

    def compile_body(self, mode: str = "default") -> None:
        """Put this block's body (`_forward`: norms, attention, MLP or MoE layer, residuals)
        under torch.compile in `mode` (`trainer.compile`, `trainer.compile_mode`), on this
        instance: the module, its parameter names, state dict and hooks (ZeRO, parameter
        gathers) stay eager, and full recomputation wraps the compiled body (its first pass and
        its replay each run a graph). All blocks share the body's code object, so identical
        blocks share their graphs (dynamo inlines the modules; parameters are graph inputs).
        Collectives and the context-parallel ring are graph breaks where they do not trace;
        an MoE layer's communication always runs eagerly (`MoELayer.keep_collectives_eager`).
        Shapes: static in dense blocks (a new batch shape, evaluation's, compiles once more);
        torch's automatic dynamic shapes in MoE blocks, as `MoELayer.compile_moe`: the rows per
        expert after an ep all-to-all vary by step and recompile once with a dynamic count."""
        dynamic = None if isinstance(self.mlp, MoELayer) else False
        if isinstance(self.mlp, MoELayer):
            self.mlp.keep_collectives_eager()
        # Every block's variants (dense / MoE, recompute passes, train / eval, each model a
        # process builds) count against dynamo's limit per code object (8), past which it runs
        # the body eagerly with only a warning: allow many more.
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, BLOCK_VARIANTS_LIMIT)
        prepare_for_compile()  # meshtron.eager's functions (layouts, fp32 grouped GEMMs): disabled before tracing
        self._forward = torch.compile(self._forward, mode=mode, dynamic=dynamic)

    def forward(self, x: torch.Tensor, rope, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        full = self.mode == "full"
        self.recomputed_aux = self.recomputed_prob_sum = None
        if self.training and full and x.requires_grad:
            if isinstance(self.mlp, MoELayer):
                # The router's aux terms (and its summed probabilities, for a loss pooled across
                # layers) leave the recomputed region as outputs, so their gradient flows
                # through the replay (the first pass runs without grad).
                out, self.recomputed_aux, self.recomputed_prob_sum = recompute(self._forward_with_aux, x, rope, doc_ids)
                return out
            return recompute(self._forward, x, rope, doc_ids)
        return self._forward(x, rope, doc_ids)

    def _forward_with_aux(
        self, x: torch.Tensor, rope, doc_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self._forward(x, rope, doc_ids)
        routed = self.mlp.last_router
        return out, routed.aux_loss + routed.z_loss, routed.set_prob_sum

    def _forward(self, x: torch.Tensor, rope, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        p = self.cfg.dropout
        x, h = self.norm2.residual(x, _dropout(self.attn(self.norm1(x), rope, doc_ids), p, self.training, self.mesh))
        return x + _dropout(self.mlp(h), p, self.training, self.mesh)


class GPT(nn.Module):
    """Decoder-only transformer (or one pipeline chunk of it), built already sharded for
    `mesh` (TP/SP over `mesh.tp`, experts over the expert mesh).

    `layers` selects the global layer indices this module holds (all by default);
    `pre_process` adds the embeddings (input: token ids [b, s]), `post_process` the final
    norm and LM head (output: this rank's vocabulary slice of the logits [b, s, V_pad/tp]).
    A middle chunk maps hidden states [s(/tp), b, h] to hidden states. Parameter names are the
    same in every layout ("layers.<global index>...", "embed.weight"): with tied embeddings, a
    last pipeline stage that lacks the embedding holds its own copy under that name
    (`tied_embedding_copy`), kept identical by summing both copies' gradients.
    """

    def __init__(
        self,
        cfg: GPTConfig,
        mesh: Mesh,
        device=None,
        dtype=None,
        *,
        layers=None,
        pre_process: bool = True,
        post_process: bool = True,
        execution: ExecutionConfig = ExecutionConfig(),
    ):
        super().__init__()
        self.cfg, self.mesh, self.execution = cfg, mesh, execution
        self.pre_process, self.post_process = pre_process, post_process
        self._rope_cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.pooled_aux_value: torch.Tensor | None = None  # set by aux_loss() with aux_loss_layers=pooled
        self.padded_vocab_size = cfg.padded_vocab_size(mesh.tp_size)
        layers = range(cfg.num_layers) if layers is None else layers
        # The MTP depths (last stage) embed shifted tokens: the embedding's copy is needed there too.
        needs_embedding = pre_process or (post_process and (cfg.tie_embeddings or cfg.mtp_depths > 0))
        self.embed = self._embedding(device, dtype) if needs_embedding else None
        self.pos_embed = None
        if pre_process and cfg.position == "learned":
            self.pos_embed = tag(
                nn.Parameter(torch.empty(cfg.seq_len, cfg.hidden_size, device=device, dtype=dtype)),
                normal_init((cfg.seq_len, cfg.hidden_size), cfg.init_std),
                sequence_parallel=mesh.sequence_parallel,
            )
        self.layers = nn.ModuleDict({str(i): Block(cfg, mesh, i, device, dtype, execution=execution) for i in layers})
        self.final_norm = self.head = self.logits_out = None
        if post_process:
            self.final_norm = Norm(cfg, mesh, device, dtype, backend=execution.kernel_backend)
            # The unfused head's logits pass through it, also when forward goes on to the loss:
            # a hook point for tools that watch logits (meshtron.verify).
            self.logits_out = nn.Identity()
            if not cfg.tie_embeddings:
                self.head = self._untied_head(device, dtype)
        # Multi-token prediction (models/mtp.py): the depths after the final norm, last stage only.
        self.mtp = self._mtp_depths(device, dtype) if post_process and cfg.mtp_depths else None
        self.last_mtp_sums: torch.Tensor | None = None  # [D] summed CE per depth of the last forward

    def _embedding(self, device, dtype) -> VocabParallelEmbedding:
        """The vocab-parallel token embedding (rows split over TP), marked as the LM head's tied
        copy on a stage that does not embed the input."""
        cfg = self.cfg
        embed = VocabParallelEmbedding(
            cfg.vocab_size,
            self.padded_vocab_size,
            cfg.hidden_size,
            self.mesh,
            init_std=cfg.init_std,
            device=device,
            dtype=dtype,
        )
        embed.weight.tied_embedding_copy = not self.pre_process
        # Shared with the LM head: under pp the first and last stage hold a copy each,
        # whose gradients the reducer sums over `mesh.embedding`.
        embed.weight.tied_across_stages = cfg.tie_embeddings or cfg.mtp_depths > 0
        return embed

    def _untied_head(self, device, dtype) -> ColumnParallelLinear:
        """The LM head of untied embeddings: vocab rows split over TP, padding rows zero."""
        cfg = self.cfg
        head = ColumnParallelLinear(
            cfg.hidden_size,
            self.padded_vocab_size,
            self.mesh,
            bias=False,
            init_std=cfg.init_std,
            device=device,
            dtype=dtype,
        )
        head.weight.init_fn = normal_init(
            (self.padded_vocab_size, cfg.hidden_size), cfg.init_std, valid_rows=cfg.vocab_size
        )
        head.weight.valid_rows = cfg.vocab_size
        return head

    def _mtp_depths(self, device, dtype) -> nn.ModuleList:
        """The multi-token prediction depths 1..cfg.mtp_depths (models/mtp.py), each with its
        own norms and one transformer block."""
        cfg, mesh, execution = self.cfg, self.mesh, self.execution
        backend = "torch" if execution.compile else execution.kernel_backend

        def norm():
            return Norm(cfg, mesh, device, dtype, backend=backend)

        return nn.ModuleList(
            MTPDepth(
                cfg,
                mesh,
                k,
                enorm=norm(),
                hnorm=norm(),
                # global index past the main layers: MoE or dense by cfg.is_moe_layer, as
                # DeepSeek-V3's MTP layer (index num_hidden_layers) is an MoE layer
                block=Block(cfg, mesh, cfg.num_layers + k - 1, device, dtype, execution=execution),
                norm=Norm(cfg, mesh, device, dtype, backend=execution.kernel_backend),
                device=device,
                dtype=dtype,
            )
            for k in range(1, cfg.mtp_depths + 1)
        )

    def _rope(self, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables for `seq` positions, computed once per (length, device)."""
        key = (seq, str(device))
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_tables(  # rope_dim: qk_rope_head_dim under MLA
                seq, self.cfg.rope_dim, self.cfg.rope_theta, device, self.cfg.rope_scaling
            )
        return self._rope_cache[key]

    @property
    def vocab_start(self) -> int:
        tp_local = self.padded_vocab_size // self.mesh.tp_size
        return self.mesh.tp_rank * tp_local

    def _positions_slice(self, seq: int) -> slice:
        if not self.mesh.sequence_parallel:
            return slice(0, seq)
        local = seq // self.mesh.tp_size
        return slice(self.mesh.tp_rank * local, (self.mesh.tp_rank + 1) * local)

    def _token_positions(self, s: int, positions: torch.Tensor | None, device) -> torch.Tensor | None:
        """Global positions of this rank's `s` tokens (s/cp of each sequence): `positions` [b, s]
        when given (packed documents), the cp shard's positions [s] with cp > 1, None (0..s-1)
        otherwise."""
        if positions is not None:
            return positions.to(device)
        if self.mesh.cp_size > 1:
            return sequence_positions(s * self.mesh.cp_size, self.mesh.cp_size, self.mesh.cp_rank, device)
        return None

    def _position_embedding(self, s: int, pos: torch.Tensor | None) -> torch.Tensor:
        """Learned position embeddings to add to [s(/tp), b, h]: rows `pos` ([s] -> [s, 1, h],
        [b, s] -> [s, b, h]), this tp rank's slice of the sequence under SP."""
        if pos is None:
            return self.pos_embed[self._positions_slice(s)].unsqueeze(1)
        rows = self.pos_embed[pos]  # [s, h] or [b, s, h]
        rows = rows.unsqueeze(1) if pos.dim() == 1 else rows.transpose(0, 1)
        return rows[self._positions_slice(s)]

    def _rope_at(self, s: int, pos: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos/sin for this rank's `s` tokens: [s, d] (shared positions) or [b, 1, s, d]."""
        if pos is None:
            return self._rope(s, device)
        cos, sin = self._rope(self.cfg.seq_len, device)
        if pos.dim() == 1:
            return cos[pos], sin[pos]
        return cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        mtp_inputs: torch.Tensor | None = None,
        mtp_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids [b, s/cp] (first chunk) or hidden [s/cp(/tp), b, h] -> logits [b, s/cp, V_pad/tp]
        (last chunk) or hidden [s/cp(/tp), b, h]. Packed sequences: `positions` [b, s/cp], this
        rank's tokens' positions within their documents, and `doc_ids` [b, s], the whole
        sequence's document ids (None: one document, positions of this rank's cp shard).
        With `targets` [b, s/cp] the last chunk returns instead this rank's summed LM
        cross-entropy (fp32 scalar, identical over TP): under `execution.fused_lm_loss` the head
        and the loss run in row chunks and the logits never exist whole
        (kernels/linear_cross_entropy.py), else `loss_per_token(logits, targets).sum()`. Other
        chunks ignore `targets`.
        Multi-token prediction (`model.mtp_depths`, models/mtp.py): in training mode with
        `targets`, the last chunk also runs its depths and keeps their summed cross-entropies
        [D] in `last_mtp_sums` (`mtp_loss_sums`); they read `mtp_inputs` / `mtp_labels`
        [D, b, s/cp], each depth's shifted ids and labels cut from the full sequences
        (training/packing.py `local_microbatch`; required under cp and on a last pipeline
        stage), else shift the token ids `x` [b, s] themselves."""
        cp = self.mesh.cp_size
        ids = x if self.pre_process else None
        if self.pre_process:
            b, s = x.shape
            if s * cp > self.cfg.seq_len:
                raise ValueError(f"sequence length {s * cp} exceeds model.seq_len={self.cfg.seq_len}")
            if self.mesh.sequence_parallel and s % self.mesh.tp_size:
                raise ValueError(f"sequence parallelism needs tp={self.mesh.tp_size} to divide the sequence length {s}")
            pos = self._token_positions(s, positions, x.device)
            x = self.embed(x.t())  # [s(/tp), b, h]
            if self.pos_embed is not None:
                x = x + self._position_embedding(s, pos)
            x = _dropout(x, self.cfg.dropout, self.training, self.mesh)
        else:
            s = x.shape[0] * (self.mesh.tp_size if self.mesh.sequence_parallel else 1)
            pos = self._token_positions(s, positions, x.device)
        rope = self._rope_at(s, pos, x.device) if self.cfg.position == "rope" else None
        for layer in self.layers.values():
            x = layer(x, rope, doc_ids)
        if not self.post_process:
            return x
        x = self.final_norm(x)
        self.last_mtp_sums = None
        if self.mtp is not None and targets is not None and self.training:
            if mtp_inputs is None:
                mtp_inputs, mtp_labels = self._mtp_batch(ids, targets, doc_ids)
            self.last_mtp_sums = self._mtp_loss_sums(x, mtp_inputs, mtp_labels, rope, doc_ids)
        if targets is not None and self.execution.fused_lm_loss:
            return self.lm_loss_sum(x, targets)
        logits = self.logits_out(self._head_logits(x))
        return logits if targets is None else self.loss_per_token(logits, targets).sum()

    def _head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits [b, s, V_pad/tp] of normed hidden states
        `x` [s(/tp), b, h] through the LM head (the unfused path)."""
        weight = self.lm_head_weight
        # Batch-major before the head: transposing [s, b, h] costs h per token, transposing
        # the logits V/tp per token (on the CPU a 32 MiB copy at the reference shape).
        if self.mesh.sequence_parallel:  # the sequence all-gather needs [s, b, h] order
            x = enter_tp_region(x, self.mesh).transpose(0, 1).contiguous()
            logits = F.linear(x, weight)  # [b, s, V_pad/tp], contiguous
        else:
            # Backward overlaps the input gradient's all-reduce with the LM head's weight-gradient GEMM.
            # The head stays 16-bit under trainer.precision=fp8 (its backward keeps that choice).
            with fp8.fp8_paused():
                logits = column_parallel_linear(x.transpose(0, 1).contiguous(), weight, None, self.mesh.tp)
        return logits

    def _mtp_batch(self, ids, targets, doc_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """The depths' inputs and labels [D, b, s] from whole-sequence token ids and targets
        [b, s] (no cp: under cp the shift crosses shards, so they come cut from the step)."""
        if ids is None:
            raise ValueError(
                "multi-token prediction needs the token ids: pass mtp_inputs and mtp_labels to the last chunk"
            )
        if self.mesh.cp_size > 1:
            raise ValueError(
                f"model.mtp_depths under parallel.cp={self.mesh.cp_size} needs mtp_inputs and mtp_labels "
                "cut from the full sequences (training/packing.py local_microbatch)"
            )
        return depth_batch(ids.to(targets.device), targets, self.cfg.mtp_depths, doc_ids)

    def _mtp_loss_sums(self, hidden, inputs, labels, rope, doc_ids) -> torch.Tensor:
        """Summed cross-entropy [D] of each MTP depth (models/mtp.py) from the final norm's
        output `hidden` [s(/cp)(/tp), b, h] and the depths' shifted ids and labels
        [D, b, s(/cp)]; the blocks see this rank's positions (`rope`) and `doc_ids` as the
        main blocks do (cp attention over mesh.cp)."""
        sums = []
        for depth in self.mtp:
            k = depth.depth
            embedded = self.embed(inputs[k - 1].to(labels.device).t())  # [s(/tp), b, h]
            hidden = depth(hidden, embedded, rope, doc_ids)
            normed = depth.norm(hidden)
            if self.execution.fused_lm_loss:
                sums.append(self.lm_loss_sum(normed, labels[k - 1]))
            else:
                sums.append(self.loss_per_token(self._head_logits(normed), labels[k - 1]).sum())
        return torch.stack(sums)

    def mtp_loss_sums(self) -> torch.Tensor | None:
        """The last training forward's summed cross-entropy [D] of each MTP depth (this rank's
        tokens, differentiable); None without MTP depths on this chunk or outside training."""
        return self.last_mtp_sums

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """This rank's vocabulary rows [V_pad/tp, h] of the LM head (the embedding's when tied)."""
        return self.embed.weight if self.head is None else self.head.weight

    def lm_loss_sum(self, normed: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of the final norm's output `normed` [s/cp(/tp), b, h] against
        `targets` [b, s/cp], head and loss fused in row chunks (no whole logits). Enters the TP
        region as the head does (SP all-gather / gradient all-reduce over TP); one all-gather of
        [3, rows] statistics per chunk over TP."""
        x = enter_tp_region(normed, self.mesh).transpose(0, 1)  # [b, s, h]: rows in the targets' order
        return linear_cross_entropy_sum(
            x,
            self.lm_head_weight,
            targets,
            vocab_start=self.vocab_start,
            vocab_size=self.cfg.vocab_size,
            group=self.mesh.tp,
            chunk_rows=self.execution.lm_loss_chunk_rows,
            backend=self.execution.kernel_backend,
        )

    def loss_per_token(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Unreduced cross-entropy [b, s] over vocab-parallel logits; padded vocabulary excluded.
        One all-gather of [3, tokens] statistics over the TP group forward. With a Triton backend
        the fused kernel overwrites `logits` with their gradient in backward (they are used for nothing else).
        Under triton_checked the check runs on this rank's shard alone (group=None, separate
        gradient buffer), so it never communicates; the real call keeps group=TP."""
        start, vocab, group = self.vocab_start, self.cfg.vocab_size, self.mesh.tp

        def triton(lg, tg):
            from meshtron.kernels import cross_entropy

            return cross_entropy.fused_cross_entropy(
                lg, tg, vocab_start=start, vocab_size=vocab, group=group, backend="triton"
            )

        def torch_path(lg, tg):
            return vocab_parallel_cross_entropy(lg, tg, vocab_start=start, vocab_size=vocab, group=group)

        check_fns = None
        if self.execution.kernel_backend == selfcheck.CHECKED:
            # The shard alone as the whole vocabulary; a shard of padding only is checked
            # unpadded (its real loss would be -inf/NaN in isolation).
            local_vocab = vocab if start < vocab else start + logits.shape[-1]

            def triton_local(lg, tg):
                from meshtron.kernels import cross_entropy

                return cross_entropy.fused_cross_entropy(
                    lg,
                    tg,
                    vocab_start=start,
                    vocab_size=local_vocab,
                    group=None,
                    backend="triton",
                    inplace_backward=False,
                )

            def torch_local(lg, tg):
                return vocab_parallel_cross_entropy(lg, tg, vocab_start=start, vocab_size=local_vocab, group=None)

            check_fns = (triton_local, torch_local)
        return selfcheck.dispatch(
            "cross_entropy", self.execution.kernel_backend, triton, torch_path, logits, targets, check_fns=check_fns
        )

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """All-gather local logits over TP and drop the padded vocabulary: [b, s, vocab_size]."""
        return gather_from_region(logits, -1, self.mesh.tp)[..., : self.cfg.vocab_size]

    def _blocks(self) -> list[Block]:
        """The main blocks of this chunk, then its MTP depths' blocks."""
        return list(self.layers.values()) + ([depth.block for depth in self.mtp] if self.mtp is not None else [])

    def moe_layers(self) -> list[MoELayer]:
        """The MoE layers of this chunk, the MTP depths' included (their expert bias updates too)."""
        return [block.mlp for block in self._blocks() if isinstance(block.mlp, MoELayer)]

    def aux_loss(self) -> torch.Tensor | None:
        """This rank's differentiable share of the routers' auxiliary terms (coefficients
        applied) from the last forward, summed over MoE layers (the MTP depths' too when they
        ran); None for a dense model.
        With `aux_loss_layers="pooled"` the balance term is one loss over all layers' pooled
        statistics (`moe.router.pooled_aux_loss`); its value is kept in `pooled_aux_value`."""
        # The MTP depths' routers count when they ran in the last forward (training with targets).
        blocks = self._blocks() if self.last_mtp_sums is not None else list(self.layers.values())
        blocks = [block for block in blocks if isinstance(block.mlp, MoELayer)]
        if not blocks:
            return None
        total = sum(
            block.recomputed_aux
            if getattr(block, "recomputed_aux", None) is not None
            else block.mlp.last_router.aux_loss + block.mlp.last_router.z_loss
            for block in blocks
        )
        self.pooled_aux_value = None
        if self.cfg.aux_loss_layers == "pooled":
            routed = [block.mlp.last_router for block in blocks]
            prob_sums = [
                block.recomputed_prob_sum if getattr(block, "recomputed_prob_sum", None) is not None else r.set_prob_sum
                for block, r in zip(blocks, routed)
            ]
            contribution, self.pooled_aux_value = pooled_aux_loss(
                routed, prob_sums, self.cfg.num_experts, self.cfg.top_k
            )
            if self.cfg.aux_loss_coef > 0:
                total = total + self.cfg.aux_loss_coef * contribution
        return total

    def moe_stats(self) -> list[dict]:
        """Per MoE layer of this chunk, routing statistics of the last forward over the aux-loss
        scope's stats group (no gradient); `layer` is the global layer index."""
        return [
            {
                "layer": block.index,
                "aux_loss": block.mlp.last_router.aux_value,
                "z_loss": block.mlp.last_router.z_value,
                "tokens_per_expert": block.mlp.last_router.tokens_per_expert,
                "dropped_fraction": block.mlp.last_dropped,
            }
            for block in self.layers.values()
            if isinstance(block.mlp, MoELayer)
        ]

    def update_expert_bias(self) -> None:
        """Aux-loss-free balancing: adjust each router's expert bias from the step's load.

        Each router's load covers its scope's stats group; where the scope leaves other
        microbatches on other ranks, the loads of every updating layer are first summed over
        the scope's replica group (one all-reduce, the data-parallel ranks) so that every
        rank applies the bias of the whole global batch."""
        layers = self.moe_layers()
        updating = [m for m in layers if m.router.bias_update_rate > 0]
        if updating and updating[0].scope.replicas > 1:
            loads = all_reduce_stats(
                torch.stack([m.router.step_load for m in updating]), updating[0].scope.replica_group
            )
            for m, load in zip(updating, loads):
                m.router.step_load.copy_(load)
        for m in layers:
            m.router.update_expert_bias()


def virtual_stage_layers(
    num_layers: int, pp: int, vpp: int, virtual_stage: int, stage_layers: list[int] | None = None
) -> range:
    """Global layer indices of one virtual stage: `stage_layers[i]` consecutive layers for
    virtual stage i, or an even split over pp * vpp when None."""
    counts = stage_layers if stage_layers is not None else [num_layers // (pp * vpp)] * (pp * vpp)
    start = sum(counts[:virtual_stage])
    return range(start, start + counts[virtual_stage])


def init_model_chunks(
    cfg: GPTConfig,
    mesh: Mesh,
    seed: int,
    device=None,
    dtype=None,
    *,
    execution: ExecutionConfig = ExecutionConfig(),
    initialize: bool = True,
) -> list[GPT]:
    """This rank's model chunks with their layout-independent initial values, after seeding
    the default and tensor-parallel RNG streams from `seed` (what every run does first).
    `initialize=False` leaves the parameters zero, for a caller that loads every weight next
    (a checkpoint or a Hugging Face folder): no full tensor is generated."""
    seed_parallel_rng(seed, mesh.tp_rank, mesh.pp_rank, torch.device(device or "cpu").type, cp_rank=mesh.cp_rank)
    chunks = build_model_chunks(cfg, mesh, device, dtype, execution=execution)
    for chunk in chunks:
        if initialize:
            initialize_parameters(chunk, seed, mesh)
        else:
            with torch.no_grad():
                for param in chunk.parameters():
                    param.zero_()
    return chunks


def build_model_chunks(
    cfg: GPTConfig, mesh: Mesh, device=None, dtype=None, *, execution: ExecutionConfig = ExecutionConfig()
) -> list[GPT]:
    """This rank's model chunks: chunk c is virtual stage c * pp + pp_rank (one chunk without
    interleaving). The first virtual stage embeds, the last one holds the norm and head."""
    pp, vpp = mesh.pp_size, mesh.par.vpp
    chunks = []
    for c in range(vpp):
        stage = c * pp + mesh.pp_rank
        layers = virtual_stage_layers(cfg.num_layers, pp, vpp, stage, mesh.par.stage_layers)
        chunks.append(
            GPT(
                cfg,
                mesh,
                device,
                dtype,
                layers=layers,
                pre_process=stage == 0,
                post_process=stage == pp * vpp - 1,
                execution=execution,
            )
        )
    return chunks
