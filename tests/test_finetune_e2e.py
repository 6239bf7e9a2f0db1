"""Fine-tuning a Hugging Face GPT-2 end to end: a random tiny GPT-2 with its own tokenizer
(trained here with `tokenizers`, saved as a GPT2TokenizerFast) is imported at a seq_len
below n_positions, text is prepared with `--tokenizer hf:FOLDER`, train.py fine-tunes it for
a few steps from `checkpoint.init_from`, `meshtron-hf export --base` writes it back and
transformers loads and generates from the exported folder."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from tests.test_train_cli import metrics, run

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
safetensors_torch = pytest.importorskip("safetensors.torch")

N_POSITIONS, SEQ_LEN = 64, 32
TEXTS = [
    "the quick brown fox jumps over the lazy dog number {i}. hello world, meshtron trains models. " * 40,
    "a second kind of document {i}: tokens, positions and <|endoftext|> spelled as text. " * 40,
]


def _tokenizer(folder):
    """A byte-level BPE of ~300 ids whose only special token <|endoftext|> is bos, eos and unk."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([t.format(i=i) for t in TEXTS for i in range(3)], trainer=trainer)
    fast = transformers.GPT2TokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """Every stage once: {hf, tok, data, info, ckpt, run, exported} paths and objects."""
    from meshtron.textdata import prepare
    from meshtron.training import hf_cli

    root = tmp_path_factory.mktemp("finetune")
    hf = root / "hf"
    tok = _tokenizer(hf)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=len(tok),
        n_positions=N_POSITIONS,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(hf)
    raw = json.loads((hf / "config.json").read_text())
    raw["meshtron_test_field"] = {"kept": [1, 2]}  # a field no transformers class knows
    (hf / "config.json").write_text(json.dumps(raw))

    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(3):
        for j, text in enumerate(TEXTS):
            (corpus / f"doc{i}{j}.txt").write_text(text.format(i=i))
    assert prepare.main(["--src", str(corpus), "--out", str(root / "data"), "--tokenizer", f"hf:{hf}"]) == 0
    assert hf_cli.main(["import", "--src", str(hf), "--out", str(root / "ckpt"), "--seq-len", str(SEQ_LEN)]) == 0

    ckpt, run_dir = root / "ckpt", root / "run"
    done = run(
        [
            sys.executable,
            "train.py",
            "--config-dir",
            str(ckpt),
            "+model=imported",
            f"checkpoint.init_from={ckpt / 'step_00000000'}",
            f"data.prepared={root / 'data'}",
            "trainer.max_steps=3",
            "trainer.global_batch_size=4",
            "trainer.eval_every=0",
            "trainer.progress=false",
            f"checkpoint.dir={run_dir / 'ckpt'}",
            f"hydra.run.dir={run_dir}",
        ],
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "initial weights from" in done.stdout
    exported = root / "exported"
    assert hf_cli.main(["export", "--src", str(run_dir / "ckpt"), "--out", str(exported), "--base", str(ckpt)]) == 0
    return dict(hf=hf, tok=tok, data=root / "data", ckpt=ckpt, run=run_dir, exported=exported, corpus=corpus)


def test_prepare_uses_the_models_tokenizer(finetuned):
    from meshtron.textdata.prepare import load_prepared, load_tokenizer

    tokens, info = load_prepared(finetuned["data"], verify_checksum=True)
    tok = finetuned["tok"]
    eos = tok.eos_token_id
    assert (info["tokenizer"], info["vocab_size"], info["eos_id"], info["eod_ids"]) == ("hf", len(tok), eos, [eos])
    assert info["tokenizer_source"] == str(finetuned["hf"].resolve())
    assert info["eod_token"] == "<|endoftext|>"
    # Each document is its text's ids (no special tokens; a spelled-out <|endoftext|> stays text), then eos.
    plain = tokenizers.Tokenizer.from_file(str(finetuned["hf"] / "tokenizer.json"))
    plain.encode_special_tokens = True
    want = []
    for doc in info["documents"]:
        text = open(doc["path"], encoding="utf-8").read()
        ids = plain.encode(text, add_special_tokens=False).ids
        assert len(ids) == doc["length"]
        want += ids + [eos]
    assert np.array_equal(np.asarray(tokens, dtype=np.int64), np.asarray(want))
    assert want.count(eos) == len(info["documents"])  # the spelled-out token did not become eos
    assert load_tokenizer(finetuned["data"]).eod_id == eos


def test_export_keeps_the_original_config_and_writes_generation_config(finetuned):
    original = json.loads((finetuned["hf"] / "config.json").read_text())
    exported = json.loads((finetuned["exported"] / "config.json").read_text())
    assert exported == original  # same shape, and every other field (dtype, ids, unknown ones) kept
    assert exported["n_positions"] == N_POSITIONS and exported["meshtron_test_field"] == {"kept": [1, 2]}
    eos = finetuned["tok"].eos_token_id
    gen = json.loads((finetuned["exported"] / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (eos, eos, eos)
    loaded = transformers.GenerationConfig.from_pretrained(finetuned["exported"], local_files_only=True)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (eos, eos, eos)
    assert (finetuned["exported"] / "tokenizer.json").is_file()


def _trained_model(finetuned):
    from meshtron.models.config import GPTConfig
    from meshtron.models.gpt import GPT
    from meshtron.mpu.mesh import single_process_mesh
    from meshtron.training.checkpoint import load_checkpoint
    from meshtron.training.checkpoint_files import read_meta, resolve_resume

    path = resolve_resume(None, str(finetuned["run"] / "ckpt"))
    assert path.name == "step_00000003"
    saved = read_meta(path)["model"]
    cfg = GPTConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    mesh = single_process_mesh()
    model = GPT(cfg, mesh)
    load_checkpoint(path, [model], None, mesh, weights_only=True)
    return model.eval(), mesh


def test_exported_weights_are_the_trained_ones(finetuned):
    from meshtron.models.hf import export_hf_state_dict

    model, mesh = _trained_model(finetuned)
    assert model.cfg.seq_len == SEQ_LEN
    trained = export_hf_state_dict(model, mesh)
    got = safetensors_torch.load_file(str(finetuned["exported"] / "model.safetensors"))
    original = safetensors_torch.load_file(str(finetuned["hf"] / "model.safetensors"))
    assert got.keys() == original.keys()
    wpe = "transformer.wpe.weight"
    for key, tensor in got.items():
        if key == wpe:
            assert tensor.shape == (N_POSITIONS, 32)
            assert torch.equal(tensor[:SEQ_LEN], trained[key])  # the positions trained
            assert torch.equal(tensor[SEQ_LEN:], original[key][SEQ_LEN:])  # the untouched rest
            assert not torch.equal(tensor[:SEQ_LEN], original[key][:SEQ_LEN])
        else:
            assert torch.equal(tensor, trained[key]), key
    assert not torch.equal(got["transformer.h.0.mlp.c_fc.weight"], original["transformer.h.0.mlp.c_fc.weight"])
    losses = [m["loss"] for m in metrics(finetuned["run"])]
    assert len(losses) >= 2 and losses[-1] < losses[0]


@torch.no_grad()
def test_transformers_generates_from_the_export(finetuned):
    model, _ = _trained_model(finetuned)
    hf = transformers.AutoModelForCausalLM.from_pretrained(finetuned["exported"], local_files_only=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(finetuned["exported"], local_files_only=True)
    ids = tok("the quick brown fox", return_tensors="pt").input_ids
    # The exported model computes what meshtron's trained model computes (within seq_len).
    window = torch.tensor([tok("hello world, meshtron trains models. " * 4).input_ids[:SEQ_LEN]])
    want = model.full_logits(model(window))
    assert (hf(window).logits - want).abs().max().item() <= 1e-4  # fp32, |logits| ~ 1 (as tests/test_hf.py)
    out = hf.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4) and torch.equal(out[0, : ids.shape[1]], ids[0])
    assert int(out.max()) < len(tok)
    assert isinstance(tok.decode(out[0]), str)


def test_export_with_a_wrong_base_fails_clearly(finetuned, tmp_path, capsys):
    from meshtron.training import hf_cli

    src = str(finetuned["run"] / "ckpt")
    assert hf_cli.main(["export", "--src", src, "--out", str(tmp_path / "a"), "--base", str(tmp_path)]) == 2
    assert "no config.json in it or in its hf/ folder" in capsys.readouterr().err
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert hf_cli.main(["export", "--src", src, "--out", str(tmp_path / "b"), "--base", str(other)]) == 2
    assert "model_type='llama' but this model exports as 'gpt2'" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
