"""docs/kernels.md's table of GPU kernel figures and kernels/measured.json (what
kernels.backend=auto runs on CUDA), generated from bench/results/gpu/*-kernels.json,
docs/performance.md's table of meshtron beside its peers from bench/results/gpu/*-peers.json,
and docs/planning.md's table of ranks rehearsed on a GPU beside the planner from
bench/results/gpu/*-rehearse.json (bench/rehearse_gpu.py).

    python bench/results_table.py           # rewrite the table block and kernels/measured.json
    python bench/results_table.py --check   # exit 1 if either is stale or a results file is bad

The newest file per device (by the UTC date its name starts with) gives one table; files from
a CPU rehearsal (`"rehearsal": true` or device "cpu") are never shown. `--check` also checks
every results file against the schema (bench/kernel_records.py `check`): every key present,
names from the issue's target list, `met` consistent with ratio / meshtron and target.
No torch import.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from bench.kernel_records import check, device_slug  # noqa: E402
from bench.peers import check as check_peers  # noqa: E402
from bench.rehearse_gpu import WHATS as REHEARSE_WHATS  # noqa: E402
from bench.rehearse_gpu import check as check_rehearse  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gpu"
DOC = ROOT / "docs" / "kernels.md"
MEASURED = ROOT / "kernels" / "measured.json"
# The records that give a kernel's speed over the torch path auto would run instead (device
# time, baseline / meshtron), at the card's shapes: kernel <- record names (several: the slowest).
SPEEDUP_RECORDS = {
    "linear_gelu": ("linear+GeLU gpt_1b_tp4",),
    "linear_swiglu": ("linear+SwiGLU gpt_1b_tp4",),
    "rms_norm": ("RMSNorm h2048 device",),
    "layer_norm": ("LayerNorm h2048 device",),
    "residual_rms_norm": ("residual+RMSNorm h2048 device",),
    "residual_layer_norm": ("residual+LayerNorm h2048 device",),
    "gemm": ("gemm x·Wᵀ gpt_1b_tp4", "gemm dX gpt_1b_tp4", "gemm dW gpt_1b_tp4"),
}
# The fused cross-entropy replaces meshtron's own torch path, not F.cross_entropy: its speed-up
# is the torch path's device time over the Triton kernel's (two records, same baseline).
CE_TRITON, CE_TORCH_PATH = (
    "cross-entropy vs F.cross_entropy gpt_1b_tp4",
    "cross-entropy torch path vs F.cross_entropy gpt_1b_tp4",
)
BEGIN, END = "<!-- kernel-table:begin -->", "<!-- kernel-table:end -->"
FILE = re.compile(r"(\d{4}-\d{2}-\d{2})-([a-z0-9]+)-kernels\.json")
PEERS_FILE = re.compile(r"(\d{4}-\d{2}-\d{2})-([a-z0-9]+)-peers\.json")
REHEARSE_FILE = re.compile(r"(\d{4}-\d{2}-\d{2})-([a-z0-9]+)-rehearse\.json")
NONE_YET = (
    "No GPU run has recorded figures in this format yet: the first `bench/gpu_session.sh kernels` "
    "on a lent GPU writes `bench/results/gpu/<UTC date>-<device>-kernels.json`."
)
PEERS_DOC = ROOT / "docs" / "performance.md"
PEERS_BEGIN, PEERS_END = "<!-- peers-table:begin -->", "<!-- peers-table:end -->"
PEERS_NONE_YET = (
    "No GPU run has compared meshtron with its peers yet: the first `bench/gpu_session.sh peers` "
    "on a lent GPU writes `bench/results/gpu/<UTC date>-<device>-peers.json`."
)
REHEARSE_DOC = ROOT / "docs" / "planning.md"
REHEARSE_BEGIN, REHEARSE_END = "<!-- rehearse-table:begin -->", "<!-- rehearse-table:end -->"
REHEARSE_NONE_YET = (
    "No GPU run has rehearsed a rank yet: the first `bench/gpu_session.sh rehearse` on a lent GPU "
    "writes `bench/results/gpu/<UTC date>-<device>-rehearse.json`."
)
# kind -> (results file names, the doc's markers, the text while no GPU file exists)
TABLES = {
    "kernels": (FILE, BEGIN, END, NONE_YET),
    "peers": (PEERS_FILE, PEERS_BEGIN, PEERS_END, PEERS_NONE_YET),
    "rehearse": (REHEARSE_FILE, REHEARSE_BEGIN, REHEARSE_END, REHEARSE_NONE_YET),
}
# a results file's checker, by the end of its name
CHECKERS = {"-kernels.json": check, "-peers.json": check_peers, "-rehearse.json": check_rehearse}


def latest_files(results: Path, pattern: re.Pattern = FILE) -> list[Path]:
    """The newest results file of each device (rehearsal files left out), by device name:
    issue 36's kernel files, or with `pattern` = PEERS_FILE issue 37's peer files."""
    newest: dict[str, tuple[str, Path]] = {}
    for path in sorted(results.glob("*.json")):
        match = pattern.fullmatch(path.name)
        if not match or match.group(2) == "cpu":
            continue
        date, slug = match.groups()
        if slug not in newest or date > newest[slug][0]:
            newest[slug] = (date, path)
    return [newest[slug][1] for slug in sorted(newest)]


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and abs(x) >= 1e4:
        return f"{x:,.0f}"
    return f"{x:.3g}" if isinstance(x, float) else f"{x:,}" if isinstance(x, int) else str(x)


def _how(rec: dict) -> str:
    method = rec.get("method")
    if isinstance(method, dict):
        methods = sorted({str(v) for v in method.values() if v})
        how = "/".join(methods)
    else:
        how = str(method or "")
    note = rec.get("note")
    return "; ".join(x for x in (how, note) if x).replace("|", "\\|").replace("\n", " ")


def table(path: Path) -> str:
    records = json.loads(path.read_text())
    first = records[0]
    measured = sum(r["meshtron"] is not None for r in records)
    met = sum(r["met"] is True for r in records)
    with_target = sum(r["target"] is not None for r in records)
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    lines = [
        f"**{first['device']}, {first['date']}** (`{rel}`; torch {first['torch']}, Triton {first['triton']}): "
        f"{measured} of {len(records)} targets measured, {met} of {with_target} met.",
        "",
        "| target | meshtron | baseline | unit | ratio | target | met | how / note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        goal = _goal(r)
        met_cell = {True: "yes", False: "no", None: "-"}[r["met"]]
        cells = [r["name"], _num(r["meshtron"]), _num(r["baseline"]), r.get("unit", ""), _num(r["ratio"]), goal]
        lines.append("| " + " | ".join([*map(str, cells), met_cell, _how(r)]) + " |")
    return "\n".join(lines)


def _goal(r: dict) -> str:
    if r["target"] is None:
        return "-"
    if r.get("better") == "within":
        return "1 ± " + _num(r["target"])
    return ("≤ " if r.get("better") == "lower" else "≥ ") + _num(r["target"])


def rehearse_table(path: Path) -> str:
    """One row per rehearsed rank of a -rehearse.json file: measured vs planned GiB, the rank's
    step time and MFU, the job's predicted vs planned tokens/s."""
    records = json.loads(path.read_text())
    first = records[0]
    suffixes = [what for what, *_ in REHEARSE_WHATS]  # memory, rank MFU, job tokens/s
    ranks: dict[str, dict[str, dict]] = {}
    for r in records:
        what = next(w for w in suffixes if r["name"].endswith(" " + w))
        ranks.setdefault(r["name"][: -len(what) - 1], {})[what] = r
    memory_met = sum(rows[suffixes[0]]["met"] is True for rows in ranks.values())
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    lines = [
        f"**{first['device']}, {first['date']}** (`{rel}`; torch {first['torch']}, Triton {first['triton']}): "
        f"{len(ranks)} ranks, memory within {_num(first['target'])} of the planner's for {memory_met}.",
        "",
        "| rehearsed rank | rank / world | measured GiB | planned GiB | measured / planned | met (1 ± 0.05) "
        "| step s | rank MFU | predicted job tokens/s | planner tokens/s | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, rows in ranks.items():
        mem, mfu, job = (rows.get(w, {}) for w in suffixes)
        rank = f"{mem['rank']} / {mem['world']}" if mem.get("rank") is not None else "-"
        step = mfu.get("step_s")
        note = "; ".join(
            dict.fromkeys(
                str(x) for x in (mem.get("note"), mfu.get("note"), job.get("note"), mem.get("plan_overrides")) if x
            )
        )
        cells = [
            label,
            rank,
            _num(mem.get("meshtron")),
            _num(mem.get("baseline")),
            _num(mem.get("ratio")),
            {True: "yes", False: "no", None: "-"}[mem.get("met")],
            _num(None if step is None else round(step, 4)),
            _num(mfu.get("meshtron")),
            _num(job.get("meshtron")),
            _num(job.get("baseline")),
            note.replace("|", "\\|").replace("\n", " "),
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def block(results: Path, kind: str = "kernels") -> str:
    """The generated block of `kind` ("kernels": docs/kernels.md, "peers": docs/performance.md,
    "rehearse": docs/planning.md)."""
    pattern, begin, end, none_yet = TABLES[kind]
    files = latest_files(results, pattern)
    render = rehearse_table if kind == "rehearse" else table
    body = "\n\n".join(render(p) for p in files) if files else none_yet
    note = "<!-- generated by `python bench/results_table.py` from the newest results file per device; do not edit -->"
    return f"{begin}\n{note}\n\n{body}\n\n{end}"


def rewrite(doc_text: str, new_block: str, kind: str = "kernels") -> str:
    _, begin, end_marker, _ = TABLES[kind]
    start, end = doc_text.find(begin), doc_text.find(end_marker)
    if start < 0 or end < start:
        raise SystemExit(f"the markers {begin} ... {end_marker} are missing")
    return doc_text[:start] + new_block + doc_text[end + len(end_marker) :]


def problems(results: Path) -> list[str]:
    """Every results file's problems: issue 36's `-kernels.json` (bench/kernel_records.py),
    issue 37's `-peers.json` (bench/peers.py) and issue 38's `-rehearse.json`
    (bench/rehearse_gpu.py) against their target lists and the contract."""
    out = []
    for path in sorted(results.glob("*.json")):
        name = FILE.fullmatch(path.name) or PEERS_FILE.fullmatch(path.name) or REHEARSE_FILE.fullmatch(path.name)
        if not name:
            out.append(f"{path.name}: not named <UTC date>-<device>-kernels.json, -peers.json or -rehearse.json")
            continue
        try:
            records = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            out.append(f"{path.name}: not JSON ({err})")
            continue
        checker = next(c for end, c in CHECKERS.items() if path.name.endswith(end))
        out += [f"{path.name}: {line}" for line in checker(records)]
        if isinstance(records, list) and records and isinstance(records[0], dict):
            first = records[0]
            if any(r.get("rehearsal") for r in records if isinstance(r, dict)):
                out.append(f"{path.name}: a CPU rehearsal's records (measure nothing), not a GPU run")
            if first.get("date") != name.group(1) or device_slug(str(first.get("device"))) != name.group(2):
                out.append(f"{path.name}: its records say {first.get('date')} / {first.get('device')}")
    return out


def _entry(kernel: str, first: dict, speedup: float, source: str) -> dict:
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(first.get("dtype"), first.get("dtype"))
    return dict(kernel=kernel, device=first["device"], date=first["date"], dtype=dtype, speedup=speedup, source=source)


def measured_entries(path: Path) -> list[dict]:
    """kernels/measured.json entries of one results file: each kernel whose records all have
    a ratio (device time; several records: the slowest)."""
    by = {r["name"]: r for r in json.loads(path.read_text())}
    source = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    out = []
    for kernel, names in SPEEDUP_RECORDS.items():
        ratios = [by[n]["ratio"] for n in names if n in by]
        if ratios and len(ratios) == len(names) and all(r is not None for r in ratios):
            out.append(_entry(kernel, by[names[0]], round(min(ratios), 4), source))
    triton, torch_path = by.get(CE_TRITON, {}).get("meshtron"), by.get(CE_TORCH_PATH, {}).get("meshtron")
    if triton and torch_path:
        out.append(_entry("cross_entropy", by[CE_TRITON], round(torch_path / triton, 4), source))
    return out


def measured_table(results: Path, current: dict) -> dict:
    """kernels/measured.json: its hand-kept entries (a source that is not a results file) and
    the entries of every GPU results file, oldest first."""
    kept = [m for m in current["measurements"] if not FILE.fullmatch(Path(m["source"]).name)]
    files = sorted((p for p in results.glob("*-kernels.json") if FILE.fullmatch(p.name)), key=lambda p: p.name)
    derived = [e for p in files if FILE.fullmatch(p.name).group(2) != "cpu" for e in measured_entries(p)]
    return {**current, "measurements": kept + derived}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a doc's block is stale or a file is bad")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--doc", type=Path, default=DOC, help="the kernel table's doc (docs/kernels.md)")
    p.add_argument("--peers-doc", type=Path, default=PEERS_DOC, help="the peers table's doc (docs/performance.md)")
    p.add_argument(
        "--rehearse-doc", type=Path, default=REHEARSE_DOC, help="the rehearsed ranks' table's doc (docs/planning.md)"
    )
    p.add_argument("--measured", type=Path, default=MEASURED)
    args = p.parse_args(argv)
    docs = {"kernels": args.doc, "peers": args.peers_doc, "rehearse": args.rehearse_doc}
    texts = {kind: path.read_text() for kind, path in docs.items()}
    wants = {kind: rewrite(texts[kind], block(args.results, kind), kind) for kind in docs}
    table_text = args.measured.read_text()
    want_table = json.dumps(measured_table(args.results, json.loads(table_text)), indent=1, ensure_ascii=False) + "\n"
    if not args.check:
        for kind, path in docs.items():
            if wants[kind] != texts[kind]:
                path.write_text(wants[kind])
        if want_table != table_text:
            args.measured.write_text(want_table)
        print(
            f"{args.doc}, {args.peers_doc}, {args.rehearse_doc}, {args.measured}: from {len(list(args.results.glob('*.json')))} file(s)"
        )
        return 0
    bad = problems(args.results)
    for kind, path in docs.items():
        if wants[kind] != texts[kind]:
            bad.append(f"{path}: the {kind} table is stale; run `python bench/results_table.py`")
    if want_table != table_text:
        bad.append(f"{args.measured}: stale; run `python bench/results_table.py`")
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
