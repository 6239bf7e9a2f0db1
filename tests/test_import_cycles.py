"""No import cycles between meshtron's modules (docs/architecture.md, "One import root, and
layering"). The graph is built from the source with `ast`: module-level imports, imports inside
functions and methods (a lazy import only hides a cycle until the function runs, so it counts),
imports under `if TYPE_CHECKING:`, and `importlib.import_module("meshtron....")` /
`__import__("meshtron....")` calls with a literal name. One node per module (a package's
`__init__.py` is the package); `from meshtron.x import y` is an edge to `meshtron.x.y` when `y`
is a module, else to `meshtron.x`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(root: Path) -> dict[str, Path]:
    """pyproject.toml's `[tool.setuptools.package-dir]`: import name -> folder, meshtron's only."""
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    dirs = {name: root / folder for name, folder in re.findall(r'^"([\w.]+)"\s*=\s*"([\w./-]+)"', section, re.M)}
    assert "meshtron" in dirs, "pyproject.toml maps no `meshtron` package"
    return {name: path for name, path in dirs.items() if name == "meshtron" or name.startswith("meshtron.")}


def modules(root: Path) -> dict[str, Path]:
    """Every module under the mapped folders: dotted name -> file."""
    found = {}
    for package, folder in package_dirs(root).items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package] + parts)
            # `meshtron` maps onto meshtron/ only: a nested mapped folder is its own package.
            found.setdefault(name, path)
    return found


def _module_name(node: ast.ImportFrom, current: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def _target(name: str, known: dict[str, Path]) -> str | None:
    """The known module `name` stands for: itself, else its closest known parent package."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imported_names(path: Path, current: str) -> list[tuple[str, int]]:
    """(dotted meshtron name, line) of every import in the file of module `current`, wherever it
    stands: `import a.b`, `from a import b` (as a.b: b may be a module), relative imports
    resolved, and `import_module`/`__import__` of a literal name. Also the layering test's scanner."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _module_name(node, current, is_package)
            if module:
                names = [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if (
                called in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names = [node.args[0].value]
        found += [(name, node.lineno) for name in names if name == "meshtron" or name.startswith("meshtron.")]
    return found


def imports(path: Path, current: str, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported meshtron module, line) for every import in the file, wherever it stands: each
    imported name stands for the closest known module at or above it."""
    edges = []
    for name, line in imported_names(path, current):
        target = _target(name, known)
        if target and target != current:
            edges.append((target, line))
    return edges


def import_graph(root: Path) -> dict[str, dict[str, str]]:
    """module -> {imported module: "file:line" of the first such import}."""
    known = modules(root)
    graph = {}
    for name, path in known.items():
        edges = graph.setdefault(name, {})
        for target, line in imports(path, name, known):
            edges.setdefault(target, f"{path.relative_to(root).as_posix()}:{line}")
    return graph


def cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One cycle (a path ending where it starts) per strongly connected component of > 1 module
    (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(set(component))
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph, component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first, inside it)."""
    start = min(component)
    parents, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return path[::-1] + [start]
                if child in component and child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # a strongly connected component always has one


def describe(graph, cycle: list[str]) -> str:
    return " -> ".join(f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_import_cycles():
    graph = import_graph(ROOT)
    found = [describe(graph, cycle) for cycle in cycles(graph)]
    assert not found, "import cycles (each edge names the import that makes it):\n" + "\n".join(found)


def test_the_graph_covers_every_folder():
    names = set(modules(ROOT))
    for package in package_dirs(ROOT):
        assert package in names, f"{package} has no __init__.py under its folder"
    assert len(names) > len(package_dirs(ROOT))


def test_the_check_sees_a_lazy_cycle(tmp_path):
    """The checker itself: a cycle closed by an import inside a method, and one by
    `importlib.import_module`, are reported with the imports that make them."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools.package-dir]\n"meshtron" = "meshtron"\n"meshtron.low" = "low"\n"meshtron.high" = "high"\n'
    )
    for folder in ("meshtron", "low", "high"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text('"""x"""\n')
    (tmp_path / "low" / "a.py").write_text("from meshtron.low import b\n")
    (tmp_path / "low" / "b.py").write_text("class C:\n    def f(self):\n        from meshtron.low.a import x\n")
    (tmp_path / "high" / "c.py").write_text("import meshtron.high.d\nfrom meshtron.low import a\n")
    (tmp_path / "high" / "d.py").write_text(
        "import importlib\n\ndef g():\n    return importlib.import_module('meshtron.high.c')\n"
    )
    graph = import_graph(tmp_path)
    assert graph["meshtron.low.a"] == {"meshtron.low.b": "low/a.py:1"}
    assert sorted(describe(graph, cycle) for cycle in cycles(graph)) == [
        "meshtron.high.c (high/c.py:1) -> meshtron.high.d (high/d.py:4) -> meshtron.high.c",
        "meshtron.low.a (low/a.py:1) -> meshtron.low.b (low/b.py:3) -> meshtron.low.a",
    ]
    (tmp_path / "low" / "b.py").write_text("class C:\n    pass\n")
    (tmp_path / "high" / "d.py").write_text("import importlib\n")
    assert cycles(import_graph(tmp_path)) == []


def test_importing_meshtron_loads_neither_the_compiler_nor_triton():
    """Importing the model, the MoE layer and the training loop imports neither torch._dynamo
    nor Triton (meshtron/eager.py defers torch.compiler.disable to compile time): a process that
    never compiles or launches a kernel pays neither, and a test process can still choose
    Triton's interpreter mode after importing meshtron."""
    import subprocess
    import sys

    code = (
        "import sys; import meshtron.models.gpt, meshtron.moe.layer, meshtron.training.loop; "
        "print(sorted(m for m in ('triton', 'torch._dynamo', 'torch._inductor') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
