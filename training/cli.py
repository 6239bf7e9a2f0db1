"""The Hydra entry of a training run: `python train.py ...`, `meshtron-train ...` or
`torchrun ... train.py ...` all land in `main` (config -> mesh -> model -> loop)."""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from meshtron.training.config import unknown_override
from meshtron.training.loop import main_entry


# configs/ is the package meshtron.configs (pyproject.toml maps it), so Hydra finds it in any install.
@hydra.main(version_base="1.3", config_path="pkg://meshtron.configs", config_name="train")
def _hydra_main(cfg: DictConfig) -> None:
    tree = OmegaConf.to_container(cfg, resolve=True)
    main_entry(tree, HydraConfig.get().runtime.output_dir)


def main() -> None:
    """Refuse an override naming no config key in one line (exit 2) before Hydra composes
    the config, then run Hydra's entry."""
    error = unknown_override(sys.argv[1:])
    if error:
        print(f"meshtron: configuration error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    _hydra_main()


if __name__ == "__main__":
    main()
