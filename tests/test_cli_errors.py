"""Bad user input to the CLIs ends in one line and exit status 2, naming the file or key, and
leaves what was saved before intact (issue 14): train.py's data checks and meshtron-hf."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.test_prepare import _hand_made_dir as _prepared_dir  # one writer of hand-made prepared dirs

REPO = pathlib.Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "index_vocab, max_id, expected",
    [
        # ids inside the padded vocabulary (300 pads to 384): before, every step was skipped as non-finite
        (300, 383, r"data: .*/data/tokens\.bin holds token ids up to 383 but index\.json says vocab_size=300"),
        # ids beyond it: before, a bare IndexError
        (
            2000,
            1999,
            r"data: the byte tokenizer of data\.prepared=.* has vocab_size 2000 but model\.vocab_size=300; "
            r"set model\.vocab_size=2000 or larger \(or re-run meshtron-prepare with a smaller --vocab-size\): "
            r".*/data/tokens\.bin holds token ids up to 1999",
        ),
    ],
)
def test_train_refuses_token_ids_outside_the_model_vocabulary(tmp_path, index_vocab, max_id, expected):
    import re

    data = _prepared_dir(tmp_path / "data", [1, 2, 3, max_id] * 200, index_vocab)
    done = _run(
        "train.py",
        f"data.prepared={data}",
        "model.vocab_size=300",
        "trainer.max_steps=2",
        "trainer.progress=false",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("meshtron: configuration error: "), done.stderr[-3000:]
    assert re.search(expected, lines[0]), lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ---------------------------------------------------------------- meshtron-hf import / export


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    """save_pretrained folders of a tiny GPT-2 (16 positions) and a tiny Llama (32 positions)."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hf")
    ids = dict(vocab_size=300, bos_token_id=0, eos_token_id=0)
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16, **ids)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2")
    llama = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
        **ids,
    )
    transformers.LlamaForCausalLM(llama).save_pretrained(root / "llama")
    return root


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _break(case: str, folders: pathlib.Path, tmp: pathlib.Path) -> tuple[list[str], str]:
    """(meshtron-hf import arguments, expected error regex) of one class of bad input."""
    folder = _copy(folders / ("llama" if case == "llama_seq_len" else "gpt2"), tmp / "src")
    weights, config = folder / "model.safetensors", folder / "config.json"
    args = ["import", "--src", str(folder), "--out", str(tmp / "ckpt")]
    if case == "config_not_json":
        config.write_text('{"model_type": "gpt2", ')
        return args, r"src/config\.json is not valid JSON"
    if case == "config_not_object":
        config.write_text("[1, 2]")
        return args, r"src/config\.json must hold a JSON object, got list"
    if case in ("model_type_bert", "model_type_unknown"):
        value = "bert" if case == "model_type_bert" else "no-such-model"
        config.write_text(json.dumps(dict(json.loads(config.read_text()), model_type=value)))
        return args, rf"src/config\.json: config field model_type='{value}' is not supported; use one of"
    if case == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        return args, r"src/model\.safetensors is not a readable safetensors file .*truncated or corrupt"
    if case == "garbage_weights":
        weights.write_bytes(b"not a safetensors file")
        return args, r"src/model\.safetensors is not a readable safetensors file"
    if case == "bad_index":
        weights.rename(folder / "model-00001-of-00001.safetensors")
        (folder / "model.safetensors.index.json").write_text("{")
        return args, r"src/model\.safetensors\.index\.json is not valid JSON"
    if case == "index_names_missing_shard":
        weights.rename(folder / "model-00001-of-00001.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
        return args, r"src/gone\.safetensors not found \(listed in .*model\.safetensors\.index\.json\)"
    if case == "no_weights":
        weights.unlink()
        return args, r"no \*\.safetensors weights in .*src"
    if case == "gpt2_seq_len":
        return [*args, "--seq-len", "64"], (
            r"src/config\.json: seq_len=64 \(meshtron-hf import --seq-len\) must be "
            r"between 1 and the gpt2 config field n_positions=16"
        )
    if case == "llama_seq_len":
        return [*args, "--seq-len", "33"], r"seq_len=33 .* llama config field max_position_embeddings=32"
    if case == "seq_len_zero":
        return [*args, "--seq-len", "0"], r"seq_len=0 .* must be between 1 and"
    if case == "heads_do_not_divide":
        config.write_text(json.dumps(dict(json.loads(config.read_text()), n_head=3)))
        return args, (
            r"src/config\.json: gpt2 config describes a model meshtron cannot build: "
            r"model\.hidden_size=32 is not divisible by model\.num_heads=3"
        )
    if case == "out_is_a_file":
        (tmp / "ckpt").write_text("keep me")
        return args, r"could not save the checkpoint .*ckpt"
    raise AssertionError(case)


HF_CASES = [
    "config_not_json",
    "config_not_object",
    "model_type_bert",
    "model_type_unknown",
    "truncated_weights",
    "garbage_weights",
    "bad_index",
    "index_names_missing_shard",
    "no_weights",
    "gpt2_seq_len",
    "llama_seq_len",
    "seq_len_zero",
    "heads_do_not_divide",
    "out_is_a_file",
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", HF_CASES)
def test_hf_import_bad_input_is_one_line_and_exit_2(hf_folders, tmp_path, case, capfd):
    import re

    from meshtron.training.hf_cli import main

    args, expected = _break(case, hf_folders, tmp_path)
    assert main(args) == 2
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("meshtron:")]
    assert len(lines) == 1 and lines[0].startswith("meshtron: import failed: "), err
    assert re.search(expected, lines[0]), lines[0]
    assert "Traceback" not in err
    if case == "out_is_a_file":
        assert (tmp_path / "ckpt").read_text() == "keep me"
    else:
        assert not (tmp_path / "ckpt").exists()


@pytest.mark.timeout(180)
def test_hf_cli_failures_leave_earlier_output_intact(hf_folders, tmp_path):
    """A failed import into an existing checkpoint dir, or export onto a file, changes nothing (subprocesses)."""
    ckpt = tmp_path / "ckpt"
    done = _run("-m", "meshtron.training.hf_cli", "import", "--src", str(hf_folders / "gpt2"), "--out", str(ckpt))
    assert done.returncode == 0, done.stderr[-3000:]
    saved = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    args, expected = _break("truncated_weights", hf_folders, tmp_path)
    done = _run("-m", "meshtron.training.hf_cli", *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith("meshtron: import failed: ")
    (tmp_path / "hf_out").write_text("a file")
    done = _run("-m", "meshtron.training.hf_cli", "export", "--src", str(ckpt), "--out", str(tmp_path / "hf_out"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith("meshtron: export failed: ")
    assert "cannot write the Hugging Face folder " + str(tmp_path / "hf_out") in done.stderr
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == saved
    assert (tmp_path / "hf_out").read_text() == "a file"
