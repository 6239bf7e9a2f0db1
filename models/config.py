"""Model configuration shared by every layout: one dataclass for GPT-2 and Llama families."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshtron.kernels.backend import RESOLVED as RESOLVED_BACKENDS
from meshtron.moe.config import MoEConfig, score_check, scope_checks
from meshtron.rules import raise_first
from meshtron.schema import allowed, field_checks

RECOMPUTE_MODES = ("none", "selective", "full")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")

ARCH_DEFAULTS = {
    # arch: (norm, activation, position, bias)
    "gpt2": ("layernorm", "gelu", "learned", True),
    "llama": ("rmsnorm", "swiglu", "rope", False),
}


@dataclass(frozen=True)
class ExecutionConfig:
    """How a model runs, not what it computes: activation recomputation (`trainer.recompute`,
    the first `trainer.recompute_layers` layers under full), the resolved kernel backend
    (`kernels.backend`) and the LM head fused with the loss (`trainer.fused_lm_loss`,
    `trainer.lm_loss_chunk_rows`), the MoE layers compiled or not (`trainer.compile_moe`) and
    their dispatch chunks (`trainer.moe_dispatch_chunks`).
    Given to `GPT` beside its `GPTConfig`; never saved with the weights."""

    recompute: str = field(default="none", metadata=allowed(choices=RECOMPUTE_MODES))
    recompute_layers: int | None = field(default=None, metadata=allowed(ge=1))
    kernel_backend: str = field(default="torch", metadata=allowed(choices=RESOLVED_BACKENDS))
    # The LM head and the loss in one chunked pass (kernels/linear_cross_entropy.py): the last
    # chunk's forward returns the head's input and `GPT.loss_sum` computes the summed loss.
    fused_lm_loss: bool = True
    lm_loss_chunk_rows: int | None = field(default=None, metadata=allowed(ge=1))  # None: by device (chunk_rows_for)
    # Each MoE layer under torch.compile (`trainer.compile_moe`): whole, or its router and
    # experts (moe/layer.py MoELayer.compile_moe; what it needs: meshtron/rules.py compile_moe_checks).
    compile_moe: bool = False
    # Each MoE layer's tokens dispatched in this many chunks, so that one chunk's experts run
    # while another's tokens travel (`trainer.moe_dispatch_chunks`; moe/layer.py MoELayer).
    moe_dispatch_chunks: int = field(default=1, metadata=allowed(ge=1))

    def __post_init__(self) -> None:
        raise_first(field_checks("trainer", self))

    def layer_mode(self, index: int) -> str:
        """Recompute mode of layer `index`: full for the first `recompute_layers` (all when
        None), else selective or none."""
        if self.recompute == "full" and (self.recompute_layers is None or index < self.recompute_layers):
            return "full"
        return "selective" if self.recompute == "selective" else "none"


@dataclass
class GPTConfig:
    """Shape and flavour of a GPT model.

    `arch` picks the family defaults (GPT-2: LayerNorm, GeLU, learned positions, biases;
    Llama: RMSNorm, SwiGLU, RoPE, no biases); `norm`, `activation`, `position` and `bias`
    override them one by one. `num_kv_heads` < `num_heads` gives grouped-query attention.
    MoE fields are parsed now and used by the MoE layers (see `moe/`).
    """

    num_layers: int = field(default=2, metadata=allowed(ge=1))
    hidden_size: int = field(default=64, metadata=allowed(ge=1))
    num_heads: int = field(default=4, metadata=allowed(ge=1))
    num_kv_heads: int | None = field(default=None, metadata=allowed(ge=1))
    ffn_hidden_size: int | None = field(default=None, metadata=allowed(ge=1))
    vocab_size: int = field(default=256, metadata=allowed(ge=2))
    seq_len: int = field(default=64, metadata=allowed(ge=1))
    dropout: float = field(default=0.0, metadata=allowed(ge=0, lt=1))
    # dropout on the attention probabilities; None = `dropout` (context parallelism needs 0)
    attention_dropout: float | None = field(default=None, metadata=allowed(ge=0, lt=1))
    arch: str = field(default="gpt2", metadata=allowed(choices=tuple(ARCH_DEFAULTS)))
    norm: str | None = field(default=None, metadata=allowed(choices=NORMS + (None,)))
    activation: str | None = field(default=None, metadata=allowed(choices=ACTIVATIONS + (None,)))
    position: str | None = field(default=None, metadata=allowed(choices=POSITIONS + (None,)))
    bias: bool | None = None
    tie_embeddings: bool = True
    init_std: float = field(default=0.02, metadata=allowed(gt=0))
    norm_eps: float = field(default=1e-5, metadata=allowed(gt=0))
    rope_theta: float = field(default=10000.0, metadata=allowed(gt=0))
    # Mixture of Experts (0 experts = dense model).
    num_experts: int = field(default=0, metadata=allowed(ge=0))
    top_k: int = 2
    moe_every: int = field(default=1, metadata=allowed(ge=1))
    moe_ffn_hidden_size: int | None = field(default=None, metadata=allowed(ge=1))
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    router_score: str = "softmax"
    router_renormalize: bool = True
    router_bias_update_rate: float = 0.0
    # Which tokens one load-balancing statistic pools (moe/scope.py): "microbatch" (each rank's
    # microbatch), "sequence" (DeepSeek sequence-wise) or "global" (one microbatch of every dp rank).
    aux_loss_scope: str = "microbatch"
    # "sum": one aux loss per MoE layer, summed (Switch, Megatron-Core, DeepSeek). "pooled": one
    # aux loss over the statistics pooled across all MoE layers (transformers' Mixtral/Qwen-MoE
    # load_balancing_loss_func); needs parallel.pp=1.
    aux_loss_layers: str = "sum"
    # Group-limited routing (DeepSeek-V3): experts form `router_groups` equal groups; each token
    # picks its top-k experts inside its best `router_topk_groups` groups (0 = no limit).
    router_groups: int = field(default=0, metadata=allowed(ge=0))
    router_topk_groups: int = field(default=0, metadata=allowed(ge=0))
    shared_experts: int = field(default=0, metadata=allowed(ge=0))
    # Set by models/hf/ on import: the Mixtral config's {"router_aux_loss_coef",
    # "output_router_logits"}, written back on export while aux_loss_coef still equals what
    # they import as (None: not imported). The model never reads it.
    hf_router_fields: dict | None = None

    def __post_init__(self) -> None:
        raise_first(field_checks("model", self))  # types and ranges before any arithmetic on them
        norm, act, pos, bias = ARCH_DEFAULTS[self.arch]
        self.norm = self.norm or norm
        self.activation = self.activation or act
        self.position = self.position or pos
        self.bias = bias if self.bias is None else self.bias
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        raise_first(self._cross_field_checks())

    def validate(self) -> None:
        """Raise ValueError naming the field and what to change: each field's type and range
        (meshtron/schema.py), then the rules between fields (for a config changed after it was built)."""
        raise_first(field_checks("model", self))
        raise_first(self._cross_field_checks())

    def _cross_field_checks(self) -> list[tuple[bool, str]]:
        """The rules between fields (types and ranges already hold)."""
        return [
            (self.hidden_size % self.num_heads == 0,
             f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}"),
            (self.num_heads % self.num_kv_heads == 0,
             f"model.num_heads={self.num_heads} is not divisible by model.num_kv_heads={self.num_kv_heads}"),
            (self.position != "rope" or self.head_dim % 2 == 0,
             f"RoPE needs an even head dim; hidden_size/num_heads={self.head_dim}"),
            *self._moe_checks(),
        ]

    def _moe_checks(self) -> list[tuple[bool, str]]:
        """moe/config.py's rules on the MoE fields (the router score and aux-loss scope are
        checked on dense models too: a typo should not wait for the first MoE run)."""
        if not self.num_experts:
            return [score_check(self.router_score), *scope_checks(self.aux_loss_scope, self.aux_loss_layers)]
        return self.moe().checks()

    def moe(self) -> MoEConfig:
        """The config of this model's MoE layers (moe/config.py)."""
        return MoEConfig(
            hidden_size=self.hidden_size, num_experts=self.num_experts, top_k=self.top_k,
            ffn_hidden_size=self.moe_ffn_hidden_size, activation=self.activation, init_std=self.init_std,
            num_layers=self.num_layers, capacity_factor=self.capacity_factor, aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef, router_score=self.router_score, router_renormalize=self.router_renormalize,
            router_bias_update_rate=self.router_bias_update_rate, aux_loss_scope=self.aux_loss_scope,
            aux_loss_layers=self.aux_loss_layers, router_groups=self.router_groups,
            router_topk_groups=self.router_topk_groups, shared_experts=self.shared_experts)

    @property
    def attention_dropout_p(self) -> float:
        """Dropout on the attention probabilities: `attention_dropout`, else `dropout`."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Layer `index` (0-based) has an MoE MLP: every `moe_every`-th layer, counting from 1."""
        return self.is_moe and (index + 1) % self.moe_every == 0

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of 128*tp (padded logits never enter the loss)."""
        multiple = 128 * tp
        return -(-self.vocab_size // multiple) * multiple
