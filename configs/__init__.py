"""Hydra configs (`train.yaml`; the groups `model/`, `parallel/`, `optim/`, `data/`; `hydra/launcher/torchrun.yaml`), importable as `meshtron.configs` so the entry finds them in any install.

`train.yaml` is generated from the config dataclasses by `generate.py` (`python -m meshtron.configs.generate`);
the group presets are written by hand and only override its keys."""
