"""DataParallelGradReducer's first touch (dp/grad_reduce.py) in one process: zero_grad() leaves
the buffers as they are, the step's first gradient of each parameter is copied into its
bucket slice, later microbatches accumulate there, and finish() zeroes the slices of
parameters that got no gradient. The multi-process reductions are proven in
tests/distributed (mpu_cases, zero_cases, offload_cases)."""

import torch
from torch import nn

from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.mpu.mesh import single_process_mesh


def _model():
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(5, 4), "b": nn.Linear(4, 3), "unused": nn.Linear(3, 2)})


def _loss(model, x, use_b: bool = True):
    h = model["a"](x).tanh()
    return (model["b"](h) if use_b else h).square().sum()


def _reference_grads(model, batches, use_b=True):
    ref = _model()
    ref.load_state_dict(model.state_dict())
    for x in batches:
        _loss(ref, x, use_b).backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in ref.named_parameters()}


def _in_bucket(reducer, p) -> bool:
    bucket = reducer._bucket_of[id(p)]
    return p.grad.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()


def test_first_touch_writes_the_bucket_and_later_microbatches_accumulate():
    model = _model()
    reducer = DataParallelGradReducer(list(model.named_parameters()), single_process_mesh())
    batches = [torch.randn(3, 5, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    reducer.zero_grad()
    assert all(p.grad is None for p in model.parameters())  # nothing zeroed, nothing pointed yet
    for i, x in enumerate(batches):
        with reducer.sync(i == len(batches) - 1):
            _loss(model, x).backward()
        touched = [p for n, p in model.named_parameters() if not n.startswith("unused")]
        assert all(_in_bucket(reducer, p) for p in touched)
    reducer.finish()
    want = _reference_grads(model, batches)
    for name, p in model.named_parameters():
        assert _in_bucket(reducer, p), name
        torch.testing.assert_close(p.grad, want[name], rtol=1e-6, atol=1e-7, msg=name)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model["unused"].parameters())
    reducer.remove_hooks()


def test_nothing_of_an_earlier_step_survives_in_the_buffers():
    """Poison every buffer after a step: the next step's gradients are still exact, and a
    parameter without a gradient in it reads zero, not the poison (finish() zeroed its slice)."""
    model = _model()
    reducer = DataParallelGradReducer(list(model.named_parameters()), single_process_mesh())
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(5))
    for step, use_b in enumerate((True, False)):
        reducer.zero_grad()
        _loss(model, x, use_b).backward()
        reducer.finish()
        want = _reference_grads(model, [x], use_b)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-6, atol=1e-7, msg=f"step {step} {name}")
        for bucket in reducer.buckets:
            bucket.buffer.fill_(float("nan"))
    reducer.remove_hooks()


def test_padding_of_recreated_sharded_buffers_is_zero():
    """shard_grads re-creates freed buffers uninitialised; their padding (never written by a
    gradient) is zeroed, so a reduce-scatter never carries garbage there. One process: the
    buffers are never freed, so free one by hand as finish() does with replicas."""
    model = _model()
    reducer = DataParallelGradReducer(list(model.named_parameters()), single_process_mesh(), shard_grads=True)
    bucket = reducer.buckets[0]
    bucket.padding = 3  # as if padded to a multiple of the replicas
    bucket.numel = bucket.buffer.numel() + 3
    reducer._free_buffer(bucket)
    reducer.zero_grad()
    assert bucket.buffer.numel() == bucket.numel and torch.equal(bucket.buffer[-3:], torch.zeros(3))
    reducer.remove_hooks()
