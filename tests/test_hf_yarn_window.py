"""Issue 39's last two Hugging Face features, single process, fp32: YaRN RoPE scaling (rope_type
yarn: Llama / Qwen2 / Qwen3 / Mistral) and Mistral's sliding window smaller than the sequence.
Tiny random transformers models load into meshtron with transformers' logits (max abs error
<= 1e-5; measured <= 2.4e-7), configs round-trip import -> export -> import, the window composes
with packed documents (transformers run on each document alone is the reference, and the
attention core equals an explicit-mask softmax), and what meshtron does not run with a window
(trainer.attention_backend=varlen) is refused in one line naming
model.sliding_window."""

from __future__ import annotations

import pytest
import torch

from meshtron.errors import ConfigError
from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.gpt import GPT
from meshtron.models.rope import inverse_frequencies, rope_attention_factor, rope_tables
from meshtron.mpu.attention_blocks import document_ids
from meshtron.mpu.document_attention import (
    attention_backend_checks,
    dense_document_attention,
    document_attention,
    pick_backend,
)
from meshtron.mpu.mesh import single_process_mesh

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from meshtron.models import hf as mhf  # noqa: E402
from tests.distributed import hf_cases as hc  # noqa: E402
from tests.test_hf_families import ATOL, _ids, _logits  # noqa: E402

WINDOW = 5  # of hc.SEQ = 16 tokens

# YaRN within the tiny context (head 16 wide, theta 100, original context 32 of 128 positions):
# with beta_fast 8 / beta_slow 0.5 the 8 frequencies fall in all three bands (kept, ramped,
# divided by factor). Llama: truncated bounds, the default attention factor; Qwen2: untruncated
# bounds and mscale / mscale_all_dim (the attention factor 1.0476 from their ratio).
YARN = {"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 32}
YARN_CASES = {
    "llama": {**YARN, "beta_fast": 8, "beta_slow": 0.5},
    "qwen2": {**YARN, "beta_fast": 8, "beta_slow": 0.5, "mscale": 1.0, "mscale_all_dim": 0.8, "truncate": False},
    "qwen3": {**YARN, "beta_fast": 16, "beta_slow": 0.5, "attention_factor": 1.25},
    "mistral": {**YARN, "beta_fast": 8, "beta_slow": 0.5},
}
WINDOW_KW = {
    "mistral": dict(sliding_window=WINDOW),
    "mixtral": dict(sliding_window=WINDOW),
    "qwen2": dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=0),
}


def _imported(family: str, **kw):
    hf = hc.hf_model(family, **kw)
    cfg = mhf.config_from_hf(hf.config)
    model = GPT(cfg, single_process_mesh()).eval()
    mhf.load_hf_state_dict(model, hf.state_dict())
    return hf, model


def _max_error(hf, model, ids) -> float:
    with torch.no_grad():
        return (_logits(model, ids) - hf(ids).logits).abs().max().item()


# ------------------------------------------------------------------------------- YaRN


@pytest.mark.parametrize("family", list(YARN_CASES))
def test_yarn_logits_match_transformers_and_round_trip(family):
    params = YARN_CASES[family]
    hf, model = _imported(family, max_position_embeddings=128, rope_parameters=dict(params))
    cfg = model.cfg
    assert cfg.rope_scaling == {k: v for k, v in params.items() if k != "rope_theta"}
    err = _max_error(hf, model, _ids())
    assert err <= ATOL, (family, err)
    exported = mhf.hf_config_from_gpt(cfg)
    assert exported.rope_parameters == hf.config.rope_parameters
    assert mhf.config_from_hf(exported) == cfg


@pytest.mark.parametrize("family", list(YARN_CASES))
def test_yarn_frequencies_are_transformers_bitwise_in_every_band(family):
    """The inverse frequencies and the cos/sin factor are transformers' own (bitwise), and the
    case exercises all three bands: kept, ramped, divided by factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hc.hf_config(family, max_position_embeddings=128, rope_parameters=dict(YARN_CASES[family]))
    cfg = mhf.config_from_hf(hf)
    want, attention = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    got = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(got, want) and rope_attention_factor(cfg.rope_scaling) == attention
    ratio = got / inverse_frequencies(cfg.head_dim, cfg.rope_theta)
    factor = cfg.rope_scaling["factor"]
    kept, divided = ratio == 1, (ratio - 1 / factor).abs() < 1e-7
    assert kept.any() and divided.any() and (~kept & ~divided).any(), ratio
    cos, sin = rope_tables(8, cfg.head_dim, cfg.rope_theta, "cpu", cfg.rope_scaling)
    assert torch.allclose(cos[0], torch.full_like(cos[0], attention)) and attention != 1.0


def test_yarn_from_the_4x_rope_scaling_spelling_and_defaults():
    """A 4.x config.json (rope_theta + rope_scaling with `type`) imports the same scaling;
    without original_max_position_embeddings transformers' max_position_embeddings stands in,
    and a null factor is max_position_embeddings / original_max_position_embeddings."""
    new = hc.hf_config("llama", max_position_embeddings=128, rope_parameters=dict(YARN_CASES["llama"])).to_dict()
    scaling = {k: v for k, v in YARN_CASES["llama"].items() if k not in ("rope_theta", "rope_type")}
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=100.0, rope_scaling={"type": "yarn", **scaling})
    cfg = mhf.config_from_hf(old)
    assert cfg == mhf.config_from_hf(new)
    merged = mhf.hf_config_dict_over(cfg, old)
    assert merged["rope_scaling"] == {"rope_type": "yarn", **scaling} and merged["rope_theta"] == 100.0
    bare = {**new, "rope_parameters": {"rope_type": "yarn", "rope_theta": 100.0, "factor": None}}
    assert mhf.config_from_hf(bare).rope_scaling == {
        "rope_type": "yarn",
        "factor": 1.0,
        "original_max_position_embeddings": 128,
    }


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"beta_fast": 1, "beta_slow": 2}, "beta_fast=1 must be >= beta_slow=2"),
        ({"truncate": "yes"}, "truncate must be true or false"),
        ({"attention_factor": 0}, "attention_factor must be a finite number > 0"),
        ({"low_freq_factor": 1.0}, "unknown low_freq_factor"),
    ],
)
def test_yarn_scaling_is_validated(extra, match):
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, **extra}
    with pytest.raises(ValueError, match=match):
        GPTConfig(arch="llama", rope_scaling=scaling)


# ------------------------------------------------------------------------------- sliding window


@pytest.mark.parametrize("family", list(WINDOW_KW))
def test_sliding_window_logits_match_transformers_and_round_trip(family):
    hf, model = _imported(family, **WINDOW_KW[family])
    cfg = model.cfg
    assert cfg.sliding_window == WINDOW and cfg.attention_window == WINDOW and cfg.seq_len == 32
    err = _max_error(hf, model, _ids())
    assert err <= ATOL, (family, err)
    with torch.no_grad():  # the window matters: full causal attention differs
        model.layers["0"].attn.window = model.layers["1"].attn.window = None
        assert (_logits(model, _ids()) - hf(_ids()).logits).abs().max().item() > 1e-3
    assert mhf.config_from_hf(mhf.hf_config_from_gpt(cfg)) == cfg


def test_sliding_window_composes_with_packed_documents():
    """A packed row (documents ended by eos, data.reset_at_eos) gives, document by document,
    the logits transformers computes for each document alone: the window counts tokens
    within the document, and no key of another document is seen."""
    hf, model = _imported("mistral", **WINDOW_KW["mistral"])
    eos = hf.config.eos_token_id
    ids = _ids(3).clamp(min=2)
    ids[0, [6, 13]] = eos  # documents of 7, 7, 2 tokens in row 0; 11 and 5 in row 1
    ids[1, 10] = eos
    docs, positions = document_ids(ids, eos)
    with torch.no_grad():
        got = model.full_logits(model(ids, positions=positions, doc_ids=docs))
        for row in range(ids.shape[0]):
            for doc in docs[row].unique():
                cols = (docs[row] == doc).nonzero().flatten()
                want = hf(ids[row : row + 1, cols]).logits[0]
                err = (got[row, cols] - want).abs().max().item()
                assert err <= ATOL, (row, doc.item(), err)


def _explicit(q, k, v, docs, window):
    """softmax(q k^T / sqrt(d)) v under the mask written entry by entry: j <= i, i - j < window,
    same document (grouped-query heads repeated)."""
    b, h, s, d = q.shape
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    allowed = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for r in range(b):
        for i in range(s):
            for j in range(s):
                allowed[r, 0, i, j] = j <= i and i - j < window and (docs is None or docs[r, i] == docs[r, j])
    scores = (q @ k.transpose(-1, -2) / d**0.5).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_window_attention_core_equals_the_explicit_mask(packed, backend):
    """dense (boolean mask) and flex (block mask; the CPU runs it forward only) against the
    entry-by-entry mask, with and without documents, grouped-query heads."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=gen)
    k, v = torch.randn(2, 2, 16, 8, generator=gen), torch.randn(2, 2, 16, 8, generator=gen)
    docs = torch.tensor([[0] * 7 + [1] * 7 + [2] * 2, [0] * 11 + [1] * 5]) if packed else None
    with torch.no_grad():
        got = document_attention(q, k, v, docs, backend=backend, window=WINDOW)
    want = _explicit(q, k, v, docs, WINDOW)
    assert (got - want).abs().max().item() <= 1e-6
    if not packed:
        full = dense_document_attention(q, k, v, None)  # no window: plain causal
        torch.testing.assert_close(full, torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), rtol=0, atol=1e-6)  # fmt: skip


def test_window_at_least_the_sequence_is_plain_causal():
    """A sequence no longer than the window runs the plain causal path (no mask)."""
    hf, model = _imported("mistral", **WINDOW_KW["mistral"])
    ids = _ids()[:, :WINDOW]
    assert _max_error(hf, model, ids) <= ATOL


def test_window_refusals_are_one_line_naming_the_field():
    """The varlen backend has no window: refused at config time (attention_backend_checks),
    when the model is built, and in the backend pick; context parallelism takes it (the
    all-to-all through these backends, the ring in its score tiles)."""
    common = dict(device_type=None, precision="bf16", attention_dropout=0.0)
    checks = attention_backend_checks("varlen", cp=1, cp_comm="a2a", sliding_window=WINDOW, **common)
    failed = [msg for ok, msg in checks if not ok]
    assert failed and failed[0].startswith(f"model.sliding_window={WINDOW}") and "\n" not in failed[0]
    for backend, cp, comm in (("flex", 1, "a2a"), ("auto", 2, "a2a"), ("auto", 2, "ring"), ("dense", 2, "ring")):
        assert all(
            ok for ok, _ in attention_backend_checks(backend, cp=cp, cp_comm=comm, sliding_window=WINDOW, **common)
        )
    cfg = mhf.config_from_hf(hc.hf_config("mistral", **WINDOW_KW["mistral"]))
    with pytest.raises(ConfigError, match=rf"^model\.sliding_window={WINDOW} .*varlen") as err:
        GPT(cfg, single_process_mesh(), execution=ExecutionConfig(attention_backend="varlen"))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=rf"'varlen' has no sliding window \(model\.sliding_window={WINDOW}\)"):
        pick_backend("varlen", "cuda", torch.bfloat16, 0.0, True, WINDOW)
    assert pick_backend("auto", "cuda", torch.bfloat16, 0.0, True, WINDOW) == "flex"
    assert pick_backend("auto", "cpu", torch.float32, 0.0, True, WINDOW) == "dense"


def test_qwen2_window_on_some_layers_only_is_refused_in_one_line():
    """Qwen2 slides the layers from max_window_layers on; meshtron's window is every layer's,
    so a window shorter than the sequence on some layers only is refused naming the field
    (a window >= the sequence is full causal attention either way and imports)."""
    kw = dict(sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1)
    with pytest.raises(mhf.HFConversionError, match="max_window_layers=1") as err:
        mhf.config_from_hf(hc.hf_config("qwen2", **kw))
    assert "\n" not in str(err.value)
    assert mhf.config_from_hf(hc.hf_config("qwen2", **kw), seq_len=WINDOW).sliding_window == WINDOW
    assert mhf.config_from_hf(hc.hf_config("qwen2", **{**kw, "max_window_layers": 2})).sliding_window is None
