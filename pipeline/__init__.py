"""Pipeline parallelism: the schedules as per-rank action lists (`schedules`: GPipe, 1F1B,
interleaved 1F1B), the point-to-point message plan every rank derives from all ranks' lists
(`p2p`: NCCL-safe, checked not to deadlock), the executor that runs a schedule over this
rank's model chunks (`executor`) and a step's Chrome trace and bubble measurement (`trace`).

Built on the tensor-parallel core (`meshtron.mpu`); the model code never imports it."""
