"""The run itself: typed run config (`config`), process groups (`distributed`), the loop (`loop`),
one optimizer step (`step`), optimizers (`optim`), LR schedule (`schedule`), mixed precision
(`precision`), checkpoints (`checkpoint`, with the layout-free DCP planners of
`sharded_state`), graceful preemption (`preemption`) and host-allocator settings
(`host_malloc`)."""
