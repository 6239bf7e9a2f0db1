"""The README and docs/ stay true: their relative links (and #anchors) resolve, the repository
paths they name in backticks exist, the config keys they name are keys of the schema, and the
README stays a short quick start that points into docs/ (not outside the repository)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CHECKED = [README, *DOCS, ROOT / "bench" / "README.md"]  # links, paths and config keys checked in these

TOP_FOLDERS = (
    "mpu",
    "pipeline",
    "dp",
    "moe",
    "models",
    "kernels",
    "training",
    "textdata",
    "observability",
    "planning",
    "configs",
    "bench",
    "tests",
    "docs",
    "meshtron",
    "hydra_plugins",
    "examples",
)
TOP_FILES = ("train.py", "README.md", "pyproject.toml")
SECTIONS = ("trainer", "parallel", "model", "optim", "checkpoint", "kernels", "data")
FILE_SUFFIXES = {"py", "yaml", "yml", "md", "json", "jsonl", "bin", "sh", "txt", "toml", "log", "png"}

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[^\n]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"(?<!!)\[([^\]\n]*)\]\(([^)\s]+)\)")
CONFIG_KEY = re.compile(r"(?<![\w./+~-])(" + "|".join(SECTIONS) + r")\.([a-z_][a-z0-9_]*)\b(?![\w(]|\.\w)")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def without_code(text: str) -> str:
    """The markdown with fenced blocks and inline code removed (links there are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, markup and punctuation dropped (word characters,
    spaces and hyphens kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, GitHub's -1, -2 suffixes for repeats included."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def broken_links(path: Path) -> list[str]:
    bad = []
    for _, target in LINK.findall(without_code(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http(s):, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{rel(path)}: [{target}]: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{rel(path)}: [{target}]: no heading #{anchor} in {rel(dest)}")
    return bad


def code_spans(text: str) -> list[str]:
    """Inline code spans and the lines of fenced blocks: where commands and paths are written."""
    spans = INLINE_CODE.findall(FENCE.sub("", text))
    for block in FENCE.finditer(text):
        spans.extend(block.group(0).splitlines()[1:-1])
    return spans


def is_placeholder(token: str) -> bool:
    """`bench/results/gpu/<UTC date>-...`, `configs/model/{a,b}.yaml`, `outputs/DATE/TIME`,
    `configs/model/NAME.yaml`: stand-ins, not paths."""
    if any(mark in token for mark in ("<", ">", "*", "{", "}", "$", "...", "DATE")):
        return True
    return any(re.fullmatch(r"[A-Z][A-Z0-9_]*", part.split(".")[0]) for part in token.split("/") if part)


def repo_paths(text: str) -> set[str]:
    """Tokens in code that name a repository path: a top-level folder followed by `/`, or one of
    the top-level files. `path::symbol` and `path:line` are checked by their path."""
    found = set()
    for span in code_spans(text):
        for token in re.split(r"[\s=,;()\[\]\"']+", span):
            token = token.split("::")[0]
            token = re.sub(r":\d+$", "", token).rstrip(".:`")
            if token.startswith("./"):
                token = token[2:]
            if token in TOP_FILES or any(token.startswith(folder + "/") for folder in TOP_FOLDERS):
                found.add(token)
    return found


def path_exists(token: str) -> bool:
    if (ROOT / token).exists():
        return True
    # `tests/distributed/dense_cases.UNFUSED`-style module.attribute: the module file must exist
    stem, dot, attr = token.rpartition(".")
    return bool(dot) and attr not in FILE_SUFFIXES and attr.isidentifier() and (ROOT / f"{stem}.py").exists()


def known_config_keys() -> set[str]:
    from meshtron.training.config import SECTIONS as KINDS
    from meshtron.training.config import config_key

    assert set(KINDS) == set(SECTIONS), f"config sections changed: {sorted(KINDS)}; update SECTIONS here"
    return {f"{section}.{config_key(f)}" for section, kind in KINDS.items() for f in dataclasses.fields(kind)}


def named_config_keys(text: str) -> set[str]:
    """`section.key` names in prose and code, but not file names (`data.py`, `train.yaml`) or
    module paths (`meshtron.kernels.aot`, `textdata/data.py`)."""
    return {f"{section}.{key}" for section, key in CONFIG_KEY.findall(text) if key not in FILE_SUFFIXES}


# ----------------------------------------------------------------------------------------------


def test_docs_folder_has_the_topic_pages_and_an_index_linking_each():
    names = {p.name for p in DOCS}
    expected = {
        "README.md",
        "architecture.md",
        "parallelism.md",
        "moe.md",
        "kernels.md",
        "checkpoints.md",
        "data.md",
        "planning.md",
        "launching.md",
        "performance.md",
        "reliability.md",
    }
    assert expected <= names, sorted(expected - names)
    index_links = {target.partition("#")[0] for _, target in LINK.findall((ROOT / "docs" / "README.md").read_text())}
    assert names - {"README.md"} <= index_links, sorted(names - {"README.md"} - index_links)


@pytest.mark.parametrize("path", CHECKED, ids=rel)
def test_relative_links_resolve(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", CHECKED, ids=rel)
def test_repository_paths_in_code_exist(path):
    missing = sorted(t for t in repo_paths(path.read_text()) if not is_placeholder(t) and not path_exists(t))
    assert missing == [], f"{rel(path)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("path", CHECKED, ids=rel)
def test_config_keys_named_are_schema_keys(path):
    unknown = sorted(named_config_keys(path.read_text()) - known_config_keys())
    assert unknown == [], f"{rel(path)} names config keys the schema does not know: {unknown}"


def test_layout_table_names_real_files():
    """docs/architecture.md's "Layout of the code" names files relative to each row's folder
    (`mesh.py` in the `mpu/` row): each must exist there, so a renamed module is caught."""
    text = (ROOT / "docs" / "architecture.md").read_text().split("## Layout of the code", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w]+)/` \| (.*) \|$", text, re.M)
    assert len(rows) >= len(TOP_FOLDERS) - 1, rows
    missing, named = [], 0
    for folder, what in rows:
        for token in INLINE_CODE.findall(what):
            if not re.fullmatch(r"[\w./]+(\.(py|yaml|sh)|/)", token) or any(
                token.startswith(f + "/") for f in TOP_FOLDERS
            ):
                continue
            named += 1
            if not ((ROOT / folder / token).exists() or (ROOT / token).exists()):
                missing.append(f"{folder}/{token}")
    assert named > 80 and missing == [], missing


def test_strategy_map_names_real_config_keys():
    """The "Distribution strategies" table (docs/parallelism.md) maps each strategy onto real keys."""
    text = (ROOT / "docs" / "parallelism.md").read_text().split("## Distribution strategies", 1)[1]
    text = text.split("\n## ", 1)[0]
    named = named_config_keys(text)
    assert len(named) > 20 and named <= known_config_keys(), sorted(named - known_config_keys())


def test_readme_is_a_short_quick_start_inside_the_repository():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 220, f"README.md has {len(lines)} lines; move detail into docs/"
    assert lines[0] == "# meshtron"
    for path in [README, *DOCS]:
        assert "../shared" not in path.read_text(), f"{rel(path)} points outside the repository (../shared)"


def test_readme_test_command_is_what_ci_runs():
    """.ci/run takes the first non-fence line after the marker as the suite's command."""
    after = README.read_text().split("<!-- test-command -->", 1)[1].splitlines()
    command = next(line for line in after if line.strip() and not line.startswith("```"))
    assert command == (
        '.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not serial" && '
        ".venv/bin/python -m pytest -q -p no:cacheprovider -m serial"
    )


# The checkers themselves: each must fail on what it exists to catch.


def test_checkers_catch_what_they_guard(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n## Sub part (x)\n[ok](#sub-part-x) [gone](#nope) [file](missing.md) "
        "[web](https://example.com/x)\n```\n[in code](nowhere.md)\n```\n"
    )
    bad = broken_links(page)
    assert len(bad) == 2 and "#nope" in bad[0] and "missing.md" in bad[1], bad
    text = (
        "`mpu/mesh.py` `mpu/renamed.py` `python bench/plan_table.py --markdown` `moe/layer.py::MoELayer` "
        "`bench/results/gpu/<UTC date>-x.json` `configs/model/NAME.yaml` "
        "`tests/distributed/dense_cases.UNFUSED` `mesh.tp`\n```bash\npython bench/gone.py\n```\n"
    )
    missing = sorted(t for t in repo_paths(text) if not is_placeholder(t) and not path_exists(t))
    assert missing == ["bench/gone.py", "mpu/renamed.py"], missing
    keys = named_config_keys(
        "`parallel.tp=2` `optim.zeroo=1` `textdata/data.py` `data.py` `train.yaml` "
        "meshtron.kernels.aot `+model=gpt_1b` `model.num_experts`"
    )
    assert keys == {"parallel.tp", "optim.zeroo", "model.num_experts"}, keys
    assert keys - known_config_keys() == {"optim.zeroo"}
