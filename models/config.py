"""Model configuration shared by every layout: one dataclass for GPT-2 and Llama families."""

from __future__ import annotations

from dataclasses import dataclass

from meshtron.kernels.backend import RESOLVED as RESOLVED_BACKENDS
from meshtron.models.fits import layout_checks
from meshtron.models.rope import rope_scaling_checks
from meshtron.moe.config import ROUTING_FIELDS, MoEConfig, scope_checks, score_check
from meshtron.mpu.document_attention import ATTENTION_BACKENDS
from meshtron.mpu.mesh import ParallelConfig
from meshtron.rules import COMPILE_MODES, Check, raise_first
from meshtron.schema import declared_in, field_checks, setting

RECOMPUTE_MODES = ("none", "selective", "full")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")
ATTENTIONS = ("mha", "mla")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")

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
    `trainer.lm_loss_chunk_rows`), every block compiled or not (`trainer.compile`,
    `trainer.compile_mode`), the MoE layers compiled or not (`trainer.compile_moe`) and
    their dispatch chunks (`trainer.moe_dispatch_chunks`), packed documents' attention
    (`trainer.attention_backend`).
    Given to `GPT` beside its `GPTConfig`; never saved with the weights."""

    recompute: str = setting(
        "none", choices=RECOMPUTE_MODES, help="none | selective (attention core) | full (whole layers)"
    )
    recompute_layers: int | None = setting(None, ge=1, help="with full: recompute only the first N layers (null = all)")
    kernel_backend: str = setting(
        "torch", choices=RESOLVED_BACKENDS, help="the kernel backend kernels.backend resolved to (torch | triton)"
    )
    # The LM head and the loss in one chunked pass (kernels/linear_cross_entropy.py): the last
    # chunk's forward returns the head's input and `GPT.loss_sum` computes the summed loss.
    fused_lm_loss: bool = setting(
        True, help="LM head + cross-entropy in row chunks: the [tokens, vocab/tp] logits never exist whole"
    )
    lm_loss_chunk_rows: int | None = setting(
        None, ge=1, help="rows per chunk of the fused loss (null: about 2 Mi logits on CPU, 128 Mi on CUDA)"
    )
    # Each MoE layer under torch.compile (`trainer.compile_moe`): whole, or its router and
    # experts (moe/layer.py MoELayer.compile_moe; what it needs: meshtron/rules.py compile_moe_checks).
    compile_moe: bool = setting(
        False, help="torch.compile each MoE layer (whole, or its router and experts); bf16 (meshtron/rules.py)"
    )
    # Every transformer block's body under torch.compile (`trainer.compile`; Block.compile_body,
    # its run rules meshtron/rules.py compile_checks): supersedes compile_moe.
    compile: bool = setting(
        False, help="torch.compile every transformer block (dense and MoE), inductor's kernels (meshtron/rules.py)"
    )
    compile_mode: str = setting(
        "default",
        choices=COMPILE_MODES,
        help="trainer.compile's torch.compile mode: default | max-autotune-no-cudagraphs | reduce-overhead "
        "(CUDA graphs: CUDA, no host sync in the step)",
    )
    # Each MoE layer's tokens dispatched in this many chunks, so that one chunk's experts run
    # while another's tokens travel (`trainer.moe_dispatch_chunks`; moe/layer.py MoELayer).
    moe_dispatch_chunks: int = setting(
        1,
        ge=1,
        help="MoE tokens dispatched in N chunks at ep/etp > 1: one chunk's experts overlap another's all-to-alls",
    )
    # Packed documents' attention without the dense [b, 1, s, s] mask where the device allows
    # (`trainer.attention_backend`; mpu/document_attention.py, its run rules attention_backend_checks).
    attention_backend: str = setting(
        "auto",
        choices=ATTENTION_BACKENDS,
        help="packed documents' attention: auto (varlen on CUDA in 16 bits, flex on CUDA in fp32, else dense) "
        "| dense | flex | varlen",
    )

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
    MoE fields are parsed now and used by the MoE layers (see `moe/`); the routing ones are
    MoEConfig's declarations (moe/config.py ROUTING_FIELDS), copied, never declared again.

    Decision (one source per default): these defaults are the run's model, the tiny GPT-2 that
    `python train.py` trains (configs/train.yaml is generated from them: 4 layers, hidden 128,
    seq_len 128). They used to be 2/64/64 here while train.yaml said 4/128/128; the run's
    values won, and code that needs a smaller model (tests, bench) names its sizes.
    """

    num_layers: int = setting(4, ge=1, help="transformer layers")
    hidden_size: int = setting(128, ge=1, help="model width (head dim = hidden_size / num_heads unless kv_channels)")
    num_heads: int = setting(4, ge=1, help="attention heads")
    num_kv_heads: int | None = setting(None, ge=1, help="null = num_heads; fewer = grouped-query attention")
    ffn_hidden_size: int | None = setting(None, ge=1, help="null = 4 * hidden_size")
    vocab_size: int = setting(256, ge=2, help="vocabulary size (256: the byte-level tokenizer's)")
    seq_len: int = setting(128, ge=1, help="tokens per training sequence")
    dropout: float = setting(0.0, ge=0, lt=1, help="dropout on hidden states")
    attention_dropout: float | None = setting(
        None, ge=0, lt=1, help="dropout on attention probabilities (null = model.dropout; 0 with parallel.cp > 1)"
    )
    arch: str = setting(
        "gpt2",
        choices=tuple(ARCH_DEFAULTS),
        help="gpt2 (LayerNorm, GeLU, learned positions) | llama (RMSNorm, SwiGLU, RoPE)",
    )
    norm: str | None = setting(
        None, choices=NORMS + (None,), in_train_yaml=False, help="layernorm | rmsnorm (null = the arch's)"
    )
    activation: str | None = setting(
        None, choices=ACTIVATIONS + (None,), in_train_yaml=False, help="gelu | swiglu (null = the arch's)"
    )
    position: str | None = setting(
        None, choices=POSITIONS + (None,), in_train_yaml=False, help="learned | rope (null = the arch's)"
    )
    bias: bool | None = setting(None, in_train_yaml=False, help="biases in linear layers (null = the arch's)")
    tie_embeddings: bool = setting(True, help="the LM head shares the embedding's weights")
    init_std: float = setting(0.02, gt=0, help="std of the normal weight init")
    norm_eps: float = setting(1e-5, gt=0, in_train_yaml=False, help="epsilon of the LayerNorm/RMSNorm")
    rope_theta: float = setting(10000.0, gt=0, in_train_yaml=False, help="RoPE base")
    # RoPE frequency scaling (models/rope.py ROPE_SCALING_KEYS, ROPE_SCALING_OPTIONAL): Hugging
    # Face's rope_scaling / rope_parameters dict without rope_theta, e.g. Llama 3.1's
    # {rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0,
    # original_max_position_embeddings: 8192} or Qwen2.5's {rope_type: yarn, factor: 4.0,
    # original_max_position_embeddings: 32768} (yarn may also hold attention_factor, beta_fast,
    # beta_slow, mscale, mscale_all_dim, truncate).
    rope_scaling: dict | None = setting(
        None,
        in_train_yaml=False,
        help="RoPE frequency scaling: null (plain RoPE) | {rope_type: llama3 | yarn, factor, ...}",
    )
    qkv_bias: bool | None = setting(
        None, in_train_yaml=False, help="bias on the q/k/v projection (null = model.bias; Qwen2: true, bias false)"
    )
    # Qwen3: the head width need not be hidden_size / num_heads (Megatron's --kv-channels),
    # and each head's q and k pass an RMSNorm (one weight of head_dim shared by the heads)
    # before RoPE.
    kv_channels: int | None = setting(
        None,
        ge=1,
        in_train_yaml=False,
        help="width of each attention head's q, k and v (null = hidden_size / num_heads)",
    )
    qk_norm: bool = setting(False, in_train_yaml=False, help="RMSNorm over each head's q and k before RoPE (Qwen3)")
    sliding_window: int | None = setting(
        None,
        ge=1,
        in_train_yaml=False,
        help="attention window (Mistral): query i sees keys i-w < j <= i; null or >= seq_len: full causal",
    )
    # Multi-head latent attention (DeepSeek-V2/V3, models/mla.py): q (optionally) and k/v pass
    # low-rank latents; each head's q and k are a nope part and a rope part, the rope key one
    # head shared by all; v has a width of its own. Transformers' DeepseekV3Config names.
    attention: str = setting(
        "mha",
        choices=ATTENTIONS,
        in_train_yaml=False,
        help="mha (multi-head / grouped-query, fused QKV) | mla (multi-head latent attention, DeepSeek-V2/V3)",
    )
    q_lora_rank: int | None = setting(
        None, ge=1, in_train_yaml=False, help="mla: rank of the q latent (null = a plain q projection)"
    )
    kv_lora_rank: int | None = setting(None, ge=1, in_train_yaml=False, help="mla: rank of the shared k/v latent")
    qk_nope_head_dim: int | None = setting(
        None, ge=1, in_train_yaml=False, help="mla: width of each head's q/k part without RoPE"
    )
    qk_rope_head_dim: int | None = setting(
        None, ge=1, in_train_yaml=False, help="mla: width of each head's q/k RoPE part (the rope key: one head shared)"
    )
    v_head_dim: int | None = setting(
        None, ge=1, in_train_yaml=False, help="mla: width of each head's v (null = qk_nope_head_dim)"
    )
    # Mixture of Experts (0 experts = dense model).
    num_experts: int = setting(0, ge=0, help="> 0: MoE layers (see configs/model/moe_tiny.yaml)")
    top_k: int = setting(2, help="experts each token is routed to")
    moe_every: int = setting(1, ge=1, in_train_yaml=False, help="every N-th layer's MLP is MoE (counting from 1)")
    # Layer patterns of the fine-grained MoE models: DeepSeek-V3's first_k_dense_replace (the
    # first 3 layers dense) and Qwen-MoE's mlp_only_layers (listed layers dense).
    moe_first_dense: int = setting(
        0, ge=0, in_train_yaml=False, help="the first N layers keep a dense MLP (DeepSeek-V3: first_k_dense_replace)"
    )
    moe_dense_layers: list[int] | None = setting(
        None, in_train_yaml=False, help="0-based layers that keep a dense MLP (Qwen-MoE: mlp_only_layers); null = none"
    )
    moe_ffn_hidden_size: int | None = setting(
        None, ge=1, in_train_yaml=False, help="each expert's ffn width (null = ffn_hidden_size)"
    )
    capacity_factor: float | None = declared_in(MoEConfig, "capacity_factor")
    aux_loss_coef: float = declared_in(MoEConfig, "aux_loss_coef")
    z_loss_coef: float = declared_in(MoEConfig, "z_loss_coef")
    router_score: str = declared_in(MoEConfig, "router_score")
    router_renormalize: bool = declared_in(MoEConfig, "router_renormalize")
    router_bias_update_rate: float = declared_in(MoEConfig, "router_bias_update_rate")
    aux_loss_scope: str = declared_in(MoEConfig, "aux_loss_scope")
    aux_loss_layers: str = declared_in(MoEConfig, "aux_loss_layers")
    router_groups: int = declared_in(MoEConfig, "router_groups")
    router_topk_groups: int = declared_in(MoEConfig, "router_topk_groups")
    shared_experts: int = declared_in(MoEConfig, "shared_experts")
    router_scaling_factor: float = declared_in(MoEConfig, "router_scaling_factor")
    shared_ffn_hidden_size: int | None = declared_in(MoEConfig, "shared_ffn_hidden_size")
    shared_expert_gate: bool = declared_in(MoEConfig, "shared_expert_gate")
    # Multi-token prediction (DeepSeek-V3 section 2.2, models/mtp.py): D extra depths on the last
    # pipeline stage, each one block predicting one token further; the objective adds
    # mtp_loss_weight / D * sum_k (mean cross-entropy of depth k).
    mtp_depths: int = setting(
        0, ge=0, in_train_yaml=False, help="multi-token prediction depths (DeepSeek-V3: 1); 0 = none"
    )
    mtp_loss_weight: float = setting(
        0.3, ge=0, in_train_yaml=False, help="weight lambda of the mean MTP loss (DeepSeek-V3: 0.3, later 0.1)"
    )
    # Set by models/hf/ on import: the Mixtral config's {"router_aux_loss_coef",
    # "output_router_logits"}, written back on export while aux_loss_coef still equals what
    # they import as (None: not imported). The model never reads it.
    hf_router_fields: dict | None = setting(
        None, in_train_yaml=False, help="set by meshtron-hf import: the Mixtral router fields export writes back"
    )
    # Set by models/hf/ on import where the architecture alone does not name the HF family
    # (Mistral is Llama's architecture); export writes it back. The model never reads it.
    hf_model_type: str | None = setting(
        None,
        choices=(None, "mistral"),
        in_train_yaml=False,
        help="set by meshtron-hf import: the HF model_type export writes (mistral: Llama's architecture)",
    )

    def __post_init__(self) -> None:
        raise_first(field_checks("model", self))  # types and ranges before any arithmetic on them
        norm, act, pos, bias = ARCH_DEFAULTS[self.arch]
        self.norm = self.norm or norm
        self.activation = self.activation or act
        self.position = self.position or pos
        self.bias = bias if self.bias is None else self.bias
        if self.qkv_bias is None:
            self.qkv_bias = self.bias
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.attention == "mla" and self.v_head_dim is None:
            self.v_head_dim = self.qk_nope_head_dim
        raise_first(self._cross_field_checks())

    def validate(self) -> None:
        """Raise ValueError naming the field and what to change: each field's type and range
        (meshtron/schema.py), then the rules between fields (for a config changed after it was built)."""
        raise_first(field_checks("model", self))
        raise_first(self._cross_field_checks())

    def _cross_field_checks(self) -> list[tuple[bool, str]]:
        """The rules between fields (types and ranges already hold)."""
        return [
            (
                self.attention == "mla" or self.kv_channels is not None or self.hidden_size % self.num_heads == 0,
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}; "
                f"set model.kv_channels for a head width of its own",
            ),
            (
                self.num_heads % self.num_kv_heads == 0,
                f"model.num_heads={self.num_heads} is not divisible by model.num_kv_heads={self.num_kv_heads}",
            ),
            *self._mla_checks(),
            (
                self.position != "rope" or self.rope_dim is None or self.rope_dim % 2 == 0,
                f"RoPE needs an even head dim; the head dim is {self.head_dim}"
                if self.attention == "mha"
                else f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE turns pairs of dims)",
            ),
            *rope_scaling_checks(self.rope_scaling, self.position),
            *self._moe_checks(),
        ]

    def _mla_checks(self) -> list[tuple[bool, str]]:
        """Multi-head latent attention's rules (models/mla.py): its shape fields set with
        attention=mla and only then; RoPE; no grouped-query heads, q/k norm, q/k/v biases,
        kv_channels or sliding window (context parallelism is refused by the layer)."""
        if self.attention != "mla":
            given = [name for name in MLA_FIELDS if getattr(self, name) is not None]
            return [
                (not given, f"model.{given[0] if given else ''} is an mla field; set model.attention=mla or drop it")
            ]
        missing = [
            name for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim") if getattr(self, name) is None
        ]
        return [
            (not missing, f"model.attention=mla needs model.{', model.'.join(missing)} set"),
            (
                self.position == "rope",
                f"model.attention=mla needs model.position=rope (arch llama), not {self.position}",
            ),
            (
                self.num_kv_heads == self.num_heads,
                f"model.attention=mla has no grouped-query heads: model.num_kv_heads={self.num_kv_heads} must be "
                f"null or model.num_heads={self.num_heads}",
            ),
            (not self.qkv_bias, "model.attention=mla has no q/kv projection biases: set model.qkv_bias=false"),
            (not self.qk_norm, "model.qk_norm is not defined for model.attention=mla (its latents are normed instead)"),
            (
                self.kv_channels is None,
                "model.kv_channels is not used by model.attention=mla: set model.qk_nope_head_dim, "
                "qk_rope_head_dim and v_head_dim instead",
            ),
            (
                self.attention_window is None,
                f"model.sliding_window={self.sliding_window} is not supported with model.attention=mla",
            ),
        ]

    def _moe_checks(self) -> list[tuple[bool, str]]:
        """moe/config.py's rules on the MoE fields (the router score and aux-loss scope are
        checked on dense models too: a typo should not wait for the first MoE run)."""
        dense = list(self.moe_dense_layers or ())
        pattern = [
            (
                all(isinstance(i, int) and 0 <= i < self.num_layers for i in dense),
                f"model.moe_dense_layers={dense} must list layer indices between 0 and {self.num_layers - 1}",
            )
        ]
        if not self.num_experts:
            return [score_check(self.router_score), *scope_checks(self.aux_loss_scope, self.aux_loss_layers), *pattern]
        return [*self.moe().checks(), *pattern]

    def moe(self) -> MoEConfig:
        """The config of this model's MoE layers (moe/config.py): the model's shape and its
        routing fields (ROUTING_FIELDS, the same names here)."""
        return MoEConfig(
            hidden_size=self.hidden_size,
            num_experts=self.num_experts,
            top_k=self.top_k,
            ffn_hidden_size=self.moe_ffn_hidden_size,
            activation=self.activation,
            init_std=self.init_std,
            num_layers=self.num_layers,
            **{name: getattr(self, name) for name in ROUTING_FIELDS},
        )

    @property
    def attention_dropout_p(self) -> float:
        """Dropout on the attention probabilities: `attention_dropout`, else `dropout`."""
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def attention_window(self) -> int | None:
        """The sliding window when it restricts attention (model.sliding_window < seq_len), else
        None: a window >= the sequence length is full causal attention."""
        if self.sliding_window is None or self.sliding_window >= self.seq_len:
            return None
        return self.sliding_window

    @property
    def head_dim(self) -> int:
        """Width of each head's q and k (and v under mha): `kv_channels`, else hidden_size /
        num_heads; under attention=mla qk_nope_head_dim + qk_rope_head_dim (v: v_head_dim)."""
        if self.attention == "mla":
            return (self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def rope_dim(self) -> int | None:
        """Width RoPE rotates in each head: head_dim, or qk_rope_head_dim under attention=mla."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layout_checks(self, par: ParallelConfig) -> list[Check]:
        """The rules the resolved layout `par` must meet to split this model (models/fits.py);
        what `mpu.mesh.build_mesh` asks before it builds any group."""
        return layout_checks(par, self)

    def is_moe_layer(self, index: int) -> bool:
        """Layer `index` (0-based) has an MoE MLP: every `moe_every`-th layer, counting from 1,
        past the first `moe_first_dense` layers and not listed in `moe_dense_layers`."""
        return (
            self.is_moe
            and (index + 1) % self.moe_every == 0
            and index >= self.moe_first_dense
            and index not in (self.moe_dense_layers or ())
        )

    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of 128*tp (padded logits never enter the loss)."""
        multiple = 128 * tp
        return -(-self.vocab_size // multiple) * multiple
