"""What a run reports while it trains: ``metrics.jsonl``, TensorBoard and the console line
(`metrics`), peak memory (`memory`), curves drawn from a run folder (`plot`) and hang reports
naming the stuck rank and collective (`watchdog`)."""
