"""meshtron: Megatron-style tensor/sequence/data/expert/pipeline parallel GPT and MoE training.

One import root over the repository's top-level folders (pyproject.toml's package-dir maps
`meshtron.mpu` onto `mpu/`, `meshtron.training` onto `training/`, and so on): the folders stay
where the design card puts them, while nothing installed takes a generic top-level name
(`kernels`, `mpu`, `models`, `training`) that another distribution owns or probes for.
"""

import os as _os

__version__ = "0.1.0"

# A source checkout run without an editable install (`pip install .`, then `python train.py`
# in the checkout, as a GPU acceptance run does): the script's folder comes first on sys.path,
# so `meshtron` is this folder, which holds only the root modules. Let the subpackages
# resolve from the checkout's top-level folders, the files that install maps them from.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "pyproject.toml")) and _os.path.isfile(
    _os.path.join(_checkout, "training", "cli.py")
):
    __path__.append(_checkout)
