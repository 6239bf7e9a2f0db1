"""meshtron: Megatron-style tensor/sequence/data/expert/pipeline parallel GPT and MoE training.

One import root over the repository's top-level folders (pyproject.toml's package-dir maps
`meshtron.mpu` onto `mpu/`, `meshtron.training` onto `training/`, and so on): the folders stay
where the design card puts them, while nothing installed takes a generic top-level name
(`kernels`, `mpu`, `models`, `training`) that another distribution owns or probes for.
"""

__version__ = "0.1.0"
