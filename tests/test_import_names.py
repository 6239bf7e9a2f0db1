"""The checkout's folders and bench scripts never stand in for an installed distribution.

Where the checkout is on sys.path (`python train.py` in it, pytest's rootdir) or a bench script
runs (its folder first on sys.path), a top-level `import NAME` finds the checkout's `NAME/` or
`bench/NAME.py` first. transformers imports Hugging Face's `kernels` package, which the
checkout's `kernels/` folder shadowed (meshtron/shadowing.py)."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _python(code: str, *flags: str, cwd: Path = ROOT) -> str:
    proc = subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def _installed_paths() -> list[str]:
    """sys.path without the checkout and its bench folder: where installed packages live."""
    ours = {os.path.realpath(ROOT), os.path.realpath(BENCH)}
    return [p for p in sys.path if p and os.path.realpath(p) not in ours]


def test_import_kernels_in_the_checkout_gets_the_installed_package(tmp_path):
    """A package `kernels` installed after the checkout on sys.path is what `import kernels` gets."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("WHO = 'installed'\n")
    code = (
        f"import sys; sys.path.insert(1, {str(site)!r}); import kernels; print(kernels.WHO); "
        "import meshtron.kernels.backend as b; print(b.__file__)"
    )
    who, backend = _python(code).splitlines()
    assert who == "installed"
    assert Path(backend) == ROOT / "kernels" / "backend.py"


def test_import_kernels_with_nothing_installed_keeps_the_folder():
    """No site-packages (-S): the checkout's folder is what `import kernels` finds, and importing
    it does nothing (transformers' version probe imports it and reads no version)."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import kernels; print(kernels.__file__)"
    assert Path(_python(code, "-S", cwd=Path("/"))) == ROOT / "kernels" / "__init__.py"


def test_transformers_imports_from_the_checkout():
    pytest.importorskip("transformers")
    out = _python("import transformers.integrations.hub_kernels, transformers; print(transformers.__version__)")
    assert out


def test_no_bench_script_takes_an_installed_name():
    """`python bench/X.py` puts bench/ first on sys.path: no script may be named like an
    installed module (bench/kernels.py was, hence bench/kernel_speed.py)."""
    taken = [
        p.stem
        for p in BENCH.glob("*.py")
        if importlib.machinery.PathFinder.find_spec(p.stem, _installed_paths()) is not None
    ]
    assert taken == [], f"bench scripts named like installed modules: {taken}; rename them"


def test_a_top_level_folder_named_like_an_installed_module_defers_to_it():
    unguarded = []
    for init in sorted(ROOT.glob("*/__init__.py")):
        name = init.parent.name
        if name == "meshtron" or importlib.machinery.PathFinder.find_spec(name, _installed_paths()) is None:
            continue
        if "import_installed_instead(__name__, __file__)" not in init.read_text():
            unguarded.append(name)
    assert unguarded == [], (
        f"top-level folders {unguarded} shadow installed modules of the same name; call "
        "meshtron.shadowing.import_installed_instead from their __init__.py as kernels/ does"
    )
