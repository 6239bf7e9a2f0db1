"""Training loop, optimizer and LR schedule, checkpoints, data, metrics and logging."""
