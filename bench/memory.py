"""Peak memory of one training step per rank, measured beside the dry-run planner's estimate, as JSON.

    python bench/memory.py --model gpt2 --layers 4 --hidden 256 --seq 256 --micro-batch 2
    python bench/memory.py --model llama --kv-heads 2 --recompute selective
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/memory.py --tp 2 --sp
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 bench/memory.py --pp 2 --microbatches 4
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 bench/memory.py --model llama --hidden 64 \
        --layers 2 --vocab 256 --seq 4096 --micro-batch 1 --dropout 0 --cp 4   # context parallelism
    python bench/memory.py --device cuda --zero 1          # CUDA: torch.cuda.max_memory_allocated

Builds the model, gradient reducer and optimizer exactly as a training run does (the Engine,
training/engine.py, from the `optim.zero`/`optim.param_dtype` the options name), runs one
warm-up step (AdamW creates its state lazily in the first step), then measures the second
step (`Engine.step`: `train_step`, or `pipeline_train_step` at pp > 1), on every rank, and prints one JSON object (global rank 0) with, per rank, the
measured and planned (`planning.plan.plan_rank`) bytes per category and the relative error
(planned - measured) / measured.

Method (fp32; the numbers are tensor bytes, not the process's RSS):
* weights, grads, optimizer: exact, from the tensors at the start of the measured step:
  unique storages of the parameters, of the gradients (`reducer` buckets / ZeRO-2 shards and
  any `p.grad` outside them) and of the AdamW state tensors (0-dim `step` counters excluded).
* total (peak): CPU: every allocation and free of the measured step recorded by
  `torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=False)`; the
  running sum of the `[memory]` events' byte deltas, in time order, gives the step's high-water
  mark above what was allocated when the step started, and peak = weights + grads +
  optimizer + that high-water mark (blocks freed during the step but allocated before it are
  not seen by the profiler: at most an over-estimate of the small leftovers of the previous
  step). CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`.
* activations: peak - (weights + grads + optimizer): the saved activations, the logits the
  step holds, the loss's buffers and backward's working set (and ZeRO-2/3's full gradient
  buckets, which exist only during forward/backward).
* activations_saved (pp = 1 only): unique storages packed by
  `torch.autograd.graph.saved_tensors_hooks` during one microbatch's forward and loss, in a
  separate pass before the warm-up step (parameters excluded): the bytes autograd keeps for
  backward, compared with the planner's `activations_per_microbatch`.

Options: --model gpt2|llama|moe --layers --hidden --heads --kv-heads --ffn --vocab --seq
--micro-batch --microbatches (per rank, per step) --tp --pp --sp --vpp --schedule --cp --cp-comm --ep --etp
--experts --top-k --zero 0|1|2|3 --recompute none|selective|full --recompute-layers --unfused-lm-loss --dropout
--device cpu|cuda --seed --threads --param-dtype fp32|bf16 (bf16: 16-bit resident weights,
dp/resident.py, built by the run's own builder under trainer.precision=bf16; "optimizer" is then
the AdamW moments and "main_params" the fp32 main weights).
"""

from __future__ import annotations

import argparse
import json
import os

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from meshtron.models.config import ExecutionConfig, GPTConfig  # noqa: E402
from meshtron.mpu.mesh import ParallelConfig, build_mesh  # noqa: E402
from meshtron.observability.memory import held_state_bytes, profiled_peak  # noqa: E402
from meshtron.planning.activations import saved_activation_bytes  # noqa: E402
from meshtron.planning.plan import plan_rank  # noqa: E402
from meshtron.training.config import OptimConfig  # noqa: E402
from meshtron.training.engine import Engine, EngineConfig  # noqa: E402
from meshtron.training.precision import Precision  # noqa: E402

CATEGORIES = ("weights", "grads", "optimizer", "main_params", "activations", "total")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("gpt2", "llama", "moe"), default="gpt2")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--ffn", type=int, default=None)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=1, help="microbatches per rank per step")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--vpp", type=int, default=1)
    p.add_argument("--schedule", default=None, help="pipeline schedule (default 1f1b; interleaved when --vpp > 1)")
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--cp-comm", choices=("ring", "a2a"), default="ring")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=1)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.add_argument("--recompute-layers", type=int, default=None)
    p.add_argument(
        "--unfused-lm-loss",
        action="store_true",
        help="whole logits, then the cross-entropy (default: head and loss fused in row chunks)",
    )
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32")
    return p.parse_args(argv)


def model_config(args: argparse.Namespace) -> GPTConfig:
    arch = "gpt2" if args.model == "gpt2" else "llama"
    kw = dict(
        arch=arch,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        ffn_hidden_size=args.ffn,
        vocab_size=args.vocab,
        seq_len=args.seq,
        dropout=args.dropout,
        tie_embeddings=arch == "gpt2",
    )
    if args.model == "moe":
        kw.update(num_experts=args.experts, top_k=args.top_k)
    return GPTConfig(**kw)


def main(argv=None) -> None:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" else torch.device("cpu")
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    if world > 1:
        from throughput import init_process_group  # bench/ is on the path when run as a script

        init_process_group(device)
    rank = dist.get_rank() if world > 1 else 0
    try:
        report = run(args, world, rank, device)
        if world > 1:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, report)
        else:
            gathered = [report]
        if rank == 0:
            summary = {
                "config": vars(args),
                "device": str(device),
                "world_size": world,
                "method": (
                    "cpu: torch.profiler [memory] events of the second step (peak above the step's start) "
                    "+ exact state tensor bytes"
                    if device.type == "cpu"
                    else "cuda: torch.cuda.max_memory_allocated of the second step"
                ),
                "ranks": gathered,
                "max_abs_rel_error_total": max(abs(r["rel_error"]["total"]) for r in gathered),
                "max_abs_rel_error_activations": max(abs(r["rel_error"]["activations"]) for r in gathered),
                "torch": torch.__version__,
            }
            print(json.dumps(summary))
    finally:
        if world > 1:
            dist.barrier()
            dist.destroy_process_group()


def run(args: argparse.Namespace, world: int, rank: int, device: torch.device) -> dict:
    from meshtron.training.packing import local_microbatch

    cfg = model_config(args)
    schedule = args.schedule or ("interleaved" if args.vpp > 1 else "1f1b")
    par = ParallelConfig(
        tp=args.tp,
        pp=args.pp,
        sp=args.sp,
        ep=args.ep,
        etp=args.etp,
        vpp=args.vpp,
        schedule=schedule,
        cp=args.cp,
        cp_comm=args.cp_comm,
    )
    mesh = build_mesh(par, cfg, device_type=device.type)
    res = mesh.par
    execution = ExecutionConfig(
        recompute=args.recompute, recompute_layers=args.recompute_layers, fused_lm_loss=not args.unfused_lm_loss
    )
    precision = Precision(args.param_dtype if args.param_dtype == "bf16" else "fp32", device.type)
    optim = OptimConfig(zero=args.zero, param_dtype=args.param_dtype, lr=1e-3, weight_decay=0.1)
    engine = Engine.build(
        EngineConfig(model=cfg, micro_batch_size=args.micro_batch, seed=args.seed, execution=execution, optim=optim),
        mesh,
        device,
        precision=precision,
    )
    chunks, reducer, optimizer = engine.chunks, engine.reducer, engine.optimizer
    micro, n_micro = args.micro_batch, args.microbatches
    global_batch = micro * n_micro * res.dp
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, cfg.vocab_size, (global_batch, cfg.seq_len + 1), generator=gen)
    mine = tokens[mesh.dp_rank * micro * n_micro : (mesh.dp_rank + 1) * micro * n_micro].to(device)
    microbatches = [
        (mine[i * micro : (i + 1) * micro, :-1], mine[i * micro : (i + 1) * micro, 1:]) for i in range(n_micro)
    ]

    def step():
        return float(engine.step(microbatches, 1e-3).loss)

    saved = None
    if res.pp == 1:  # one microbatch's saved tensors, before the warm-up (no reduction launched)
        chunks[0].train()
        reducer.zero_grad()
        with reducer.sync(False), precision.autocast():
            local = local_microbatch(*microbatches[0], mesh, mtp_depths=cfg.mtp_depths)  # this rank's cp shard
            saved = saved_activation_bytes(chunks[0], local.inputs, local.targets, **local.forward_kwargs)
    step()  # warm-up: AdamW state exists from here on
    states = held_state_bytes(chunks, reducer, optimizer)
    persistent = sum(states.values())
    above = profiled_peak(step, device)
    measured = dict(states, activations=above, total=persistent + above, activations_saved=saved)

    plan = plan_rank(
        cfg,
        res,
        world,
        rank,
        micro_batch_size=micro,
        global_batch_size=global_batch,
        precision=precision.name,
        zero=args.zero,
        param_dtype=args.param_dtype,
        device=device.type,
        execution=execution,
    )
    b = plan["memory"]["bytes"]
    planned = {
        "weights": b["weights"],
        "grads": b["grads"],
        "optimizer": b["optimizer"],
        "main_params": b["main_params"],
        "activations": b["activations"],
        "total": b["total"],
        "activations_saved": b["activations_per_microbatch"],
    }
    keys = CATEGORIES + (("activations_saved",) if saved is not None else ())
    error = {k: (planned[k] - measured[k]) / measured[k] if measured[k] else 0.0 for k in keys}
    mib = 2**20
    return {
        "rank": rank,
        "coords": plan["coords"],
        "measured_bytes": measured,
        "planned_bytes": planned,
        "measured_mib": {k: (v / mib if v is not None else None) for k, v in measured.items()},
        "planned_mib": {k: v / mib for k, v in planned.items()},
        "rel_error": error,
        "planned_peak_phase": plan["memory"]["peak_phase"],
        "planned_in_flight": plan["memory"]["microbatches_in_flight"],
    }


if __name__ == "__main__":
    main()
