"""Weights between meshtron's sharded parameters and full Hugging Face state dicts: the name and
layout map, import (every rank loads its shards) and export (gathered to global rank 0 over the
mesh's groups with mpu collectives)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from meshtron.models.config import GPTConfig
from meshtron.models.hf.config import HFConversionError, hf_family
from meshtron.models.hf.sources import DictSource, Index, SafetensorsSource
from meshtron.models.mla import deinterleave_rope_rows, interleave_rope_rows
from meshtron.mpu.init import full_tensor, local_offsets
from meshtron.mpu.mappings import gather_object
from meshtron.mpu.mesh import Mesh

TensorSource = DictSource | SafetensorsSource
_VOCAB_PARAMS = ("embed.weight", "head.weight")


# --------------------------------------------------------------------------------------------
# Name / layout map between meshtron full parameters and HF tensors
# --------------------------------------------------------------------------------------------


# read(hf_key, index) -> the sub-tensor of HF tensor `hf_key` at `index` (one slice per dim)
Reader = Callable[[str, Index], torch.Tensor]


@dataclass
class _Unit:
    """Meshtron full tensors `mt` <-> HF tensors `hf` (shapes `hf_shapes`), converted exactly.

    `read_mt(read, mt_name, box)` reads the block `box` (one slice per dim) of the full
    meshtron tensor `mt_name` through `read`, touching only the HF elements that block holds;
    `to_hf` turns the full meshtron tensors into the HF ones (export)."""

    mt: tuple[str, ...]
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    read_mt: Callable[[Reader, str, Index], torch.Tensor]
    to_hf: Callable[[list[torch.Tensor]], list[torch.Tensor]]


def _same(mt: str, hf: str, shape) -> _Unit:
    return _Unit((mt,), (hf,), (tuple(shape),), lambda read, _, box: read(hf, box), lambda t: list(t))


def _transposed(mt: str, hf: str, hf_shape) -> _Unit:
    return _Unit((mt,), (hf,), (tuple(hf_shape),), lambda read, _, box: read(hf, box[::-1]).t(), lambda t: [t[0].t()])


def _qkv_split(fused: torch.Tensor, cfg: GPTConfig) -> list[torch.Tensor]:
    d, g = cfg.head_dim, cfg.num_kv_heads
    q_rows = cfg.num_heads // g * d
    rest = tuple(fused.shape[1:])
    grouped = fused.reshape((g, q_rows + 2 * d) + rest)
    q, k, v = grouped.split([q_rows, d, d], dim=1)
    return [x.reshape((-1,) + rest) for x in (q, k, v)]


def _qkv_runs(cfg: GPTConfig, rows: slice) -> list[tuple[int, int, int]]:
    """(part: 0 q / 1 k / 2 v, first row in that part's tensor, row count): the runs that
    make up rows `rows` of meshtron's fused QKV, whose rows are grouped per KV head
    [q heads of group 0, k_0, v_0 | q heads of group 1, k_1, v_1 | ...] (models/gpt.py)."""
    d, g = cfg.head_dim, cfg.num_kv_heads
    q_rows = cfg.num_heads // g * d
    size = q_rows + 2 * d
    runs = []
    for group in range(rows.start // size, -(-rows.stop // size)):
        lo, hi = max(rows.start - group * size, 0), min(rows.stop - group * size, size)
        parts = ((0, q_rows, group * q_rows), (q_rows, q_rows + d, group * d), (q_rows + d, size, group * d))
        for part, (start, stop, first) in enumerate(parts):
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                runs.append((part, first + a - start, b - a))
    return runs


def _qkv_unit(cfg: GPTConfig, mt: str, hf_keys: tuple[str, ...], is_bias: bool, gpt2: bool) -> _Unit:
    d, nq, nkv, h = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
    if gpt2:  # one Conv1D [h, 3h] ([q | k | v] columns) or bias [3h]
        shape = (3 * h,) if is_bias else (h, 3 * h)

        def read_gpt2(read, _, box):
            pieces = []
            for part, first, count in _qkv_runs(cfg, box[0]):
                cols = slice(part * h + first, part * h + first + count)
                pieces.append(read(hf_keys[0], (cols,)) if is_bias else read(hf_keys[0], (box[1], cols)).t())
            return torch.cat(pieces, dim=0)

        def to_hf(t):
            full = torch.cat(_qkv_split(t[0], cfg), dim=0)
            return [full if is_bias else full.t()]

        return _Unit((mt,), hf_keys, (shape,), read_gpt2, to_hf)
    shapes = tuple((n * d,) if is_bias else (n * d, h) for n in (nq, nkv, nkv))

    def read_parts(read, _, box):
        runs = _qkv_runs(cfg, box[0])
        return torch.cat([read(hf_keys[p], (slice(first, first + n),) + box[1:]) for p, first, n in runs], dim=0)

    return _Unit((mt,), hf_keys, shapes, read_parts, lambda t: _qkv_split(t[0], cfg))


def _units(cfg: GPTConfig, moe_format: str = "fused", mtp_depths: int | None = None) -> list[_Unit]:
    """Every meshtron parameter of `cfg`'s full model (unpadded vocabulary) with its HF source;
    of the multi-token-prediction depths, the first `mtp_depths` (default: all of `cfg`'s)."""
    family = hf_family(cfg)
    h, f, V = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    units: list[_Unit] = []
    if family == "gpt2":
        p = "transformer."
        units += [
            _same("embed.weight", p + "wte.weight", (V, h)),
            _same("pos_embed", p + "wpe.weight", (cfg.seq_len, h)),
        ]
        for i in range(cfg.num_layers):
            L, m = f"{p}h.{i}.", f"layers.{i}."
            units += [
                _same(m + "norm1.weight", L + "ln_1.weight", (h,)),
                _same(m + "norm1.bias", L + "ln_1.bias", (h,)),
                _qkv_unit(cfg, m + "attn.qkv.weight", (L + "attn.c_attn.weight",), False, True),
                _qkv_unit(cfg, m + "attn.qkv.bias", (L + "attn.c_attn.bias",), True, True),
                _transposed(m + "attn.proj.weight", L + "attn.c_proj.weight", (h, h)),
                _same(m + "attn.proj.bias", L + "attn.c_proj.bias", (h,)),
                _same(m + "norm2.weight", L + "ln_2.weight", (h,)),
                _same(m + "norm2.bias", L + "ln_2.bias", (h,)),
                _transposed(m + "mlp.up.weight", L + "mlp.c_fc.weight", (h, f)),
                _same(m + "mlp.up.bias", L + "mlp.c_fc.bias", (f,)),
                _transposed(m + "mlp.down.weight", L + "mlp.c_proj.weight", (f, h)),
                _same(m + "mlp.down.bias", L + "mlp.c_proj.bias", (h,)),
            ]
        units += [_same("final_norm.weight", p + "ln_f.weight", (h,)), _same("final_norm.bias", p + "ln_f.bias", (h,))]
    else:
        units.append(_same("embed.weight", "model.embed_tokens.weight", (V, h)))
        for i in range(cfg.num_layers):
            units += _layer_units(cfg, i, f"layers.{i}.", moe_format, family)
        units.append(_same("final_norm.weight", "model.norm.weight", (h,)))
    if not cfg.tie_embeddings:
        units.append(_same("head.weight", "lm_head.weight", (V, h)))
    for k in range(1, (cfg.mtp_depths if mtp_depths is None else mtp_depths) + 1):
        units += _mtp_units(cfg, k, moe_format, family)
    return units


def _layer_units(cfg: GPTConfig, i: int, m: str, moe_format: str, family: str) -> list[_Unit]:
    """Decoder layer `i` of a Llama-like family (HF model.layers.<i>.*) as meshtron's block `m`."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    L = f"model.layers.{i}."
    a = L + "self_attn."
    units = [
        _same(m + "norm1.weight", L + "input_layernorm.weight", (h,)),
        _same(m + "norm2.weight", L + "post_attention_layernorm.weight", (h,)),
    ]
    units += _mla_units(cfg, m + "attn.", a) if cfg.attention == "mla" else _attention_units(cfg, m, a)
    if cfg.is_moe_layer(i):
        return (
            units
            + _expert_units(cfg, m + "mlp.", L, moe_format, family)
            + _shared_units(cfg, m + "mlp.", L + "mlp.", family)
        )
    units += [  # Llama, Mistral, Qwen2, a Qwen-MoE's dense layers
        _same(m + "mlp.gate.weight", L + "mlp.gate_proj.weight", (f, h)),
        _same(m + "mlp.up.weight", L + "mlp.up_proj.weight", (f, h)),
        _same(m + "mlp.down.weight", L + "mlp.down_proj.weight", (h, f)),
    ]
    if cfg.bias:
        units += [
            _same(m + "mlp.gate.bias", L + "mlp.gate_proj.bias", (f,)),
            _same(m + "mlp.up.bias", L + "mlp.up_proj.bias", (f,)),
            _same(m + "mlp.down.bias", L + "mlp.down_proj.bias", (h,)),
        ]
    return units


# The copies of the embedding and the output head that DeepSeek-V3's released checkpoint keeps
# in each MTP layer (shared with the main model in training): written on export, not read.
_MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def _mtp_units(cfg: GPTConfig, k: int, moe_format: str, family: str) -> list[_Unit]:
    """Multi-token-prediction depth k (models/mtp.py) in DeepSeek-V3's layout: HF layer
    model.layers.<num_layers + k - 1> holds enorm, hnorm, eh_proj ([emb; hidden] columns, as
    meshtron's proj), shared_head.norm (the depth's final norm) and a whole decoder layer."""
    if family != "deepseek_v3":
        raise HFConversionError(
            f"model.mtp_depths={cfg.mtp_depths}: multi-token-prediction weights exist in the Hugging Face "
            f"layout of deepseek_v3 only, not {family}: set model.mtp_depths=0 to export"
        )
    i, h = cfg.num_layers + k - 1, cfg.hidden_size
    L, m = f"model.layers.{i}.", f"mtp.{k - 1}."
    return [
        _same(m + "enorm.weight", L + "enorm.weight", (h,)),
        _same(m + "hnorm.weight", L + "hnorm.weight", (h,)),
        _same(m + "proj", L + "eh_proj.weight", (h, 2 * h)),
        *_layer_units(cfg, i, m + "block.", moe_format, family),
        _same(m + "norm.weight", L + "shared_head.norm.weight", (h,)),
    ]


def _attention_units(cfg: GPTConfig, m: str, a: str) -> list[_Unit]:
    """Fused QKV (rows grouped per KV head), output projection, Qwen3's q/k norms and biases."""
    h, d, nq = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    qkv = (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
    units = [
        _qkv_unit(cfg, m + "attn.qkv.weight", qkv, False, False),
        _same(m + "attn.proj.weight", a + "o_proj.weight", (h, nq * d)),
    ]
    if cfg.qk_norm:  # Qwen3: one RMSNorm weight per head width for q, one for k
        units += [
            _same(m + "attn.q_norm", a + "q_norm.weight", (d,)),
            _same(m + "attn.k_norm", a + "k_norm.weight", (d,)),
        ]
    if cfg.qkv_bias:  # Llama with attention_bias, Qwen2
        biases = (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias")
        units.append(_qkv_unit(cfg, m + "attn.qkv.bias", biases, True, False))
    if cfg.bias:
        units.append(_same(m + "attn.proj.bias", a + "o_proj.bias", (h,)))
    return units


def _mla_units(cfg: GPTConfig, m: str, a: str) -> list[_Unit]:
    """DeepSeek-V3's latent attention: the same names; the rope rows of q_b_proj (q_proj) and
    kv_a_proj_with_mqa reordered from DeepSeek's interleaved pairs to rotate-half
    (models/mla.py). A tp shard of q_b_proj holds whole heads, so the reorder is local."""
    h, nq = cfg.hidden_size, cfg.num_heads
    dn, dr, dv, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

    def rope_rows(name: str, shape, width: int, offset: int) -> _Unit:
        return _Unit(
            (m + name + ".weight",),
            (a + name + ".weight",),
            (tuple(shape),),
            lambda read, _, box: deinterleave_rope_rows(read(a + name + ".weight", box), dr, width, offset),
            lambda t: [interleave_rope_rows(t[0], dr, width, offset)],
        )

    units = []
    if cfg.q_lora_rank is not None:
        r = cfg.q_lora_rank
        units += [
            _same(m + "q_a_proj.weight", a + "q_a_proj.weight", (r, h)),
            _same(m + "q_a_layernorm.weight", a + "q_a_layernorm.weight", (r,)),
            rope_rows("q_b_proj", (nq * (dn + dr), r), dn + dr, dn),
        ]
    else:
        units.append(rope_rows("q_proj", (nq * (dn + dr), h), dn + dr, dn))
    return units + [
        rope_rows("kv_a_proj_with_mqa", (rank + dr, h), rank + dr, rank),
        _same(m + "kv_a_layernorm.weight", a + "kv_a_layernorm.weight", (rank,)),
        _same(m + "kv_b_proj.weight", a + "kv_b_proj.weight", (nq * (dn + dv), rank)),
        _same(m + "o_proj.weight", a + "o_proj.weight", (h, nq * dv)),
    ]


def _shared_units(cfg: GPTConfig, m: str, x: str, family: str) -> list[_Unit]:
    """Shared experts: Qwen2-MoE's mlp.shared_expert.* behind mlp.shared_expert_gate;
    DeepSeek-V3's mlp.shared_experts.* (and its router's e_score_correction_bias, the
    meshtron router's expert_bias buffer)."""
    h, fs = cfg.hidden_size, cfg.moe().shared_width
    units = []
    if family == "deepseek_v3":
        units.append(_same(m + "router.expert_bias", x + "gate.e_score_correction_bias", (cfg.num_experts,)))
    if not cfg.shared_experts:
        return units
    s = x + ("shared_experts" if family == "deepseek_v3" else "shared_expert")
    units += [
        _same(m + "shared.gate", s + ".gate_proj.weight", (fs, h)),
        _same(m + "shared.up", s + ".up_proj.weight", (fs, h)),
        _same(m + "shared.down", s + ".down_proj.weight", (h, fs)),
    ]
    if cfg.shared_expert_gate:
        units.append(_same(m + "shared.output_gate", s + "_gate.weight", (1, h)))
    return units


def _expert_units(cfg: GPTConfig, m: str, L: str, moe_format: str, family: str) -> list[_Unit]:
    E, h, f = cfg.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size
    if moe_format == "fused":  # transformers 5.x: [E, 2f, h] gate rows then up rows; down [E, h, f]
        x = L + "mlp."
        gate_up, down = x + "experts.gate_up_proj", x + "experts.down_proj"

        def read_gate_or_up(read, name, box):  # meshtron [E, h, f] <- rows of gate_up [E, 2f, h]
            first = 0 if name.endswith("w_gate") else f
            rows = slice(first + box[2].start, first + box[2].stop)
            return read(gate_up, (box[0], rows, box[1])).transpose(1, 2)

        return [
            _same(m + "router.weight", x + "gate.weight", (E, h)),
            _Unit(
                (m + "experts.w_gate", m + "experts.w_up"),
                (gate_up,),
                ((E, 2 * f, h),),
                read_gate_or_up,
                lambda t: [torch.cat([t[0], t[1]], dim=2).transpose(1, 2)],
            ),
            _Unit(
                (m + "experts.w_down",),
                (down,),
                ((E, h, f),),
                lambda read, _, box: read(down, (box[0], box[2], box[1])).transpose(1, 2),
                lambda t: [t[0].transpose(1, 2)],
            ),
        ]
    # transformers 4.x / original checkpoints: one nn.Linear per expert and matrix, named
    # Mixtral's block_sparse_moe.experts.<e>.w1/w3/w2 or Qwen-MoE's mlp.experts.<e>.gate/up/down_proj.
    qwen = family != "mixtral"
    x = L + ("mlp." if qwen else "block_sparse_moe.")
    names = ("gate_proj", "up_proj", "down_proj") if qwen else ("w1", "w3", "w2")

    def stacked(mt: str, w: str, shape) -> _Unit:
        keys = tuple(f"{x}experts.{e}.{w}.weight" for e in range(E))

        def read_experts(read, _, box):  # meshtron [E, a, b] <- each expert's [b, a]
            experts = range(box[0].start, box[0].stop)
            return torch.stack([read(keys[e], (box[2], box[1])).t() for e in experts])

        return _Unit((mt,), keys, (tuple(shape),) * E, read_experts, lambda t: [w_.t() for w_ in t[0].unbind(0)])

    return [
        _same(m + "router.weight", x + "gate.weight", (E, h)),
        stacked(m + "experts.w_gate", names[0], (f, h)),
        stacked(m + "experts.w_up", names[1], (f, h)),
        stacked(m + "experts.w_down", names[2], (h, f)),
    ]


def _default_moe_format() -> str:
    try:
        import transformers
    except ImportError:
        return "fused"
    return "fused" if int(transformers.__version__.split(".")[0]) >= 5 else "per_expert"


def _chunks(model) -> list[nn.Module]:
    if isinstance(model, (list, tuple, nn.ModuleList)):
        return list(model)
    return [model]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))], dim=0)


# --------------------------------------------------------------------------------------------
# Import
# --------------------------------------------------------------------------------------------

_WPE = "transformer.wpe.weight"
_TIE_CHECK_ROWS = 4096  # rows of lm_head / embedding compared at a time (bounded memory)


def checked_units(cfg: GPTConfig, source: TensorSource) -> list[_Unit]:
    """The conversion units of `cfg` after checking `source` holds exactly their tensors with
    their shapes (read from the headers; a tied model's `lm_head.weight`, when present, must
    equal the embedding: compared in row blocks). HFConversionError naming the tensor."""
    family = hf_family(cfg)
    keys = set(source.keys())
    per_expert = any(".block_sparse_moe." in k or ".mlp.experts.0.gate_proj." in k for k in keys)
    moe_format = "per_expert" if per_expert else "fused"
    depths = held_mtp_depths(cfg, keys)
    units = _units(cfg, moe_format, depths)
    expected = {key: shape for u in units for key, shape in zip(u.hf, u.hf_shapes)}
    optional = {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)} if cfg.tie_embeddings else {}
    missing = [k for k in expected if k not in keys]
    if missing:
        raise HFConversionError(
            f"missing tensor {missing[0]} in the Hugging Face state dict"
            + (f" (and {len(missing) - 1} more: {missing[1:4]})" if len(missing) > 1 else "")
        )
    unexpected = sorted(
        k for k in keys if k not in expected and k not in optional and not _skipped_mtp_key(k, cfg, family, depths)
    )
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise HFConversionError(
            f"unexpected tensor {unexpected[0]} in the Hugging Face state dict for a {family} model{more}"
        )
    for key, shape in {**expected, **{k: s for k, s in optional.items() if k in keys}}.items():
        got = source.shape(key)
        # Imported at a seq_len below n_positions, GPT-2 keeps the first positions (export can
        # put the rest back: training/hf_cli.py export --base).
        longer_positions = key == _WPE and len(got) == 2 and got[0] > shape[0] and got[1] == shape[1]
        if got != tuple(shape) and not longer_positions:
            raise HFConversionError(f"tensor {key} has shape {got}, expected {tuple(shape)} for this config")
    if cfg.tie_embeddings and "lm_head.weight" in keys:
        _check_tied(source, units[0].hf[0], cfg.vocab_size)
    return units


def held_mtp_depths(cfg: GPTConfig, keys) -> int:
    """How many of `cfg`'s multi-token-prediction depths the HF tensor names `keys` hold
    (DeepSeek-V3's model.layers.<num_layers + k - 1>.eh_proj.weight for k = 1, 2, ...): these
    are imported, the model's further depths start fresh."""
    if hf_family(cfg) != "deepseek_v3":
        return 0
    keys = set(keys)
    held = 0
    while held < cfg.mtp_depths and f"model.layers.{cfg.num_layers + held}.eh_proj.weight" in keys:
        held += 1
    return held


def _skipped_mtp_key(key: str, cfg: GPTConfig, family: str, imported: int) -> bool:
    """A DeepSeek-V3 checkpoint's multi-token-prediction tensor that is not read: a depth past
    the `imported` ones (model.layers.<i>.* for i >= num_layers + imported; transformers does
    not build any), or an imported depth's copy of the embedding or of the head."""
    if family != "deepseek_v3" or not key.startswith("model.layers."):
        return False
    index, rest = key.split(".")[2], key.split(".", 3)[-1]
    if not index.isdigit() or int(index) < cfg.num_layers:
        return False
    return int(index) >= cfg.num_layers + imported or rest in _MTP_COPIES


def _check_tied(source: TensorSource, embed_key: str, rows: int) -> None:
    for start in range(0, rows, _TIE_CHECK_ROWS):
        block = (slice(start, min(start + _TIE_CHECK_ROWS, rows)),)
        if not torch.equal(source.read("lm_head.weight", block), source.read(embed_key, block)):
            raise HFConversionError(
                f"tensor lm_head.weight differs from {embed_key} but the config ties the "
                f"embeddings (tie_word_embeddings=True)"
            )


def _read_local(unit: _Unit, source: TensorSource, name: str, box: Index, valid_rows: int | None) -> torch.Tensor:
    """The block `box` of meshtron tensor `name`; rows at or past `valid_rows` (vocabulary
    padding) are zeros and are not read."""
    if valid_rows is None or box[0].stop <= valid_rows:
        return unit.read_mt(source.read, name, box)
    rows = box[0].stop - box[0].start
    kept = slice(box[0].start, max(box[0].start, valid_rows))
    if kept.stop == kept.start:
        return torch.zeros((rows,) + tuple(s.stop - s.start for s in box[1:]))
    return _pad_rows(unit.read_mt(source.read, name, (kept,) + box[1:]), rows)


@torch.no_grad()
def load_hf_weights(model, source: TensorSource, targets: dict | None = None) -> None:
    """Read this rank's shards of a Hugging Face model from `source` (a `DictSource` or a
    folder's `SafetensorsSource`) into a meshtron model built for any layout: every
    parameter's block of the full tensor (tp / ep / etp splits) is read as slices of the HF
    tensors it comes from, nothing else; vocabulary tensors are zero-padded. No communication.

    `model` is one `GPT` chunk or this rank's list of pipeline chunks. `targets` maps a
    parameter to the tensor its values go into (default: the parameter itself; the fp32 main
    weights of 16-bit resident parameters). Tied embedding copies on the last pipeline stage
    get the embedding too. Multi-token-prediction depths (DeepSeek-V3) are read from the
    checkpoint's layers past the model's when it holds them (`held_mtp_depths`); further depths
    keep their initial values. Router expert biases (aux-loss-free balancing state, not in HF) are
    reset to zero unless the checkpoint holds them (DeepSeek-V3's e_score_correction_bias).
    Missing, unexpected or wrongly shaped tensors raise HFConversionError naming the tensor (on
    every rank, before anything is copied)."""
    chunks = _chunks(model)
    cfg: GPTConfig = chunks[0].cfg
    mesh: Mesh = chunks[0].mesh
    by_mt = {name: u for u in checked_units(cfg, source) for name in u.mt}
    fresh = tuple(f"mtp.{j}." for j in range(held_mtp_depths(cfg, source.keys()), cfg.mtp_depths))
    unmatched = [
        name
        for chunk in chunks
        for name, _ in chunk.named_parameters()
        if name not in by_mt and not name.startswith(fresh)
    ]
    if unmatched:
        raise HFConversionError(f"meshtron parameter {unmatched[0]} has no Hugging Face counterpart")
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if name not in by_mt:
                continue  # a multi-token-prediction depth the checkpoint does not hold: as initialized
            offsets = local_offsets(param, mesh)
            box = tuple(slice(o, o + n) for o, n in zip(offsets, param.shape))
            local = _read_local(by_mt[name], source, name, box, cfg.vocab_size if name in _VOCAB_PARAMS else None)
            (param if targets is None else targets[param]).copy_(local)
        for name, buf in chunk.named_buffers():
            if name in by_mt:  # DeepSeek-V3's e_score_correction_bias: replicated, read whole
                buf.copy_(by_mt[name].read_mt(source.read, name, tuple(slice(0, n) for n in buf.shape)))
            elif name.endswith("router.expert_bias"):
                buf.zero_()


def load_hf_state_dict(model, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a FULL Hugging Face state dict into a meshtron model built for any layout: every
    rank passes the same dict and keeps its own shards (`load_hf_weights`). A GPT-2 position
    table longer than `cfg.seq_len` gives its first `seq_len` rows."""
    chunks = _chunks(model)
    load_hf_weights(chunks, DictSource(state_dict, hf_family(chunks[0].cfg)))


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def _gather_full(param: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    return full_tensor(param, param.shards, mesh)


@torch.no_grad()
def export_hf_state_dict(model, mesh: Mesh, moe_format: str | None = None) -> dict[str, torch.Tensor] | None:
    """The full Hugging Face state dict of a meshtron model in any layout, on global rank 0
    (None on every other rank). Collective: every rank of the world must call it.

    Shards are all-gathered over tp / ep / etp, pipeline stages are gathered to rank 0 over
    the pp group; vocabulary padding is dropped and every layout conversion inverted. Tied
    models also get `lm_head.weight` (a copy of the embedding), as HF's `state_dict()` has.
    `moe_format`: "fused" (transformers 5.x Mixtral) or "per_expert" (4.x / original
    checkpoints); default: the installed transformers' format. Tensors are on the CPU.
    """
    chunks = _chunks(model)
    cfg: GPTConfig = chunks[0].cfg
    units = _export_units(cfg, moe_format)  # validates the family before any collective
    local: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            full = _gather_full(param, mesh)  # collective over the shard groups: every rank
            if getattr(param, "tied_embedding_copy", False):
                continue
            if name in _VOCAB_PARAMS:
                full = full[: cfg.vocab_size]
            local[name] = full.cpu().clone()
        exported_buffers = {n for u in units for n in u.mt}
        for name, buf in chunk.named_buffers():
            if name in exported_buffers:  # replicated buffers HF keeps (DeepSeek-V3's expert bias)
                local[name] = buf.detach().cpu().clone()

    full_params = local
    if mesh.pp_size > 1:
        if mesh.dp_rank != 0 or mesh.tp_rank != 0:
            return None
        gathered = gather_object(local, mesh.pp, dst=0)
        if mesh.rank != 0:
            return None
        full_params = {k: v for part in gathered for k, v in part.items()}
    elif mesh.rank != 0:
        return None

    out: dict[str, torch.Tensor] = {}
    for unit in units:
        absent = [n for n in unit.mt if n not in full_params]
        if absent:
            raise HFConversionError(f"meshtron parameter {absent[0]} was not found in the model chunks")
        for key, tensor in zip(unit.hf, unit.to_hf([full_params[n] for n in unit.mt])):
            out[key] = tensor.contiguous().clone()
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out[units[0].hf[0]].clone()
    return out


def _export_units(cfg: GPTConfig, moe_format: str | None) -> list[_Unit]:
    """`_units` for writing: each multi-token-prediction layer also gets DeepSeek-V3's copies
    of the embedding and the head (`_MTP_COPIES`), as its released checkpoint has them."""
    moe_format = moe_format or _default_moe_format()
    if moe_format not in ("fused", "per_expert"):
        raise ValueError(f"moe_format={moe_format!r} must be 'fused' or 'per_expert'")
    h, V = cfg.hidden_size, cfg.vocab_size
    head = "embed.weight" if cfg.tie_embeddings else "head.weight"
    copies = [
        _same(mt, f"model.layers.{cfg.num_layers + k - 1}.{key}", (V, h))
        for k in range(1, cfg.mtp_depths + 1)
        for mt, key in zip(("embed.weight", head), _MTP_COPIES, strict=True)
    ]
    return _units(cfg, moe_format) + copies


def hf_tensor_shapes(cfg: GPTConfig, moe_format: str | None = None) -> dict[str, tuple[int, ...]]:
    """{HF key: shape} of every tensor of `cfg`'s Hugging Face checkpoint, in writing order (a
    tied model's `lm_head.weight` is left out, as `save_pretrained` does)."""
    return {k: tuple(s) for u in _export_units(cfg, moe_format) for k, s in zip(u.hf, u.hf_shapes)}


def stream_hf_tensors(
    cfg: GPTConfig, read_full: Callable[[tuple[str, ...]], list[torch.Tensor]], moe_format: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF key, tensor) of every tensor of `hf_tensor_shapes(cfg)`, in its order, converted one
    unit at a time: `read_full(names)` returns the full meshtron tensors of those parameter
    names (vocabulary unpadded), so at most one unit's tensors are held at once."""
    for unit in _export_units(cfg, moe_format):
        yield from zip(unit.hf, unit.to_hf(read_full(unit.mt)))
