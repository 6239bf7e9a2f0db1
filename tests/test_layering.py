"""The folders depend one way (docs/architecture.md, "One import root"): a module may import meshtron
modules of its own folder or of folders below it, never above. Checked on the source with
`ast`, imports inside functions included, so a lazy import cannot hide an upward edge."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_import_cycles import imported_names

ROOT = Path(__file__).resolve().parents[1]
# Lower number = lower layer. `meshtron` (the import root: errors) sits below everything.
# `pipeline` and `dp` sit above the model code (which uses neither) and are peers.
LAYERS = {
    "meshtron": 0,
    "mpu": 1,
    "kernels": 2,
    "moe": 3,
    "models": 4,
    "pipeline": 5,
    "dp": 5,
    "textdata": 6,
    "planning": 6,
    "observability": 7,
    "training": 8,
}
# `python -m` entry points at the import root, like train.py: they only forward to a command line
# module of the top layer, so nothing below them imports them.
ENTRY_POINTS = {"meshtron/plan.py", "meshtron/verify.py", "meshtron/rehearse.py"}


def _meshtron_imports(path: Path, folder: str) -> list[tuple[int, str]]:
    """(line, folder) of every `meshtron.<folder>` import in `folder`'s file (the import-cycle
    test's scanner: lazy, relative and import_module imports included)."""
    parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
    module = ".".join(["meshtron"] + ([] if folder == "meshtron" else [folder]) + parts)
    found = []
    for name, line in imported_names(path, module):
        target = name.split(".")[1] if "." in name else "meshtron"
        found.append((line, target if target in LAYERS else "meshtron"))
    return found


def _upward_imports() -> list[str]:
    bad = []
    for folder, layer in LAYERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() in ENTRY_POINTS:
                continue
            for line, target in _meshtron_imports(path, folder):
                same_level_peer = LAYERS[target] == layer and target != folder
                if LAYERS[target] > layer or same_level_peer:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports meshtron.{target}")
    return bad


def test_no_folder_imports_a_folder_above_it():
    assert _upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The checker itself: an upward import planted in a copy of the tree is reported."""
    for folder in LAYERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "moe" / "bad.py").write_text("def f():\n    from meshtron.models.gpt import GPT\n")
    (tmp_path / "training" / "fine.py").write_text("from meshtron.moe.layer import MoELayer\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    assert _upward_imports() == ["moe/bad.py:2 imports meshtron.models"]


@pytest.mark.parametrize("folder", sorted(LAYERS))
def test_every_layer_folder_is_a_package_with_a_docstring(folder):
    init = ROOT / folder / "__init__.py"
    assert init.is_file(), f"{folder}/ has no __init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"{folder}/__init__.py says nothing about what lives there"
