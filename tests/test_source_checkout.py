"""`python train.py` in a source checkout where meshtron is installed non-editable (or not at
all): the checkout's `meshtron/` folder shadows the installed package, and its subpackages
must still resolve (the GPU acceptance card run failed with "No module named
'meshtron.training'" before meshtron/__init__.py extended its __path__)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# -S: no site-packages, so neither the editable install's finder nor an installed copy helps;
# find_spec imports only meshtron/__init__.py (no torch).
PROBE = """
import importlib.util, sys
sys.path.insert(0, sys.argv[1])
for name in ("meshtron.training.cli", "meshtron.mpu.mesh", "meshtron.moe.layer", "meshtron.configs"):
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:  # its parent package is not there
        spec = None
    print(name, spec.origin if spec else None)
"""


def test_subpackages_resolve_from_a_bare_checkout():
    out = subprocess.run(
        [sys.executable, "-S", "-c", PROBE, str(REPO)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    found = dict(line.split(" ", 1) for line in out)
    assert found == {
        "meshtron.training.cli": str(REPO / "training" / "cli.py"),
        "meshtron.mpu.mesh": str(REPO / "mpu" / "mesh.py"),
        "meshtron.moe.layer": str(REPO / "moe" / "layer.py"),
        "meshtron.configs": str(REPO / "configs" / "__init__.py"),
    }


def test_an_installed_copy_does_not_look_beside_itself(tmp_path):
    """Installed in site-packages (no pyproject.toml beside it) the package keeps its own path."""
    (tmp_path / "meshtron").mkdir()
    (tmp_path / "meshtron" / "__init__.py").write_text((REPO / "meshtron" / "__init__.py").read_text())
    (tmp_path / "training").mkdir()
    (tmp_path / "training" / "cli.py").write_text("")
    out = subprocess.run(
        [sys.executable, "-S", "-c", PROBE, str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "meshtron.training.cli None"
