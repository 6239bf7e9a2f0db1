"""meshtron training entry point (Hydra): config -> mesh -> model -> loop.

    python train.py                                   # tiny GPT on the stdlib's source text
    torchrun --nproc_per_node=4 train.py parallel.tp=2 parallel.sp=true
    torchrun --nproc_per_node=8 train.py +model=gpt_1b parallel.tp=4 parallel.ep=8 trainer.dry_run=true
    python train.py -m optim.lr=1e-3,3e-3 trainer.seed=1,2   # sweep: one run dir each
"""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from training.loop import main_entry  # noqa: E402


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    tree = OmegaConf.to_container(cfg, resolve=True)
    main_entry(tree, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
