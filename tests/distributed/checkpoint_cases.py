"""Resharding checkpoints: train 2 steps under one layout, save, load under other layouts.

Faults reach every rank: a disk filling up on one rank mid-save, and a checkpoint.dir locked by
another run, raise the same CheckpointError on all ranks (no rank left waiting in a collective).

The checkpoint loaded into a single process continues like the uninterrupted run (the next two
losses within 1e-6). After loading under another layout, every parameter (all-gathered) equals, bit for bit, the same checkpoint loaded
into a single-process model; the next step's loss equals that unsharded continuation within
1e-6 and the weights after it (which use the loaded AdamW moments) within 1e-5.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from meshtron.dp import distributed_optimizer
from meshtron.dp.distributed_optimizer import ShardedAdamW
from meshtron.dp.grad_reduce import DataParallelGradReducer
from meshtron.models.gpt import init_model_chunks
from meshtron.mpu.mesh import ParallelConfig, build_mesh, single_process_mesh
from meshtron.pipeline.executor import PipelineExecutor, activation_shape
from meshtron.training import checkpoint, checkpoint_files
from meshtron.training.checkpoint import (
    LOCK_FILE,
    WRITE_DELAY_ENV,
    AsyncCheckpointer,
    TrainState,
    hold_checkpoint_dir,
    load_checkpoint,
    new_checkpoint_group,
    save_checkpoint,
)
from meshtron.training.checkpoint_files import (
    CheckpointError,
    check_checkpoint_crcs,
    list_checkpoints,
    load_newest_intact,
)
from meshtron.training.optim import build_optimizer
from meshtron.training.step import StepResult, pipeline_train_step, train_step
from tests.distributed.dense_cases import (
    ADAM_EPS,
    LR,
    SEED,
    assert_close,
    compare_parameters,
    full_tensor,
    global_batch,
    model_config,
    trim_vocab,
)
from tests.distributed.moe_cases import moe_config
from tests.distributed.pipeline_cases import pipeline_config

BATCH = 4  # global rows per step; one row per microbatch


class _Run:
    """A model, reducer and optimizer for one layout (pp > 1: 1F1B pipeline)."""

    def __init__(self, cfg, par: ParallelConfig | None, zero: int = 0):
        self.cfg = cfg
        self.mesh = build_mesh(par, cfg) if par is not None else single_process_mesh()
        self.chunks = init_model_chunks(cfg, self.mesh, SEED)
        self.named = [(n, p) for c in self.chunks for n, p in c.named_parameters()]
        self.reducer = DataParallelGradReducer(self.named, self.mesh, bucket_mb=0.01, shard_grads=zero == 2)
        if zero:
            self.optimizer = ShardedAdamW(self.reducer, lr=LR, weight_decay=0.1, eps=ADAM_EPS)
        else:
            self.optimizer = build_optimizer(nn.ModuleList(self.chunks), lr=LR, weight_decay=0.1, eps=ADAM_EPS)
        self.executor = None
        if self.mesh.pp_size > 1:
            self.executor = PipelineExecutor(
                self.chunks,
                self.mesh,
                activation_shape(self.mesh, cfg.seq_len, 1, cfg.hidden_size),
                torch.float32,
                torch.device("cpu"),
            )

    def step(self, step: int) -> StepResult:
        """One step on the global batch of `step`, one row per microbatch on every layout (so
        MoE statistics, per rank-microbatch, are the same in every layout)."""
        inputs, targets = global_batch(self.cfg, step, BATCH)
        per_rank = BATCH // self.mesh.dp_size
        rows = slice(self.mesh.dp_rank * per_rank, (self.mesh.dp_rank + 1) * per_rank)
        micro = [(inputs[rows][j : j + 1], targets[rows][j : j + 1]) for j in range(per_rank)]
        if self.executor is None:
            return train_step(self.chunks[0], self.reducer, self.optimizer, micro, self.mesh, lr=LR, max_grad_norm=1.0)
        return pipeline_train_step(
            self.chunks,
            self.reducer,
            self.optimizer,
            micro,
            self.mesh,
            self.executor,
            schedule="1f1b",
            lr=LR,
            max_grad_norm=1.0,
        )

    def close(self) -> None:
        self.reducer.remove_hooks()


def shared_tmpdir() -> Path:
    """A temporary folder made by rank 0 and named to every rank (checkpoints need one dir)."""
    chosen = [tempfile.mkdtemp(prefix="meshtron-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(chosen, src=0)
    return Path(chosen[0])


def remove_shared_tmpdir(root: Path) -> None:
    """Remove `shared_tmpdir`'s folder once every rank is done with it."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


def _check_reshard(
    cfg,
    save: ParallelConfig,
    loads: list[tuple[ParallelConfig, bool]],
    save_zero: bool = False,
    check_continuation: bool = True,
):
    """Train 2 steps at `save`, save, then load at each of `loads` ((layout, ZeRO-1)) and
    compare with the same checkpoint loaded into one process. `check_continuation` also
    compares the saving layout's own steps 3-4 with the serial continuation (1e-6)."""
    root = shared_tmpdir()
    try:
        source = _Run(cfg, save, save_zero)
        for step in range(2):
            source.step(step)
        path = save_checkpoint(
            root,
            TrainState(step=2, consumed_samples=2 * BATCH),
            source.chunks,
            source.optimizer,
            source.mesh,
            model_config=dataclasses.asdict(cfg),
        )
        if check_continuation:
            uninterrupted = [source.step(step).loss for step in (2, 3)]  # step 4's loss depends on the moments
        source.close()
        if check_continuation:
            serial = _Run(cfg, None)
            load_checkpoint(path, serial.chunks, serial.optimizer, serial.mesh)
            for step, want in zip((2, 3), uninterrupted):
                assert_close(
                    f"step {step + 1}: serial continuation vs the uninterrupted run",
                    serial.step(step).loss,
                    want,
                    rtol=1e-6,
                )
            serial.close()
        for par, zero in loads:
            target = _Run(cfg, par, zero)
            state = load_checkpoint(path, target.chunks, target.optimizer, target.mesh)
            assert state.step == 2 and state.consumed_samples == 2 * BATCH, state
            serial = _Run(cfg, None)
            load_checkpoint(path, serial.chunks, serial.optimizer, serial.mesh)
            ref_params = dict(serial.named)
            for name, p in target.named:
                got = trim_vocab(name, full_tensor(p, p.shards, target.mesh), cfg)
                if not torch.equal(got, trim_vocab(name, ref_params[name].detach(), cfg)):
                    raise AssertionError(f"{par}: loaded {name} differs from the serial load")
            out = target.step(2)
            ref = serial.step(2)
            assert_close(f"{par} zero={zero}: loss after resharding", out.loss, ref.loss, rtol=1e-6)
            compare_parameters(target.named, ref_params, target.mesh, cfg, f"{par} zero={zero}: weight after step 3")
            target.close()
            serial.close()
    finally:
        remove_shared_tmpdir(root)


def gpt2_tp2_pp2_to_tp1_tp4_zero() -> None:
    _check_reshard(
        pipeline_config("gpt2", False),
        ParallelConfig(tp=2, pp=2),
        [
            (ParallelConfig(tp=1), False),
            (ParallelConfig(tp=4), False),
            (ParallelConfig(tp=2, sp=True), True),
            (ParallelConfig(tp=1, pp=4), False),
        ],
    )


def llama_tp2_pp2_zero_to_tp4_pp1() -> None:
    cfg = dataclasses.replace(pipeline_config("llama", False), num_kv_heads=4)  # tp=4 needs 4 KV heads
    _check_reshard(
        cfg, ParallelConfig(tp=2, pp=2), [(ParallelConfig(tp=4), False), (ParallelConfig(tp=1), True)], save_zero=True
    )


def moe_ep2_to_ep4_and_tp2_etp2() -> None:
    cfg = moe_config("gpt2", 2, "sigmoid", None)  # with the aux-free expert bias buffer
    _check_reshard(
        cfg,
        ParallelConfig(ep=2),
        [
            (ParallelConfig(ep=4), False),
            (ParallelConfig(ep=1), True),
            (ParallelConfig(tp=2, sp=True, ep=2, etp=2), False),
        ],
        save_zero=True,
    )


def llama_cp2_zero_to_tp2_cp2_a2a_and_dp4() -> None:
    """Saved at cp=2 x dp=2 with ZeRO-1 (AdamW state sharded over the 4 gradient replicas,
    dp x cp), loaded at tp=2 x cp=2 (all-to-all attention) and at dp=4 with ZeRO-1."""
    cfg = model_config("llama")
    _check_reshard(
        cfg,
        ParallelConfig(cp=2),
        [(ParallelConfig(tp=2, cp=2, cp_comm="a2a"), False), (ParallelConfig(), True)],
        save_zero=True,
    )


def _same_on_every_rank(message: str) -> None:
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, messages


def save_failure_on_one_rank_reaches_every_rank() -> None:
    """Rank 1's disk fills up while it writes its shard of step 2: every rank raises the same
    CheckpointError naming rank 1's file; step 1 stays the only (intact) checkpoint."""
    from tests.test_checkpoint import _FillingDisk

    root = shared_tmpdir()
    cfg = pipeline_config("gpt2", False)
    run = _Run(cfg, ParallelConfig(tp=2, pp=2))
    try:
        run.step(0)
        save_checkpoint(
            root, TrainState(step=1), run.chunks, run.optimizer, run.mesh, model_config=dataclasses.asdict(cfg)
        )
        if dist.get_rank() == 1:
            real_init = checkpoint._ChecksummedFile.__init__
            checkpoint._ChecksummedFile.__init__ = lambda self, file, path, on_error: real_init(
                self, _FillingDisk(file), path, on_error
            )
        try:
            with pytest.raises(CheckpointError) as failure:
                save_checkpoint(
                    root, TrainState(step=2), run.chunks, run.optimizer, run.mesh, model_config=dataclasses.asdict(cfg)
                )
        finally:
            if dist.get_rank() == 1:
                checkpoint._ChecksummedFile.__init__ = real_init
        message = str(failure.value)
        assert (
            f"could not save the checkpoint of step 2 (earlier checkpoints are intact): rank 1: "
            f"{root / '.tmp-step_00000002' / '__1_0.distcp'}: No space left on device"
        ) == message, message
        _same_on_every_rank(message)
        dist.barrier()
        assert [p.name for p in root.iterdir()] == ["step_00000001"]
        assert list_checkpoints(root) == [root / "step_00000001"]
        check_checkpoint_crcs(root / "step_00000001")
    finally:
        run.close()
        remove_shared_tmpdir(root)


def locked_dir_is_refused_on_every_rank() -> None:
    """Global rank 0 takes the lock for all ranks; a lock held on another host makes every rank
    raise the same CheckpointError."""
    root = shared_tmpdir()
    try:
        with hold_checkpoint_dir(root):
            holder = json.loads((root / LOCK_FILE).read_text())
            _same_on_every_rank(json.dumps(holder))
        dist.barrier()
        assert not (root / LOCK_FILE).exists()
        dist.barrier()
        if dist.get_rank() == 0:
            (root / LOCK_FILE).write_text(json.dumps({**holder, "host": "elsewhere"}))
        dist.barrier()
        with pytest.raises(CheckpointError, match="in use by pid .* on host elsewhere") as refused:
            with hold_checkpoint_dir(root):
                pass
        _same_on_every_rank(str(refused.value))
    finally:
        remove_shared_tmpdir(root)


@contextlib.contextmanager
def _recorded_crc_reads():
    """Yields the list of checkpoint file names whose CRC32 this rank computes inside the block."""
    real, names = checkpoint_files.file_crc32, []

    def recording(path):
        names.append(Path(path).name)
        return real(path)

    checkpoint_files.file_crc32 = recording
    try:
        yield names
    finally:
        checkpoint_files.file_crc32 = real


def _two_saved_steps(root: Path, cfg, par: ParallelConfig) -> list[Path]:
    """Checkpoints of steps 1 and 2 of a run at `par`."""
    run = _Run(cfg, par)
    saved = []
    for step in range(2):
        run.step(step)
        state = TrainState(step=step + 1, consumed_samples=(step + 1) * BATCH)
        saved.append(
            save_checkpoint(root, state, run.chunks, run.optimizer, run.mesh, model_config=dataclasses.asdict(cfg))
        )
    run.close()
    return saved


def each_rank_verifies_only_the_files_it_loads() -> None:
    """Resume at scale: loading a tp=2 x pp=2 checkpoint into the same layout, each rank checks
    the CRC32 of only the data files its load plan reads (its own shard file and those holding
    tensors deduplicated into another's, not all four), and together the ranks check every one.
    A corrupt file that only some ranks read is the same CheckpointError on every rank, naming it; `load_newest_intact` then loads the
    previous checkpoint on every rank alike, equal to a serial load of it."""
    from tests.test_checkpoint import _corrupt

    cfg, par = pipeline_config("gpt2", False), ParallelConfig(tp=2, pp=2)
    root = shared_tmpdir()
    try:
        older, newest = _two_saved_steps(root, cfg, par)
        data_files = sorted(p.name for p in newest.iterdir() if p.suffix == ".distcp")
        assert len(data_files) == 4, data_files
        target = _Run(cfg, par)
        with _recorded_crc_reads() as verified:
            load_checkpoint(newest, target.chunks, target.optimizer, target.mesh)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(set(verified)))
        own = f"__{dist.get_rank()}_0.distcp"
        assert own in verified and len(set(verified)) < len(data_files), verified
        assert sorted({name for names in everyone for name in names}) == data_files, everyone
        readers = {name: [r for r, names in enumerate(everyone) if name in names] for name in data_files}
        corrupt = max(data_files, key=lambda name: (-len(readers[name]), name))  # the fewest readers
        assert len(readers[corrupt]) < dist.get_world_size(), readers  # the others learn of it from DCP
        dist.barrier()
        if dist.get_rank() == 0:
            _corrupt(newest / corrupt)
        dist.barrier()
        with pytest.raises(CheckpointError, match=rf"checkpoint file {newest / corrupt} is corrupt") as failure:
            load_checkpoint(newest, target.chunks, target.optimizer, target.mesh)
        assert f"(found by rank {min(readers[corrupt])})" in str(failure.value), (failure.value, readers)
        _same_on_every_rank(str(failure.value))

        def load(path: Path) -> TrainState:
            return load_checkpoint(path, target.chunks, target.optimizer, target.mesh)

        path, state = load_newest_intact([newest, older], load, explicit=False)
        assert path == older and state.step == 1, (path, state)
        serial = _Run(cfg, None)
        load_checkpoint(older, serial.chunks, serial.optimizer, serial.mesh)
        reference = dict(serial.named)
        for name, p in target.named:
            got = trim_vocab(name, full_tensor(p, p.shards, target.mesh), cfg)
            assert torch.equal(got, trim_vocab(name, reference[name].detach(), cfg)), name
        target.close()
        serial.close()
    finally:
        remove_shared_tmpdir(root)


@contextlib.contextmanager
def _no_moment_gather():
    """Any all-gather of ZeRO moments (or of anything in the distributed optimizer) raises."""

    def refuse(*args, **kwargs):
        raise AssertionError("the ZeRO checkpoint save all-gathered moments")

    real = ShardedAdamW.param_moments, distributed_optimizer.all_gather_into
    ShardedAdamW.param_moments, distributed_optimizer.all_gather_into = refuse, refuse
    try:
        yield
    finally:
        ShardedAdamW.param_moments, distributed_optimizer.all_gather_into = real


def _full_state(run: _Run) -> dict[str, torch.Tensor]:
    """Every parameter and its AdamW moments as full, unpadded tensors (all-gathered over tp;
    ZeRO moments over dp) and the step count: what any layout must agree on."""
    moments, step = run.optimizer.param_moments()
    out = {"step": torch.tensor(step)}
    for name, p in run.named:
        shards = getattr(p, "shards", ())
        out[name] = trim_vocab(name, full_tensor(p, shards, run.mesh), run.cfg)
        for key, m in zip(("exp_avg", "exp_avg_sq"), moments[p]):
            out[f"{name}/{key}"] = trim_vocab(name, full_tensor(m, shards, run.mesh), run.cfg)
    return out


def _moment_bytes_per_file(path: Path) -> dict[str, int]:
    metadata = dcp.FileSystemReader(path).read_metadata()
    per_file: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("optim/") and index.fqn != "optim/step":
            per_file[info.relative_path] = per_file.get(info.relative_path, 0) + info.length
    return per_file


def zero_shards_saved_without_gather_load_anywhere() -> None:
    """ZeRO-1 and ZeRO-2 at dp=2 save their moment shards with every moment all-gather patched
    to raise; each rank's file holds half of the moment bytes. The checkpoint loads exactly
    (weights and moments equal bit for bit) into one process (zero=0), tp=2, and dp=2 at the
    other ZeRO stage; a tp=2 zero=0 checkpoint loads exactly into dp=2 at zero=1 and 2."""
    cfg = dataclasses.replace(model_config("gpt2"), seq_len=15)  # pos_embed (15, 32): dp shards cut a row
    root = shared_tmpdir()
    plans = [
        (ParallelConfig(), 1, [(None, 0), (ParallelConfig(tp=2), 0), (ParallelConfig(), 2)]),
        (ParallelConfig(), 2, [(None, 0), (ParallelConfig(tp=2), 0), (ParallelConfig(), 1)]),
        (ParallelConfig(tp=2), 0, [(ParallelConfig(), 1), (ParallelConfig(), 2)]),
    ]
    try:
        for save_par, save_zero, loads in plans:
            source = _Run(cfg, save_par, save_zero)
            for step in range(2):
                source.step(step)
            with _no_moment_gather() if save_zero else contextlib.nullcontext():
                path = save_checkpoint(
                    root / f"zero{save_zero}",
                    TrainState(step=2),
                    source.chunks,
                    source.optimizer,
                    source.mesh,
                    model_config=dataclasses.asdict(cfg),
                )
            want = _full_state(source)
            source.close()
            if save_zero:
                per_file = _moment_bytes_per_file(path)
                share = min(per_file.values()) / sum(per_file.values())
                assert len(per_file) == 2 and share > 0.45, per_file  # each rank wrote its shard
                metadata = dcp.FileSystemReader(path).read_metadata()
                chunks = metadata.state_dict_metadata["optim/pos_embed/exp_avg"].chunks
                assert any(tuple(c.sizes)[0] == 1 and tuple(c.sizes)[1] < 32 for c in chunks), chunks  # partial row
            for par, zero in loads:
                target = _Run(cfg, par, zero)
                load_checkpoint(path, target.chunks, target.optimizer, target.mesh)
                got = _full_state(target)
                for key in want:
                    if not torch.equal(got[key], want[key]):
                        raise AssertionError(
                            f"saved at {save_par} zero={save_zero}, loaded at {par} zero={zero}: {key} differs"
                        )
                target.close()
    finally:
        remove_shared_tmpdir(root)


def async_save_while_training_in_a_world() -> None:
    """dp=2 ZeRO-1: a background save (slowed writer) while two more steps run writes the same
    data files as a synchronous save of the same state; a disk filling up on rank 1 during a
    background write raises the same CheckpointError on both ranks at the next wait, and the
    earlier checkpoint stays the newest."""
    from tests.test_checkpoint import _FillingDisk

    cfg = model_config("gpt2")
    root = shared_tmpdir()
    run = _Run(cfg, ParallelConfig(), 1)
    saver = AsyncCheckpointer(new_checkpoint_group(30.0))
    try:
        for step in range(2):
            run.step(step)
        state = TrainState(step=2, consumed_samples=2 * BATCH)
        sync = save_checkpoint(
            root / "sync", state, run.chunks, run.optimizer, run.mesh, model_config=dataclasses.asdict(cfg)
        )
        os.environ[WRITE_DELAY_ENV] = "0.5"
        try:
            saver.save(root / "async", state, run.chunks, run.optimizer, run.mesh, model_config=dataclasses.asdict(cfg))
            for step in (2, 3):
                run.step(step)
            assert saver.in_flight, "the background write ended before two steps ran"
        finally:
            del os.environ[WRITE_DELAY_ENV]
        background = saver.wait()
        check_checkpoint_crcs(background)
        for name in checkpoint.read_meta(sync)["files"]:
            if name.endswith(".distcp"):
                assert (sync / name).read_bytes() == (background / name).read_bytes(), name

        if dist.get_rank() == 1:
            real_init = checkpoint._ChecksummedFile.__init__
            checkpoint._ChecksummedFile.__init__ = lambda self, file, path, on_error: real_init(
                self, _FillingDisk(file), path, on_error
            )
        try:
            saver.save(
                root / "async",
                TrainState(step=4),
                run.chunks,
                run.optimizer,
                run.mesh,
                model_config=dataclasses.asdict(cfg),
            )
            with pytest.raises(CheckpointError) as failure:
                saver.wait()
        finally:
            if dist.get_rank() == 1:
                checkpoint._ChecksummedFile.__init__ = real_init
        message = str(failure.value)
        partial = root / "async" / ".tmp-step_00000004" / "__1_0.distcp"
        assert message == (
            f"could not save the checkpoint of step 4 (earlier checkpoints are intact): rank 1: "
            f"{partial}: No space left on device"
        ), message
        _same_on_every_rank(message)
        dist.barrier()
        assert list_checkpoints(root / "async") == [background]
    finally:
        saver.close()
        run.close()
        remove_shared_tmpdir(root)


def cases_for_world(world_size: int) -> list[str]:
    if world_size == 2:
        return ["zero_shards_saved_without_gather_load_anywhere", "async_save_while_training_in_a_world"]
    if world_size == 4:
        return [
            "gpt2_tp2_pp2_to_tp1_tp4_zero",
            "llama_tp2_pp2_zero_to_tp4_pp1",
            "moe_ep2_to_ep4_and_tp2_etp2",
            "llama_cp2_zero_to_tp2_cp2_a2a_and_dp4",
            "save_failure_on_one_rank_reaches_every_rank",
            "locked_dir_is_refused_on_every_rank",
            "each_rank_verifies_only_the_files_it_loads",
        ]
    return []
