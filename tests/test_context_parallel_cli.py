"""Context parallelism and packed documents through train.py: bad layouts exit 2 with one line
before any process group; a torchrun cp=2 run (ring, with document masks) logs the losses of
one process; training/packing.py cuts microbatches as the model expects."""

from __future__ import annotations

import sys

import pytest
import torch

from meshtron.mpu.context_parallel import shard_sequence
from meshtron.mpu.mesh import Mesh, ParallelConfig
from meshtron.training.packing import local_microbatch
from tests.test_train_cli import TORCHRUN, assert_one_config_error_line, metrics, run


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["parallel.cp=2", "parallel.tp=2"], 6, "world size 6 is not divisible by tp*cp*pp=4 (tp=2, cp=2, pp=1)"),
        (["parallel.cp=3"], 3, "parallel.cp=3 needs model.seq_len=128 divisible by 2*cp = 6"),
        (
            ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true", "model.seq_len=132"],
            4,
            "parallel.cp=2 needs model.seq_len=132 divisible by 2*cp*tp = 8",
        ),
        (
            ["parallel.cp=8", "parallel.cp_comm=a2a"],
            8,
            "parallel.cp_comm=a2a needs the attention heads per tensor-parallel rank (num_heads/tp = 4) divisible by cp=8",
        ),
        (["parallel.cp=2", "model.dropout=0.1"], 2, "context-parallel attention has no attention dropout"),
        (["parallel.cp_comm=ulysses"], 1, "parallel.cp_comm='ulysses' must be one of ring, a2a"),
        (["data.reset_at_eos=true"], 1, "data.reset_at_eos=true needs one end-of-document token id"),
        (["data.reset_at_eos=true", "data.eos_id=300"], 1, "data.eos_id=300 is not a token id of model.vocab_size=256"),
    ],
)
def test_bad_context_parallel_config_fails_before_any_process_group(tmp_path, overrides, world, message):
    assert_one_config_error_line(tmp_path, overrides, world, message)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torchrun_cp2_with_documents_matches_single_process(tmp_path):
    """2 ranks at cp=2 (ring attention, llama: RoPE and GQA, packed documents split at '\\n')
    log the single-process losses, evaluation included."""
    common = [
        "trainer.max_steps=3",
        "trainer.log_every=1",
        "trainer.progress=false",
        "model.num_layers=2",
        "model.arch=llama",
        "model.num_kv_heads=2",
        "model.seq_len=64",
        "trainer.global_batch_size=4",
        "data.reset_at_eos=true",
        "data.eos_id=10",
        "trainer.eval_every=3",
    ]
    serial_dir, parallel_dir = tmp_path / "serial", tmp_path / "parallel"
    out = run([sys.executable, "train.py", *common, f"hydra.run.dir={serial_dir}"], timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    out = run(
        [*TORCHRUN, "--nproc_per_node=2", "train.py", *common, "parallel.cp=2", f"hydra.run.dir={parallel_dir}"],
        timeout=250,
        threads=1,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got, want = metrics(parallel_dir), metrics(serial_dir)
    assert [r["step"] for r in got] == [1, 2, 3]
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * abs(w["loss"]), (g, w)
        assert abs(g["grad_norm"] - w["grad_norm"]) <= 1e-4 * abs(w["grad_norm"]), (g, w)
    assert abs(got[-1]["val_loss"] - want[-1]["val_loss"]) <= 1e-5 * want[-1]["val_loss"]


def test_local_microbatch_cuts_the_load_balanced_shard_and_restarts_positions():
    """cp rank r gets chunks r and 2*cp-1-r of inputs, targets and positions, and the whole
    sequence's document ids; ids and positions are computed over the whole sequence first (a
    document crossing chunks keeps counting)."""
    inputs = torch.tensor([[5, 5, 7, 5, 5, 5, 5, 7, 5, 5, 5, 5, 5, 5, 5, 5]])
    targets = inputs + 100
    par = ParallelConfig(cp=2).resolved(2)
    want_doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2]])
    want_pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7]])
    for rank in range(2):
        mesh = Mesh(par, 2, rank, create_groups=False)
        mb = local_microbatch(inputs, targets, mesh, eos_id=7)
        chunks = [(0, 12), (4, 8)][rank]  # chunk i of 4 holds positions [4i, 4i+4)
        cols = [c for first in chunks for c in range(first, first + 4)]
        assert mb.inputs.tolist() == inputs[:, cols].tolist()
        assert mb.targets.tolist() == targets[:, cols].tolist()
        assert mb.forward_kwargs["doc_ids"].tolist() == want_doc.tolist()
        assert mb.forward_kwargs["positions"].tolist() == want_pos[:, cols].tolist()
        assert torch.equal(mb.inputs, shard_sequence(inputs, 1, 2, rank))
    plain = local_microbatch(inputs, targets, Mesh(par, 2, 1, create_groups=False))
    assert plain.forward_kwargs == {} and plain.inputs.tolist() == inputs[:, [4, 5, 6, 7, 8, 9, 10, 11]].tolist()
