"""Multi-process checks of the mpu building blocks: mesh groups, autograd collectives,
vocab-parallel cross-entropy, RNG streams and bucketed gradient reduction."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.mpu.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from meshtron.mpu.mappings import (
    column_parallel_linear,
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    row_parallel_linear,
    scatter_to_region,
)
from meshtron.mpu.mesh import ParallelConfig, build_mesh
from meshtron.mpu.random import get_rng_tracker, seed_parallel_rng


def _ranks(group) -> list[int]:
    return [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def mesh_groups() -> None:
    """Groups hold exactly the ranks the layout formula says (dense tp fastest, expert etp fastest)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    layouts = [ParallelConfig(tp=2), ParallelConfig(tp=1)]
    if world >= 4:
        layouts += [ParallelConfig(tp=2, ep=2, etp=1), ParallelConfig(tp=2, ep=1, etp=2)]
    if world == 8:
        layouts += [ParallelConfig(tp=4, ep=8), ParallelConfig(tp=4, ep=2, etp=2), ParallelConfig(tp=2, pp=2, ep=2)]
    for par in layouts:
        mesh = build_mesh(par)
        p = mesh.par
        stage, rem = divmod(rank, p.dp * p.tp)
        dp_rank, tp_rank = divmod(rem, p.tp)
        want_tp = [stage * p.dp * p.tp + dp_rank * p.tp + t for t in range(p.tp)]
        want_dp = [stage * p.dp * p.tp + d * p.tp + tp_rank for d in range(p.dp)]
        want_pp = [s * p.dp * p.tp + rem for s in range(p.pp)]
        _check(_ranks(mesh.tp) == want_tp, f"{par}: tp group {_ranks(mesh.tp)} != {want_tp}")
        _check(_ranks(mesh.dp) == want_dp, f"{par}: dp group {_ranks(mesh.dp)} != {want_dp}")
        _check(_ranks(mesh.pp) == want_pp, f"{par}: pp group {_ranks(mesh.pp)} != {want_pp}")
        base = stage * p.dp * p.tp
        edp_rank, r2 = divmod(rem, p.ep * p.etp)
        ep_rank, etp_rank = divmod(r2, p.etp)
        want_ep = [base + edp_rank * p.ep * p.etp + e * p.etp + etp_rank for e in range(p.ep)]
        want_etp = [base + edp_rank * p.ep * p.etp + ep_rank * p.etp + t for t in range(p.etp)]
        want_edp = [base + d * p.ep * p.etp + ep_rank * p.etp + etp_rank for d in range(p.edp)]
        _check(_ranks(mesh.ep) == want_ep, f"{par}: ep group {_ranks(mesh.ep)} != {want_ep}")
        _check(_ranks(mesh.etp) == want_etp, f"{par}: etp group {_ranks(mesh.etp)} != {want_etp}")
        _check(_ranks(mesh.edp) == want_edp, f"{par}: edp group {_ranks(mesh.edp)} != {want_edp}")
        _check(sorted(_ranks(mesh.tp_dp)) == sorted(range(base, base + p.dp * p.tp)), f"{par}: tp_dp group")
        _check((mesh.tp_rank, mesh.dp_rank, mesh.pp_rank) == (tp_rank, dp_rank, stage), f"{par}: coordinates")


def mappings_forward_backward() -> None:
    """Each autograd collective and its conjugate backward give the closed-form values."""
    mesh = build_mesh(ParallelConfig(tp=dist.get_world_size()))
    g, n, r = mesh.tp, mesh.tp_size, mesh.tp_rank
    base = torch.arange(6.0).reshape(2, 3)

    x = (base + r).requires_grad_()
    y = reduce_from_region(x, g)
    _check(torch.equal(y, base * n + sum(range(n))), "reduce_from_region forward")
    y.backward(torch.full_like(y, float(r + 1)))
    _check(torch.equal(x.grad, torch.full_like(x, float(r + 1))), "reduce_from_region backward is identity")

    x = base.clone().requires_grad_()
    copy_to_region(x, g).backward(torch.full((2, 3), float(r + 1)))
    _check(torch.equal(x.grad, torch.full((2, 3), float(sum(range(1, n + 1))))), "copy_to_region backward all-reduces")

    full = torch.arange(4.0 * n).reshape(2, 2 * n)
    x = full.clone().requires_grad_()
    part = scatter_to_region(x, 1, g)
    _check(torch.equal(part, full.chunk(n, 1)[r]), "scatter_to_region forward")
    part.backward(torch.ones_like(part) * (r + 1))
    want = torch.cat([torch.ones(2, 2) * (k + 1) for k in range(n)], dim=1)
    _check(torch.equal(x.grad, want), "scatter_to_region backward all-gathers")

    x = full.chunk(n, 1)[r].clone().requires_grad_()
    gathered = gather_from_region(x, 1, g)
    _check(torch.equal(gathered, full), "gather_from_region forward")
    gathered.backward(full * 10)
    _check(torch.equal(x.grad, (full * 10).chunk(n, 1)[r]), "gather_from_region backward keeps own chunk")

    seq = torch.arange(2.0 * n * 3).reshape(2 * n, 1, 3)
    x = seq.chunk(n, 0)[r].clone().requires_grad_()
    out = gather_from_sequence(x, g)
    _check(torch.equal(out, seq), "gather_from_sequence forward")
    out.backward(seq * (r + 1))
    _check(
        torch.equal(x.grad, seq.chunk(n, 0)[r] * sum(range(1, n + 1))), "gather_from_sequence backward reduce-scatters"
    )

    x = (seq * (r + 1)).requires_grad_()
    out = reduce_scatter_to_sequence(x, g)
    _check(torch.equal(out, seq.chunk(n, 0)[r] * sum(range(1, n + 1))), "reduce_scatter_to_sequence forward")
    out.backward(torch.ones_like(out) * (r + 1))
    want = torch.cat([torch.ones(2, 1, 3) * (k + 1) for k in range(n)], dim=0)
    _check(torch.equal(x.grad, want), "reduce_scatter_to_sequence backward all-gathers")


def column_parallel_linear_matches_copy_and_linear() -> None:
    """The fused column-parallel linear (async input-gradient collective) gives the values and
    gradients of copy_to_region / gather_from_sequence followed by F.linear, bit for bit, with
    and without bias and sequence parallelism, and its input gradient is the sum over ranks;
    row_parallel_linear those of F.linear + reduce_from_region / reduce_scatter_to_sequence."""
    mesh = build_mesh(ParallelConfig(tp=dist.get_world_size()))
    g, n, r = mesh.tp, mesh.tp_size, mesh.tp_rank
    gen = torch.Generator().manual_seed(11)
    full_x = torch.randn(4 * n, 3, 8, generator=gen)
    weights = torch.randn(n, 6, 8, generator=gen)  # rank k holds rows weights[k]
    biases = torch.randn(n, 6, generator=gen)
    grad_y = torch.randn(n, 4 * n, 3, 6, generator=gen)  # a different output gradient per rank
    for sp in (False, True):
        for with_bias in (False, True):
            results = []
            for fused in (False, True):
                x = (full_x.chunk(n, 0)[r] if sp else full_x).clone().requires_grad_()
                w = weights[r].clone().requires_grad_()
                b = biases[r].clone().requires_grad_() if with_bias else None
                if fused:
                    y = column_parallel_linear(x, w, b, g, sequence_parallel=sp)
                else:
                    y = F.linear(gather_from_sequence(x, g) if sp else copy_to_region(x, g), w, b)
                y.backward(grad_y[r])
                results.append((y.detach(), x.grad, w.grad, None if b is None else b.grad))
            what = f"sp={sp} bias={with_bias}"
            for name, a, c in zip(("y", "x.grad", "w.grad", "b.grad"), *results):
                _check((a is None and c is None) or torch.equal(a, c), f"{what}: {name} differs from copy + linear")
            want_gx = sum(grad_y[k] @ weights[k] for k in range(n))
            if sp:
                want_gx = want_gx.chunk(n, 0)[r]
            _check(torch.allclose(results[1][1], want_gx, rtol=1e-5, atol=1e-5), f"{what}: x.grad != sum over ranks")
    # The row-parallel counterpart: linear + all-reduce (SP: reduce-scatter) without the copy.
    for sp in (False, True):
        results = []
        for fused in (False, True):
            x = torch.randn(4 * n, 3, 8, generator=torch.Generator().manual_seed(r)).requires_grad_()
            w = torch.randn(5, 8, generator=torch.Generator().manual_seed(20 + r)).requires_grad_()
            if fused:
                y = row_parallel_linear(x, w, g, sequence_parallel=sp)
            else:
                y = (reduce_scatter_to_sequence if sp else reduce_from_region)(F.linear(x, w), g)
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(30 + r)))
            results.append((y.detach(), x.grad, w.grad))
        for name, a, c in zip(("y", "x.grad", "w.grad"), *results):
            _check(torch.equal(a, c), f"row_parallel_linear sp={sp}: {name} differs from linear + reduce")
    # Under autocast it computes in 16 bits as autocast's F.linear does; gradients come back fp32.
    results = []
    for fused in (False, True):
        x = full_x.clone().requires_grad_()
        w, b = weights[r].clone().requires_grad_(), biases[r].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = column_parallel_linear(x, w, b, g) if fused else F.linear(copy_to_region(x, g), w, b)
        y.float().backward(grad_y[r])
        results.append((y.detach(), x.grad, w.grad, b.grad))
    for name, a, c in zip(("y", "x.grad", "w.grad", "b.grad"), *results):
        _check(
            a.dtype == c.dtype and torch.allclose(a, c, rtol=1e-2, atol=1e-2),
            f"bf16 autocast: {name} differs from copy + linear ({a.dtype} vs {c.dtype})",
        )


def shm_collectives_match_gloo() -> None:
    """The shared-memory all-reduce, all-gather, reduce-scatter and all-to-all (CPU ranks of
    one host) give gloo's results: several dtypes, an empty tensor, the largest tensor a slot holds, uneven
    all-to-all splits with zero-row chunks; the same bits on every rank. Larger tensors are
    not eligible, and an all-to-all too large for one rank's slot reports so on every rank."""
    import meshtron.mpu.shm_collectives as shm

    group = dist.new_group(list(range(dist.get_world_size())))
    n, r = dist.get_world_size(), dist.get_rank()
    _check(shm.eligible(group, torch.zeros(1)), "a gloo group on one host is not eligible for shared memory")
    _check(not shm.eligible(group, torch.zeros(shm.SLOT_BYTES // 4 + 1)), "a tensor larger than a slot is eligible")
    gen = torch.Generator().manual_seed(100 + r)
    for dtype, numel in (
        (torch.float32, 1000),
        (torch.float64, 7),
        (torch.int64, 5),
        (torch.float32, 0),
        (torch.float32, shm.SLOT_BYTES // 4),
        (torch.bfloat16, 513),
    ):
        x = (torch.randn(numel, generator=gen) * 100).to(dtype)
        _check(shm.eligible(group, x), f"{dtype} x{numel} not eligible")
        want = x.clone()
        dist.all_reduce(want, group=group)
        got = x.clone()
        shm.all_reduce(got, group)
        tol = dict(rtol=1e-2, atol=2.0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-4)  # sum order
        _check(torch.allclose(got.double(), want.double(), **tol), f"shm all_reduce {dtype} x{numel}")
        first = got.clone()
        dist.broadcast(first, src=0, group=group)
        _check(torch.equal(got, first), f"shm all_reduce {dtype} x{numel}: ranks disagree")
        out, ref = torch.empty(n * numel, dtype=dtype), torch.empty(n * numel, dtype=dtype)
        dist.all_gather_into_tensor(ref, x, group=group)
        shm.all_gather_into(out, x, group)
        _check(torch.equal(out, ref), f"shm all_gather {dtype} x{numel}")
        if dtype.is_floating_point and numel % n == 0:  # this rank's chunk of the sum
            scattered, ref = torch.empty(numel // n, dtype=dtype), torch.empty(numel // n, dtype=dtype)
            dist.reduce_scatter_tensor(ref, x, group=group)
            shm.reduce_scatter_into(scattered, x, group)
            _check(torch.allclose(scattered.double(), ref.double(), **tol), f"shm reduce_scatter {dtype} x{numel}")
    # uneven all-to-all: rank r sends (r + j) % 3 rows of width 4 to rank j
    send = [(r + j) % 3 for j in range(n)]
    recv = [(j + r) % 3 for j in range(n)]
    x = torch.arange(sum(send) * 4, dtype=torch.float32).reshape(-1, 4) + 1000 * r
    want = torch.empty(sum(recv), 4)
    dist.all_to_all_single(want, x, output_split_sizes=recv, input_split_sizes=send, group=group)
    got = torch.empty(sum(recv), 4)
    _check(shm.all_to_all(got, x, recv, send, group), "a small all-to-all did not fit")
    _check(torch.equal(got, want), f"shm all_to_all: {got} != {want}")
    # only the last rank's rows exceed a slot: every rank must answer False
    rows = shm.SLOT_BYTES // 4 if r == n - 1 else 1
    big = torch.zeros(rows * n, 1)
    _check(
        not shm.all_to_all(torch.empty(rows * n, 1), big, [rows] * n, [rows] * n, group),
        "an all-to-all larger than a slot was exchanged",
    )


def vocab_parallel_cross_entropy_matches_torch() -> None:
    """Loss and logit gradients over a vocab split on TP equal F.cross_entropy on full logits,
    with a padded vocabulary (real 200 of 256 columns) and ignored targets."""
    world = dist.get_world_size()
    for tp in sorted({2, world} & {2, 4, 8}):
        if world % tp:
            continue
        mesh = build_mesh(ParallelConfig(tp=tp))
        vocab, padded = 200, 256
        gen = torch.Generator().manual_seed(7)
        logits = torch.randn(3, 5, padded, generator=gen) * 3
        target = torch.randint(0, vocab, (3, 5), generator=gen)
        target[0, 0] = IGNORE_INDEX
        target[1, 2] = vocab - 1
        target[2, 4] = 0
        weights = torch.rand(3, 5, generator=gen)
        local = logits.chunk(mesh.tp_size, -1)[mesh.tp_rank].clone().requires_grad_()
        start = mesh.tp_rank * padded // mesh.tp_size
        loss = vocab_parallel_cross_entropy(local, target, vocab_start=start, vocab_size=vocab, group=mesh.tp)
        (loss * weights).sum().backward()
        ref_logits = logits[..., :vocab].clone().requires_grad_()
        ref = F.cross_entropy(
            ref_logits.reshape(-1, vocab), target.reshape(-1), reduction="none", ignore_index=IGNORE_INDEX
        ).reshape(3, 5)
        (ref * weights).sum().backward()
        _check(torch.allclose(loss, ref, rtol=1e-6, atol=1e-6), f"tp={tp}: loss {loss} != {ref}")
        full_grad = gather_from_region(local.grad, -1, mesh.tp)
        _check(torch.allclose(full_grad[..., :vocab], ref_logits.grad, rtol=1e-6, atol=1e-6), f"tp={tp}: grad")
        _check(
            torch.equal(full_grad[..., vocab:], torch.zeros_like(full_grad[..., vocab:])),
            f"tp={tp}: padded columns got gradient",
        )


def rng_streams() -> None:
    """Default-stream dropout is identical across TP ranks; the tensor-parallel stream differs."""
    mesh = build_mesh(ParallelConfig(tp=dist.get_world_size()))
    seed_parallel_rng(99, mesh.tp_rank)
    outside = F.dropout(torch.ones(64), 0.5, True)
    with get_rng_tracker().fork():
        inside = F.dropout(torch.ones(64), 0.5, True)
    after = F.dropout(torch.ones(64), 0.5, True)
    outs = [torch.empty(64) for _ in range(mesh.tp_size)]
    for tensor, label, same in ((outside, "outside", True), (inside, "inside", False), (after, "after fork", True)):
        dist.all_gather(outs, tensor, group=mesh.tp)
        identical = all(torch.equal(o, outs[0]) for o in outs)
        _check(identical == same, f"dropout {label} TP region: identical across ranks = {identical}, want {same}")
    seed_parallel_rng(99, mesh.tp_rank)
    _check(torch.equal(F.dropout(torch.ones(64), 0.5, True), outside), "reseeding reproduces the default stream")


def _linear_stack(widths: list[int], seed: int = 0) -> torch.nn.Sequential:
    """Linear layers of these widths, tagged as replicated dense parameters (no TP shard, no SP)."""
    torch.manual_seed(seed)
    layers = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    for p in layers.parameters():
        p.tp_shard_dim, p.sequence_parallel = None, False
    return layers


def grad_reducer_overlaps_and_sums() -> None:
    """Buckets launch during backward (before finish) on the last microbatch only, and the
    result is the sum over dp of the accumulated microbatch gradients."""
    mesh = build_mesh(ParallelConfig(tp=1))
    r, n = mesh.dp_rank, mesh.dp_size
    layers = _linear_stack([8] * 5)
    # One weight (8x8 fp32 = 256 B) fills a bucket; biases (no weight decay) share their own.
    reducer = DataParallelGradReducer(list(layers.named_parameters()), mesh, bucket_mb=8 * 8 * 4 / 2**20)
    _check(
        len(reducer.buckets) == 5, f"expected a bucket per weight and one for the biases, got {len(reducer.buckets)}"
    )
    reducer.zero_grad()
    inputs = [torch.full((2, 8), float(r + 1 + k)) for k in range(2)]
    with reducer.sync(False):
        layers(inputs[0]).sum().backward()
    _check(not any(b.launched for b in reducer.buckets), "no reduction may start before the last microbatch")
    with reducer.sync(True):
        layers(inputs[1]).sum().backward()
    _check(all(b.launched for b in reducer.buckets), "every bucket should be launched by its backward hook")
    reducer.finish()
    # Reference: the same two microbatches of every dp rank, accumulated in one process.
    ref = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    ref.load_state_dict(layers.state_dict())
    for rank in range(n):
        for k in range(2):
            ref(torch.full((2, 8), float(rank + 1 + k))).sum().backward()
    for (name, p), q in zip(layers.named_parameters(), ref.parameters()):
        # fp32 sums in another order: rounding of the largest entry's size
        _check(
            torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-6 * float(q.grad.abs().max())),
            f"{name}: reduced grad != sum over dp "
            f"(max diff {(p.grad - q.grad).abs().max():.3g} of {q.grad.abs().max():.3g})",
        )
    reducer.remove_hooks()


def grad_reducer_shm_buckets_match_gloo() -> None:
    """On one host, dp buckets are summed through shared memory in slot-sized pieces by
    finish(); the gradients equal gloo's all-reduce (bit for bit on 2 ranks, where a sum of
    two is order-free). A 1100x1000 weight (4.4 MB) is larger than one slot."""
    from meshtron.mpu import shm_collectives as shm

    mesh = build_mesh(ParallelConfig(tp=1))
    widths = [1100, 1000, 8]
    grads = {}
    for label, enabled in (("shm", True), ("gloo", False)):
        layers = _linear_stack(widths)
        saved, shm.ENABLED = shm.ENABLED, enabled and shm.ENABLED
        try:
            reducer = DataParallelGradReducer(list(layers.named_parameters()), mesh)
        finally:
            shm.ENABLED = saved
        _check(
            all(b.in_shm == (label == "shm" and shm.ENABLED) for b in reducer.buckets),
            f"{label}: buckets in shared memory = {[b.in_shm for b in reducer.buckets]}",
        )
        reducer.zero_grad()
        for k in range(2):
            with reducer.sync(k == 1):
                layers(torch.full((2, widths[0]), 0.01 * (mesh.dp_rank + 1 + k))).square().sum().backward()
        reducer.finish()
        grads[label] = [p.grad.clone() for p in layers.parameters()]
        reducer.remove_hooks()
    for a, b in zip(grads["shm"], grads["gloo"]):
        same = torch.equal(a, b) if mesh.dp_size == 2 else torch.allclose(a, b, rtol=1e-6, atol=1e-7)
        _check(same, f"shared-memory bucket sum differs from gloo's by {(a - b).abs().max():.3g}")


def cases_for_world(world_size: int) -> list[str]:
    names = [
        "mappings_forward_backward",
        "column_parallel_linear_matches_copy_and_linear",
        "shm_collectives_match_gloo",
        "vocab_parallel_cross_entropy_matches_torch",
        "rng_streams",
        "grad_reducer_overlaps_and_sums",
        "grad_reducer_shm_buckets_match_gloo",
    ]
    if world_size in (4, 8):
        names.insert(0, "mesh_groups")
    return names
