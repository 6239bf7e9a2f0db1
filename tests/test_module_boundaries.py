"""Source checks of two module boundaries (issue 13):

* only mpu/, pipeline/ and dp/ call torch.distributed's collectives; every other package goes
  through the public functions of mpu/mappings.py (process-group setup and queries stay free);
* no module imports a private (`_name`) name of another meshtron module (tooling such as
  kernels/aot.py may still read a module's private attributes: it names the module).

PENDING lists the known exceptions in files owned elsewhere; an entry that no longer
matches fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The installed packages (pyproject.toml's package-dir) and the entry script.
SOURCES = [
    "kernels",
    "moe",
    "models",
    "mpu",
    "pipeline",
    "dp",
    "training",
    "textdata",
    "observability",
    "planning",
    "configs",
    "meshtron",
    "train.py",
]
COLLECTIVES = {
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_coalesced",
    "all_gather_object",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "P2POp",
    "send_object_list",
    "recv_object_list",
}
PENDING: set[tuple[str, str]] = set()
# The folders that talk to torch.distributed: the tensor-parallel core, the pipeline's P2P and
# data-parallel gradient reduction and optimizers (parameter-server messages included).
COMMUNICATION = ("mpu/", "pipeline/", "dp/")


def _python_files():
    for entry in SOURCES:
        path = REPO / entry
        yield from ([path] if path.is_file() else sorted(path.rglob("*.py")))


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id] + parts[::-1])


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(source: str, in_mpu: bool) -> list[str]:
    """What a module's `source` uses across the two boundaries: "torch.distributed.<collective>"
    (unless `in_mpu`) and imports "meshtron.<module>.<_name>", one entry per use."""
    tree = ast.parse(source)
    aliases = {}  # local name -> the module it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                aliases[alias.asname or alias.name] = full
                if node.module.startswith("meshtron") and _private(alias.name):
                    found.append(full)
                if node.module == "torch.distributed" and alias.name in COLLECTIVES and not in_mpu:
                    found.append(full)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        dotted = _dotted(node)
        if dotted is None:
            continue
        head, _, rest = dotted.partition(".")
        resolved = f"{aliases.get(head, head)}.{rest}" if rest else dotted
        module, _, attr = resolved.rpartition(".")
        if module == "torch.distributed" and attr in COLLECTIVES and not in_mpu:
            found.append(resolved)
    return found


def test_collectives_only_in_mpu_and_no_private_imports():
    found = set()
    for path in _python_files():
        name = path.relative_to(REPO).as_posix()
        in_communication = name.startswith(COMMUNICATION)
        found.update((name, what) for what in violations(path.read_text(encoding="utf-8"), in_communication))
    new = sorted(found - PENDING)
    assert not new, (
        "outside mpu/, pipeline/ and dp/, call the collectives of mpu/mappings.py "
        "(all_reduce_stats, all_gather_into, barrier, broadcast_object, gather_object, ...) "
        f"and import only public names of other meshtron modules: {new}"
    )
    fixed = sorted(PENDING - found)
    assert not fixed, f"fixed: remove these entries from PENDING in {Path(__file__).name}: {fixed}"


def test_the_check_sees_what_it_forbids():
    source = (
        "import torch\nimport torch.distributed as dist\nfrom torch import distributed as td\n"
        "from torch.distributed import barrier\nfrom meshtron.mpu.mappings import _gather\n"
        "import meshtron.mpu.mappings as m\n"
        "dist.all_reduce(x)\ntorch.distributed.broadcast(x, 0)\ntd.send(x, 1)\nm._all_gather_into(a, b)\n"
        "dist.get_rank()\ndist.init_process_group('gloo')\ndist.ReduceOp.MAX\nm.all_gather_into(a, b, g)\n"
    )
    forbidden_anywhere = ["meshtron.mpu.mappings._gather"]
    collectives = [
        "torch.distributed.barrier",
        "torch.distributed.all_reduce",
        "torch.distributed.broadcast",
        "torch.distributed.send",
    ]
    assert sorted(violations(source, in_mpu=False)) == sorted(forbidden_anywhere + collectives)
    assert sorted(violations(source, in_mpu=True)) == sorted(forbidden_anywhere)
