"""meshtron's Hydra launcher: `python train.py -m hydra/launcher=torchrun ...` runs every sweep
point under its own torchrun (torchrun_launcher.py). Hydra finds launchers only inside the
`hydra_plugins` namespace package, hence this folder at the repository root (pyproject.toml
installs it beside `meshtron`)."""
