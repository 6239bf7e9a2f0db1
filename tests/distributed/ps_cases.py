"""Parameter-server training (training/param_server.py) in the 4-rank world: 3 workers + 1
server, or 1 worker of tp=2 (with sp) + 2 servers.

- bsp, and ssp with staleness 0, equal all-reduce data parallelism (dp=3 over the worker
  ranks, the replicated AdamW): every step's loss and every final weight tensor to 1e-6
  relative error (tensor-level, as dense_cases measures parallel == serial, with its AdamW
  eps=1e-4 that keeps rounding noise of the zero key-bias gradient from becoming updates);
- tp=2 + sp inside the worker with two servers (each server holds half of each tp rank's
  vector; the clipping norm is summed over the servers) equals the same worker layout
  trained with the replicated AdamW, clipping active;
- an MoE worker of tp=2 with ep=2 (experts sharded) and ep=1 (experts replicated over the
  worker's edp ranks) with two servers likewise;
- with one worker slowed by a sleep, ssp (s=2) blocks the fast workers at exactly s steps
  ahead of it (answered steps of every worker recorded by the server at each of the slow
  worker's pushes), asp never blocks them;
- asp trains the tiny model to within 0.25 nats of bsp's held-out loss at equal samples
  (16 steps x global batch 12, lr 3e-3): asp <= bsp + 0.25, and both improve on the initial
  loss by > 0.5. Measured: initial 5.49, bsp 4.33, asp 3.44: asp is ahead, because AdamW is
  invariant to the 1/W gradient scale, so asp takes W=3 full-size steps per global batch.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.mesh import ParallelConfig
from meshtron.textdata.data import TokenDataset
from meshtron.training.config import RunConfig
from meshtron.training.distributed import DistEnv
from meshtron.training.optim import build_optimizer
from meshtron.training.param_server import DELAY_ENV, block_mesh, train_ps
from meshtron.training.schedule import lr_at
from meshtron.training.step import evaluate, train_step
from tests.distributed.dense_cases import ADAM_EPS, assert_close

TOL = dict(rtol=1e-6, atol=0.0)
ROOT = Path(__file__).resolve().parents[2]


def _dataset(seq_len: int) -> TokenDataset:
    """Real text (this repository's Python sources), so that training lowers the loss."""
    text = b"".join(p.read_bytes() for p in sorted((ROOT / "training").glob("*.py")))
    return TokenDataset(
        torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int64), seq_len, seed=3, val_fraction=0.05
    )


def _run(
    servers: int,
    sync: str = "bsp",
    staleness: int = 0,
    *,
    tp: int = 1,
    sp: bool = False,
    steps: int = 4,
    batch: int = 12,
    max_grad_norm: float = 1.0,
    arch: str = "gpt2",
    eps: float = 1e-8,
    experts: int = 0,
    ep: int = 1,
) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {
                "arch": arch,
                "num_layers": 2,
                "hidden_size": 32,
                "num_heads": 4,
                "vocab_size": 256,
                "seq_len": 16,
                "num_experts": experts,
            },
            "parallel": {"dp_mode": "ps", "servers": servers, "tp": tp, "sp": sp, "ep": ep},
            "trainer": {
                "max_steps": steps,
                "global_batch_size": batch,
                "log_every": 1,
                "eval_every": 0,
                "max_grad_norm": max_grad_norm,
                "progress": False,
                "seed": 7,
            },
            "optim": {"sync": sync, "staleness": staleness, "lr": 3e-3, "eps": eps},
        }
    )


def _env() -> DistEnv:
    rank, world = dist.get_rank(), dist.get_world_size()
    return DistEnv(world, rank, rank, world, torch.device("cpu"))


def _train_ps(run: RunConfig, dataset: TokenDataset) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        return train_ps(run, _env(), run_dir, dataset)


def _reference(run: RunConfig, dataset: TokenDataset, workers: int, per_worker: int) -> tuple[list, list] | None:
    """All-reduce data parallelism (dp = workers, tp inside) over the worker ranks with the
    replicated AdamW: (per-step losses, final parameters) on worker ranks, None on servers."""
    par = dataclasses.replace(run.parallel, dp_mode="allreduce", servers=0, dp=workers).resolved(workers * per_worker)
    mesh = block_mesh(par, [0], dist.get_rank())
    if mesh is None:
        return None
    t, o = run.trainer, run.optim
    chunks = init_model_chunks(run.model, mesh, t.seed, execution=run.execution("torch"))
    reducer = DataParallelGradReducer([(n, p) for n, p in chunks[0].named_parameters()], mesh)
    optimizer = build_optimizer(chunks[0], lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps)
    micro = t.global_batch_size // workers
    losses = []
    for step in range(t.max_steps):
        x, y = dataset.local_batch_at(step * t.global_batch_size, t.global_batch_size, mesh.dp_rank, workers)
        lr = lr_at(
            step,
            lr=o.lr,
            warmup_steps=run.warmup_steps,
            max_steps=t.max_steps,
            min_lr_ratio=o.min_lr_ratio,
            decay=o.decay,
        )
        out = train_step(
            chunks[0], reducer, optimizer, [(x[:micro], y[:micro])], mesh, lr=lr, max_grad_norm=t.max_grad_norm
        )
        losses.append(float(out.loss))
    reducer.remove_hooks()
    return losses, [p.detach().clone() for p in chunks[0].parameters()]


def _check_equal(got: dict, want: tuple[list, list] | None, what: str) -> None:
    if want is None:  # a server
        assert "server" in got, f"{what}: a server rank trained"
        return
    losses, params = want
    if dist.get_rank() == 0:
        logged = [record["loss"] for record in got["history"]]
        torch.testing.assert_close(
            torch.tensor(logged, dtype=torch.float64),
            torch.tensor(losses, dtype=torch.float64),
            **TOL,
            msg=lambda m: f"{what} losses {logged} vs all-reduce {losses}: {m}",
        )
    for (name, p), ref in zip(got["model"][0].named_parameters(), params):
        assert_close(f"{what} weight {name}", p.detach(), ref, rtol=1e-6)  # tensor-level relative error


def bsp_and_ssp0_equal_allreduce_dp() -> None:
    """3 workers + 1 server: bsp and ssp(s=0) give all-reduce DP's losses and weights (and each
    other's, bit for bit); so does bsp on an MoE model (4 experts, top-2: aux losses averaged
    over the workers as over dp)."""
    dataset = _dataset(16)
    want = _reference(_run(1, eps=ADAM_EPS), dataset, workers=3, per_worker=1)
    bsp = _train_ps(_run(1, "bsp", eps=ADAM_EPS), dataset)
    ssp0 = _train_ps(_run(1, "ssp", 0, eps=ADAM_EPS), dataset)
    _check_equal(bsp, want, "bsp")
    _check_equal(ssp0, want, "ssp s=0")
    if want is not None:  # ssp with s=0 is bsp bit for bit (one code path, one order of summation)
        assert [r["loss"] for r in bsp["history"]] == [r["loss"] for r in ssp0["history"]]
        for a, b in zip(bsp["model"][0].parameters(), ssp0["model"][0].parameters()):
            assert torch.equal(a, b), "ssp s=0 weights differ from bsp's"
    moe = _run(1, "bsp", eps=ADAM_EPS, experts=4)  # aux loss averaged over the workers as over dp
    _check_equal(_train_ps(moe, dataset), _reference(moe, dataset, workers=3, per_worker=1), "MoE bsp")


def tp2_sp_two_servers_equal_allreduce() -> None:
    """1 worker of tp=2 with sp (llama: RMSNorm weights replicated over tp) + 2 servers, clipping
    active (max_grad_norm 0.3): the servers' summed norm, counted-once replicated weights and the
    split of each tp rank's vector over two servers give the replicated AdamW's run."""
    dataset = _dataset(16)
    run = _run(2, "bsp", tp=2, sp=True, max_grad_norm=0.3, arch="llama", eps=ADAM_EPS)
    want = _reference(run, dataset, workers=1, per_worker=2)
    got = _train_ps(run, dataset)
    _check_equal(got, want, "tp=2 sp, 2 servers")
    if dist.get_rank() == 0:
        norms = [record["grad_norm"] for record in got["history"]]
        assert max(norms) > 0.3, f"clipping never active (grad norms {norms}): the case would not test it"


def moe_tp2_workers_with_ep_equal_allreduce() -> None:
    """1 MoE worker of tp=2 (4 experts, top-2) + 2 servers, bsp: with ep=2 (each rank holds 2
    experts) and with ep=1 (experts replicated over the worker's edp=2 ranks, counted once in the
    norm): the replicated AdamW's run of the same worker layout, clipping active."""
    dataset = _dataset(16)
    for ep in (2, 1):
        run = _run(2, "bsp", tp=2, max_grad_norm=0.3, eps=ADAM_EPS, experts=4, ep=ep)
        want = _reference(run, dataset, workers=1, per_worker=2)
        _check_equal(_train_ps(run, dataset), want, f"MoE tp=2 ep={ep}, 2 servers")


def ssp_blocks_fast_workers_at_s_asp_does_not() -> None:
    """Worker 2 sleeps 0.3 s before each step. Under ssp(s=2), whenever its push of step k
    (1 <= k <= steps - s - 2) reaches the server, workers 0 and 1 have completed exactly k + s
    steps and worker 2 k (blocked, not merely slower); under asp the fast ones are further ahead."""
    dataset = _dataset(16)
    steps, s = 8, 2
    os.environ[DELAY_ENV] = "2:0.3"
    try:
        ssp = _train_ps(_run(1, "ssp", s, steps=steps), dataset)
        asp = _train_ps(_run(1, "asp", steps=steps), dataset)
    finally:
        del os.environ[DELAY_ENV]
    if "server" not in ssp:
        return
    slow = [(step, answered) for w, step, answered in ssp["server"].trace if w == 2]
    checked = 0
    for k, answered in slow:
        if 1 <= k <= steps - s - 2:
            assert answered == (k + s, k + s, k), (
                f"ssp s={s}: at worker 2's push of step {k} the workers had "
                f"completed {answered} steps, expected ({k + s}, {k + s}, {k})"
            )
            checked += 1
    assert checked == steps - s - 2, f"checked {checked} pushes of the slow worker: {slow}"
    assert ssp["server"].stale_max == s, f"ssp staleness max {ssp['server'].stale_max} != s={s}"
    ahead = [answered[0] - k for w, k, answered in asp["server"].trace if w == 2]
    assert max(ahead) > s + 1, f"asp: the fast worker was at most {max(ahead)} steps ahead of the slow one: {ahead}"


def asp_trains_within_margin_of_bsp() -> None:
    """Held-out loss after 16 steps of global batch 12 (equal samples), worker 0's weights:
    asp at most 0.25 nats above bsp; both at least 0.5 below the initial loss."""
    dataset = _dataset(16)
    steps = 16
    results = {}
    for sync in ("bsp", "asp"):
        got = _train_ps(_run(1, sync, steps=steps), dataset)
        if "server" in got:
            continue
        model = got["model"]
        val = []
        for index in range(2):
            x, y = dataset.local_batch(index, 12, 0, 1, split="val")
            val.append((x, y))
        results[sync] = float(evaluate(model, val, _worker_mesh_of(model)))
    if not results or dist.get_rank() != 0:
        return
    initial = _initial_val_loss(dataset)
    print(f"ps held-out loss: initial {initial:.4f}, bsp {results['bsp']:.4f}, asp {results['asp']:.4f}", flush=True)
    assert results["asp"] < results["bsp"] + 0.25, f"asp {results['asp']:.4f} vs bsp {results['bsp']:.4f}"
    assert results["bsp"] < initial - 0.5 and results["asp"] < initial - 0.5, (initial, results)


def _worker_mesh_of(model):
    return model[0].mesh


def _initial_val_loss(dataset: TokenDataset) -> float:
    from meshtron.mpu.mesh import single_process_mesh

    run = _run(1)
    mesh = single_process_mesh(ParallelConfig())
    chunks = init_model_chunks(run.model, mesh, run.trainer.seed, execution=run.execution("torch"))
    val = [dataset.local_batch(index, 12, 0, 1, split="val") for index in range(2)]
    return float(evaluate(chunks, val, mesh))


def cases_for_world(world_size: int) -> list[str]:
    if world_size != 4:
        return []
    return [
        "bsp_and_ssp0_equal_allreduce_dp",
        "tp2_sp_two_servers_equal_allreduce",
        "moe_tp2_workers_with_ep_equal_allreduce",
        "ssp_blocks_fast_workers_at_s_asp_does_not",
        "asp_trains_within_margin_of_bsp",
    ]
