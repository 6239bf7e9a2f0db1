"""Hydra configs (`train.yaml`; the groups `model/`, `parallel/`, `optim/`, `data/`; `hydra/launcher/torchrun.yaml`), importable as `meshtron.configs` so the entry finds them in any install."""
