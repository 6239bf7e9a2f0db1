"""A checkout's top-level folder found by another distribution's import name.

The design card keeps meshtron's folders at the top of the repository (`kernels/`, `models/`,
...), installed as `meshtron.kernels` and so on. But wherever the checkout itself is on
`sys.path` (`python train.py` or `python -m meshtron.verify` run in it, pytest's rootdir), a
plain `import kernels` finds the checkout's folder before the installed distribution of that
name: transformers >= 5.2x imports Hugging Face's `kernels` package, and found ours instead
("cannot import name 'CUDAProperties' from 'kernels'"). A folder whose name an installed
distribution also takes calls `import_installed_instead` when it is imported by its top-level
name; imported as `meshtron.<name>` it is meshtron's as always.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _same_folder(entry: str, folder: str) -> bool:
    return os.path.realpath(entry or os.getcwd()) == os.path.realpath(folder)


def import_installed_instead(name: str, init_file: str) -> None:
    """Make `sys.modules[name]` the installed package or module `name` found on `sys.path`
    without the checkout that holds `init_file` (the folder's `__init__.py`), so the import in
    progress returns it. Where nothing else of that name is installed, the folder stays what
    the import found (importing it does nothing), as before this existed."""
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    elsewhere = [entry for entry in sys.path if not _same_folder(entry, checkout)]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    ours = sys.modules[name]  # the folder's module, whose import is in progress
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules[name] = ours
        raise
