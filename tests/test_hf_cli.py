"""`meshtron-hf import/export` and `checkpoint.init_from` end to end: a random tiny
transformers Llama is imported, trained from under tp=1 and tp=2 (the first step's loss is
HF's loss on the same batch), and exported back bit for bit."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.test_train_cli import TORCHRUN, metrics, run

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    folder = tmp_path_factory.mktemp("hf")
    model.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def imported(hf_model, tmp_path_factory):
    _, folder = hf_model
    out = tmp_path_factory.mktemp("ckpt")
    done = run(
        [sys.executable, "-m", "meshtron.training.hf_cli", "import", "--src", str(folder), "--out", str(out)],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"--config-dir {out} +model=imported checkpoint.init_from={out / 'step_00000000'}" in done.stdout
    return out


@pytest.mark.timeout(200)
def test_export_gives_back_the_same_weights(hf_model, imported, tmp_path):
    model, _ = hf_model
    done = run(
        [sys.executable, "-m", "meshtron.training.hf_cli", "export", "--src", str(imported), "--out", str(tmp_path)],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    want = model.state_dict()
    got = back.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _first_batch_loss(model, seq_len: int, batch: int) -> float:
    from meshtron.textdata.data import build_dataset
    from meshtron.training.config import DataConfig

    dataset = build_dataset(DataConfig(max_bytes=2_000_000), seq_len, 1234, model.config.vocab_size)
    inputs, targets = dataset.local_batch_at(0, batch, 0, 1)
    with torch.no_grad():
        logits = model(inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_init_from_imported_weights_under_tp1_and_tp2(hf_model, imported, tmp_path):
    model, _ = hf_model
    want = _first_batch_loss(model, 32, 4)
    common = [
        "--config-dir",
        str(imported),
        "+model=imported",
        f"checkpoint.init_from={imported / 'step_00000000'}",
        "trainer.max_steps=1",
        "trainer.global_batch_size=4",
        "trainer.eval_every=0",
        "trainer.progress=false",
        "data.max_bytes=2000000",
    ]
    single = run([sys.executable, "train.py", *common, f"hydra.run.dir={tmp_path / 'tp1'}"], timeout=150)
    assert single.returncode == 0, single.stderr[-3000:]
    assert "initial weights from" in single.stdout
    tp2 = run(
        [*TORCHRUN, "--nproc_per_node=2", "train.py", *common, "parallel.tp=2", f"hydra.run.dir={tmp_path / 'tp2'}"],
        timeout=200,
        threads=1,
    )
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    for run_dir in ("tp1", "tp2"):
        loss = metrics(tmp_path / run_dir)[0]["loss"]
        assert abs(loss - want) <= 1e-5 * want, (run_dir, loss, want)


@pytest.mark.timeout(60)
def test_import_of_a_folder_without_config_fails_clearly(tmp_path):
    done = run(
        [
            sys.executable,
            "-m",
            "meshtron.training.hf_cli",
            "import",
            "--src",
            str(tmp_path),
            "--out",
            str(tmp_path / "o"),
        ],
        timeout=60,
    )
    assert done.returncode == 2
    assert "config.json not found" in done.stderr


HF_RUN = [
    "trainer.max_steps=1",
    "trainer.global_batch_size=4",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "data.max_bytes=2000000",
    "model.seq_len=32",
]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_init_from_a_hugging_face_folder_at_tp2_and_resume_auto(hf_model, tmp_path):
    """`checkpoint.init_from=hf:FOLDER` with no model config: the folder's config.json is the
    model, each of 2 tp ranks reads its shards, and the first step's loss is transformers'.
    With checkpoint.resume=auto the next launch resumes the run's own checkpoint instead."""
    model, folder = hf_model
    want = _first_batch_loss(model, 32, 4)
    common = [
        *HF_RUN,
        f"checkpoint.init_from=hf:{folder}",
        "checkpoint.resume=auto",
        f"checkpoint.dir={tmp_path / 'ck'}",
    ]
    tp2 = run(
        [*TORCHRUN, "--nproc_per_node=2", "train.py", *common, "parallel.tp=2", f"hydra.run.dir={tmp_path / 'tp2'}"],
        timeout=200,
        threads=1,
    )
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    assert f"initial weights from the Hugging Face folder {folder}" in tp2.stdout
    loss = metrics(tmp_path / "tp2")[0]["loss"]
    assert abs(loss - want) <= 1e-5 * want, (loss, want)
    again = run(
        [sys.executable, "train.py", *common, "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'again'}"], timeout=150
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "at step 1" in again.stdout, again.stdout[-2000:]
    assert "Hugging Face folder" not in again.stdout
    out = tmp_path / "exported"
    done = run(
        [sys.executable, "-m", "meshtron.training.hf_cli", "export", "--src", str(tmp_path / "ck"), "--out", str(out)]
        + ["--base", str(folder)],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    back = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert back.state_dict().keys() == model.state_dict().keys()
    moved = [k for k, v in model.state_dict().items() if not torch.equal(back.state_dict()[k], v)]
    assert moved, "two training steps changed no weight of the exported model"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "override,message",
    [
        ("model.num_layers=3", "model.num_layers=3 contradicts checkpoint.init_from=hf:"),
        ("model.seq_len=64", "model.seq_len=64 must lie between 1 and the model's maximum positions (32)"),
        ("checkpoint.resume=/nowhere", "checkpoint.resume=/nowhere and checkpoint.init_from are exclusive"),
    ],
)
def test_init_from_a_hugging_face_folder_refuses_contradictions(hf_model, tmp_path, override, message):
    _, folder = hf_model
    done = run(
        [sys.executable, "train.py", f"checkpoint.init_from=hf:{folder}", override, f"hydra.run.dir={tmp_path}"],
        timeout=100,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr[-2000:]


@pytest.mark.timeout(120)
def test_init_from_a_hugging_face_folder_missing_a_tensor_fails_before_training(hf_model, tmp_path):
    import safetensors.torch

    model, folder = hf_model
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    tensors = {k: v for k, v in model.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    safetensors.torch.save_file(tensors, str(broken / "model.safetensors"))
    done = run(
        [sys.executable, "train.py", f"checkpoint.init_from=hf:{broken}", *HF_RUN, f"hydra.run.dir={tmp_path / 'r'}"],
        timeout=100,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in lines[0] and f"hf:{broken}" in lines[0]


@pytest.mark.timeout(200)
def test_a_bf16_model_exports_bf16_in_indexed_shards(hf_model, tmp_path):
    """import -> export of a bf16 folder gives back its tensors bitwise, in bf16, written one
    conversion unit at a time into safetensors files of at most --max-shard-size with an index."""
    import copy
    import json

    model, _ = hf_model
    original = tmp_path / "bf16"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(original)
    hf_cli = [sys.executable, "-m", "meshtron.training.hf_cli"]
    done = run([*hf_cli, "import", "--src", str(original), "--out", str(tmp_path / "ck")], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "exported"
    done = run(
        [*hf_cli, "export", "--src", str(tmp_path / "ck"), "--out", str(out), "--base", str(tmp_path / "ck")]
        + ["--max-shard-size", "40KB"],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and all((out / f).stat().st_size < 40_000 + 4096 for f in files)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    back = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.bfloat16)
    want = transformers.AutoModelForCausalLM.from_pretrained(original, local_files_only=True, dtype=torch.bfloat16)
    assert back.state_dict().keys() == want.state_dict().keys()
    for key, value in want.state_dict().items():
        assert back.state_dict()[key].dtype == torch.bfloat16 and torch.equal(back.state_dict()[key], value), key
    fp32 = tmp_path / "fp32"
    done = run(
        [*hf_cli, "export", "--src", str(tmp_path / "ck"), "--out", str(fp32), "--dtype", "float32"], timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (fp32 / "model.safetensors").is_file() and not (fp32 / "model.safetensors.index.json").exists()
