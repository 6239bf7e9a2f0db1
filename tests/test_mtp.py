"""Multi-token prediction (models/mtp.py) in one process: the loss equals DeepSeek-V3's formula
written out by hand from the module's own weights (each depth on the truncated sequence, so the
shift and the ignored tail are checked independently of the implementation), the objective's
gradient reaches the shared embedding / head and every MTP weight, packed documents mask the
labels that cross a boundary, the cp cut shifts the full sequence before splitting it, and the
planner counts the MTP parameters and FLOPs exactly."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from meshtron.models.config import ExecutionConfig, GPTConfig
from meshtron.models.gpt import init_model_chunks
from meshtron.models.mtp import depth_target_counts, depth_targets, shifted_ids
from meshtron.moe.layer import MoELayer
from meshtron.mpu.context_parallel import shard_sequence
from meshtron.mpu.cross_entropy import IGNORE_INDEX
from meshtron.mpu.mesh import Mesh, ParallelConfig, single_process_mesh
from meshtron.planning.flops import model_flops_per_token, param_count, params_per_rank
from meshtron.training.packing import local_microbatches
from meshtron.training.step import MTPObjective

os.environ.setdefault("OMP_NUM_THREADS", "1")
SEQ, VOCAB, DEPTHS = 12, 100, 2


def mtp_config(tie: bool = False, moe: bool = False, arch: str = "llama", **extra) -> GPTConfig:
    kw = dict(
        arch=arch,
        num_layers=2,
        hidden_size=32,
        num_heads=4,
        ffn_hidden_size=40,
        vocab_size=VOCAB,
        seq_len=SEQ,
        tie_embeddings=tie,
        mtp_depths=DEPTHS,
        mtp_loss_weight=0.3,
    )
    if moe:
        kw.update(num_experts=4, top_k=2, moe_ffn_hidden_size=16, moe_first_dense=1)
    kw.update(extra)
    return GPTConfig(**kw)


def tokens(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def build(cfg: GPTConfig, fused: bool = False):
    (model,) = init_model_chunks(cfg, single_process_mesh(), 7, execution=ExecutionConfig(fused_lm_loss=fused))
    model.train()
    return model


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def hand_depth_losses(model, tok: torch.Tensor) -> list[torch.Tensor]:
    """Mean CE of each depth by DeepSeek-V3's equations, from the module's own weights: depth k
    runs on the first s - k positions only (the ones with a label t_{i+k+1}), embeds
    t_{i+k} = tok[:, i + k] and predicts tok[:, i + k + 1]; RMSNorm, the projection and the
    head are written out, the block is the depth's `Block` module."""
    cfg = model.cfg
    s = tok.shape[1] - 1
    inputs = tok[:, :s]
    hidden = model.embed(inputs.t())
    rope = model._rope(s, hidden.device)
    for layer in model.layers.values():
        hidden = layer(hidden, rope)
    hidden = _rms(hidden, model.final_norm.weight, cfg.norm_eps)  # h^0: after the final norm
    head = model.lm_head_weight[:VOCAB]
    losses = []
    for k, depth in enumerate(model.mtp, 1):
        length = s - k
        hidden = hidden[:length]  # causal: the first `length` positions never see the rest
        emb = model.embed.weight[tok[:, k : k + length]].transpose(0, 1)  # [length, b, h]: t_{i+k}
        x = torch.cat((_rms(emb, depth.enorm.weight, cfg.norm_eps), _rms(hidden, depth.hnorm.weight, cfg.norm_eps)), -1)
        hidden = depth.block(x @ depth.proj.t(), model._rope(length, x.device))
        logits = _rms(hidden, depth.norm.weight, cfg.norm_eps) @ head.t()  # [length, b, V]
        labels = tok[:, k + 1 : k + 1 + length].t()  # t_{i+k+1}
        losses.append(F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)))
    return losses


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_mtp_loss_equals_the_formula(tie: bool, fused: bool) -> None:
    model = build(mtp_config(tie=tie), fused)
    tok = tokens()
    inputs, targets = tok[:, :-1], tok[:, 1:]
    main = model(inputs, targets=targets)
    sums = model.mtp_loss_sums()
    assert sums.shape == (DEPTHS,)
    with torch.no_grad():
        want = torch.stack(hand_depth_losses(model, tok))
    counts = torch.tensor([2.0 * (SEQ - k) for k in range(1, DEPTHS + 1)])
    got = sums.detach() / counts
    assert torch.allclose(got, want, rtol=1e-6, atol=0), (got, want)
    # the main loss is untouched by the depths
    assert torch.allclose(
        main.detach() / (2 * SEQ),
        F.cross_entropy(model.full_logits(model(inputs)).reshape(-1, VOCAB), targets.reshape(-1)),
        rtol=1e-6,
    )
    # the step's objective: counts from the microbatches, weight / D
    mbs = local_microbatches([(inputs, targets)], single_process_mesh())
    objective = MTPObjective(model.cfg, mbs, single_process_mesh(), torch.device("cpu"))
    term = objective.add(sums)
    assert torch.allclose(term.detach(), 0.3 / DEPTHS * want.sum(), rtol=1e-6)


@pytest.mark.parametrize("tie", [False, True])
def test_gradient_reaches_the_shared_weights_and_every_depth(tie: bool) -> None:
    """The objective's gradient equals the hand formula's (main mean CE + 0.3/D sum of depth
    means) for every parameter, and is non-zero on the embedding, the head and every MTP weight."""
    cfg = mtp_config(tie=tie)
    model = build(cfg)
    tok = tokens(seed=1)
    inputs, targets = tok[:, :-1], tok[:, 1:]
    mbs = local_microbatches([(inputs, targets)], single_process_mesh())
    objective = MTPObjective(cfg, mbs, single_process_mesh(), torch.device("cpu"))
    loss = model(inputs, targets=targets) / (2 * SEQ) + objective.add(model.mtp_loss_sums())
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    main = F.cross_entropy(model.full_logits(model(inputs)).reshape(-1, VOCAB), targets.reshape(-1))
    (main + 0.3 / DEPTHS * sum(hand_depth_losses(model, tok))).backward()
    for name, p in model.named_parameters():
        err = (got[name] - p.grad).norm() / p.grad.norm()
        assert err < 1e-5, (name, err)
    names = [n for n, _ in model.named_parameters() if n.startswith("mtp.")]
    assert any(n.startswith("mtp.1.block.") for n in names) and "mtp.0.proj" in names
    for name in names + ["embed.weight"] + ([] if tie else ["head.weight"]):
        assert got[name].abs().sum() > 0, name
    # the embedding gets gradient from the MTP depths alone too (the shifted tokens' rows)
    model.zero_grad()
    model(inputs, targets=targets)
    model.mtp_loss_sums().sum().backward()
    assert model.embed.weight.grad.abs().sum() > 0 and model.mtp[1].proj.grad.abs().sum() > 0


def test_shifts_and_document_masks() -> None:
    ids = torch.arange(6).unsqueeze(0)
    assert shifted_ids(ids, 2).tolist() == [[2, 3, 4, 5, 0, 0]]
    targets = torch.arange(1, 7).unsqueeze(0)  # t_{i+1}
    assert depth_targets(targets, 1).tolist() == [[2, 3, 4, 5, 6, IGNORE_INDEX]]
    doc = torch.tensor([[0, 0, 0, 1, 1, 1]])  # position 2 ends document 0 (its eos)
    # depth 1: position i counts when i + 1 is in i's document
    assert depth_targets(targets, 1, doc).tolist() == [[2, 3, IGNORE_INDEX, 5, 6, IGNORE_INDEX]]
    assert depth_targets(targets, 2, doc).tolist() == [[3, IGNORE_INDEX, IGNORE_INDEX, 6, IGNORE_INDEX, IGNORE_INDEX]]
    masked = targets.clone()
    masked[0, 3] = IGNORE_INDEX  # an ignored main target stays ignored at the depth that reads it
    assert depth_targets(masked, 1).tolist() == [[2, 3, IGNORE_INDEX, 5, 6, IGNORE_INDEX]]


def test_cp_cut_shifts_the_full_sequence_and_keeps_label_counts() -> None:
    """Under cp=2 every rank's depth inputs and labels are the load-balanced shard of those of
    the full sequence (the shift reaches into the other rank's chunks), and the label counts
    over the cp ranks sum to the full sequence's (packed documents included)."""
    tok = torch.tensor([[5, 6, 9, 7, 8, 5, 6, 9, 7, 8, 5, 6, 9, 10, 11, 12, 13]])
    inputs, targets = tok[:, :-1], tok[:, 1:]
    par = ParallelConfig(cp=2).resolved(2)
    full = local_microbatches([(inputs, targets)], single_process_mesh(), eos_id=7, mtp_depths=DEPTHS)
    counts = torch.zeros(DEPTHS)
    for rank in range(2):
        mesh = Mesh(par, 2, rank, create_groups=False)
        (mb,) = local_microbatches([(inputs, targets)], mesh, eos_id=7, mtp_depths=DEPTHS)
        for key in ("mtp_inputs", "mtp_labels"):
            assert torch.equal(mb.forward_kwargs[key], shard_sequence(full[0].forward_kwargs[key], 2, 2, rank))
        if rank == 0:  # position 3 (chunk 0) embeds at depth 2 the token at 5 (chunk 1, rank 1's)
            assert mb.forward_kwargs["mtp_inputs"][1, 0, 3] == inputs[0, 5]
        counts += depth_target_counts([mb], DEPTHS)
    doc_ids = full[0].forward_kwargs["doc_ids"]
    want = [float((depth_targets(targets, k, doc_ids) != IGNORE_INDEX).sum()) for k in range(1, DEPTHS + 1)]
    assert counts.tolist() == depth_target_counts(full, DEPTHS).tolist() == want


def test_packed_documents_equal_the_hand_formula_per_document() -> None:
    """With eos_id, a depth's loss over a packed row equals the hand formula on each document
    alone (attention, positions and labels all restart at the boundary)."""
    cfg = mtp_config()
    model = build(cfg)
    eos = 0
    first = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    second = torch.randint(1, VOCAB, (1, SEQ + 1 - 6), generator=torch.Generator().manual_seed(4))
    first[0, -1] = eos
    tok = torch.cat((first, second), 1)
    (mb,) = local_microbatches([(tok[:, :-1], tok[:, 1:])], single_process_mesh(), eos_id=eos)
    model(mb.inputs, **mb.forward_kwargs, targets=mb.targets)
    sums = model.mtp_loss_sums().detach()
    with torch.no_grad():
        # document 0 is tok[:6] (ends with eos); its main targets include the next document's
        # first token (as the main loss does), so its chain runs over tok[:7]
        a = [loss * (6 - k) for k, loss in enumerate(hand_depth_losses(model, tok[:, :7]), 1)]
        b = [loss * (SEQ - 6 - k) for k, loss in enumerate(hand_depth_losses(model, tok[:, 6:]), 1)]
    want = torch.stack([x + y for x, y in zip(a, b)])
    assert torch.allclose(sums, want, rtol=1e-5), (sums, want)


def test_moe_main_model_and_moe_depths() -> None:
    """A MoE model's depths are MoE blocks (index num_layers + k - 1), their routers' aux terms
    join aux_loss in training, and the formula holds."""
    cfg = mtp_config(moe=True)
    model = build(cfg)
    assert all(isinstance(depth.block.mlp, MoELayer) for depth in model.mtp)
    tok = tokens(seed=2)
    model(tok[:, :-1], targets=tok[:, 1:])
    with_mtp = model.aux_loss()
    routers = [b.mlp.last_router for b in model._blocks() if isinstance(b.mlp, MoELayer)]
    assert len(routers) == 1 + DEPTHS
    assert torch.allclose(with_mtp, sum(r.aux_loss + r.z_loss for r in routers))
    with torch.no_grad():
        want = torch.stack(hand_depth_losses(model, tok))
    got = model.mtp_loss_sums().detach() / torch.tensor([2.0 * (SEQ - k) for k in (1, 2)])
    assert torch.allclose(got, want, rtol=1e-6)
    model.eval()
    model(tok[:, :-1], targets=tok[:, 1:])
    assert model.mtp_loss_sums() is None  # evaluation: the main LM loss only


@pytest.mark.parametrize(
    "cfg",
    [mtp_config(), mtp_config(tie=True), mtp_config(moe=True), mtp_config(arch="gpt2", tie=True)],
    ids=["llama", "tied", "moe", "gpt2"],
)
def test_planner_counts_the_depths(cfg: GPTConfig) -> None:
    model = build(cfg)
    assert param_count(cfg)["total"] == sum(p.numel() for p in model.parameters())
    assert params_per_rank(cfg) == param_count(cfg)["total"]
    base = dataclasses.replace(cfg, mtp_depths=0)
    h, v = cfg.hidden_size, cfg.padded_vocab_size(1)
    mtp_numel = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    assert param_count(cfg)["total"] - param_count(base)["total"] == mtp_numel
    # FLOPs: per depth its block, the projection and one more head (x3 for the backward)
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp.") and ".block." in n)
    if not cfg.is_moe:
        norms = sum(
            p.numel() for n, p in model.named_parameters() if n.startswith("mtp.") and "norm" in n and ".block." in n
        )
        biases = sum(
            p.numel()
            for n, p in model.named_parameters()
            if n.startswith("mtp.") and n.endswith(".bias") and ".block." in n and "norm" not in n
        )
        core = 2 * 2 * cfg.seq_len * cfg.num_heads * cfg.head_dim  # scores and x V
        want = 3 * DEPTHS * (2 * 2 * h * h + 2 * h * v + core) + 3 * 2 * (blocks - norms - biases)
        assert model_flops_per_token(cfg) - model_flops_per_token(base) == want
    else:
        assert model_flops_per_token(cfg) > model_flops_per_token(base)


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="mtp_depths"):
        mtp_config(mtp_depths=-1)
    with pytest.raises(ValueError, match="mtp_loss_weight"):
        mtp_config(mtp_loss_weight=-0.1)


@pytest.mark.timeout(120)
def test_train_py_logs_the_mtp_loss(tmp_path):
    """python train.py with model.mtp_depths=2 trains and writes mtp_loss to metrics.jsonl."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    args = ["+model=llama3_tiny", "+model.mtp_depths=2", "trainer.max_steps=2", "trainer.log_every=1"]
    args += ["trainer.eval_every=0", "trainer.progress=false", "trainer.device=cpu", f"hydra.run.dir={tmp_path}"]
    done = subprocess.run(
        [sys.executable, "train.py", *args], cwd=root, capture_output=True, text=True, timeout=100,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["mtp_loss"] > 0 for r in records)


@pytest.mark.parametrize("tp", [1, 2])
def test_planned_activations_count_the_mtp_depths(tp):
    """The planner traces the post chunk with its MTP depths (fused LM loss): planned saved bytes
    are within 0.5% of a real forward's (measured: 1 KiB over, of 423-662 KiB, with 2 depths:
    the trace's token-id stand-in), where leaving the depths out missed a third of them."""
    from meshtron.models.gpt import init_model_chunks
    from meshtron.mpu.mesh import ParallelConfig
    from meshtron.planning.activations import saved_activation_bytes
    from meshtron.planning.plan import chunk_activations
    from tests.test_mla import virtual_mesh

    cfg = GPTConfig(
        arch="llama", num_layers=2, hidden_size=32, num_heads=4, vocab_size=200, seq_len=16, tie_embeddings=False,
        mtp_depths=2,
    )  # fmt: skip
    tokens = torch.randint(0, 200, (2, 17), generator=torch.Generator().manual_seed(0))
    for rank in range(tp):
        (model,) = init_model_chunks(cfg, virtual_mesh(ParallelConfig(tp=tp), tp, rank), 0)
        model.train()
        measured = saved_activation_bytes(model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        planned = chunk_activations(cfg, 2, layers=range(2), pre_process=True, post_process=True, tp=tp, tp_rank=rank)
        without = chunk_activations(
            dataclasses.replace(cfg, mtp_depths=0), 2, layers=range(2), pre_process=True, post_process=True, tp=tp,
            tp_rank=rank,
        )  # fmt: skip
        assert abs(planned.saved - measured) <= 0.005 * measured, (planned.saved, measured)
        assert measured - without.saved > 0.25 * measured
