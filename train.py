"""meshtron training entry point (Hydra): config -> mesh -> model -> loop.

    python train.py                                   # tiny GPT on the stdlib's source text
    torchrun --nproc_per_node=4 train.py parallel.tp=2 parallel.sp=true
    torchrun --nproc_per_node=8 train.py +model=gpt_1b parallel.tp=4 parallel.ep=8 trainer.dry_run=true
    python train.py -m optim.lr=1e-3,3e-3 trainer.seed=1,2   # sweep: one run dir each

`meshtron-train ...` (installed console script) is the same entry.
"""

from meshtron.training.cli import main

if __name__ == "__main__":
    main()
