"""Hydra configs (`train.yaml` and the `model/` group), importable as `meshtron.configs` so the entry finds them in any install."""
