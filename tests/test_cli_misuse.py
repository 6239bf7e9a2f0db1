"""Misused command lines end in one line and exit status 2 before any process group or
expensive work starts (issue 41, "nothing lost, nothing silently wrong"): an unwritable
`meshtron.plan --json` path (before the search), bad launcher choices and options of
`train.py -m hydra/launcher=...` (before Hydra starts), a launcher given without `-m` (which
Hydra would ignore, running one process), and `meshtron-prepare` under a file-size limit
(the file named, nothing left looking complete). Each case is the command a user types, run
in a subprocess; the checks behind them are also tried in process where that is cheaper."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from meshtron.errors import ConfigError
from meshtron.training.launcher_checks import launcher_override_error
from meshtron.training.plan_cli import check_json_path, write_json
from tests.test_slurm import ROOT, run  # the subprocess runner of the launcher tests (cwd, OMP_NUM_THREADS=1)

TRAIN = str(ROOT / "train.py")


def one_line(done, *needles: str) -> str:
    """The run's one error line: exit 2, no traceback, and stderr's only non-empty line (the
    whole stderr, but for Python warnings an installed package may print on import) contains
    every needle."""
    err = done.stderr
    assert done.returncode == 2, f"exit {done.returncode}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    lines, after_warning = [], False
    for line in err.splitlines():
        if re.search(r"\w+Warning: ", line) or (after_warning and line.startswith(" ")):
            after_warning = True  # "file:line: XWarning: ..." and its indented source line
            continue
        after_warning = False
        if line.strip():
            lines.append(line)
    assert len(lines) == 1, err[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------- 1. meshtron.plan --json


def test_plan_refuses_a_json_path_in_a_missing_folder_before_the_search(tmp_path):
    target = tmp_path / "no_such_dir" / "plan.json"
    done = run(
        [sys.executable, "-m", "meshtron.plan", "--gpus", "8", "--gpu", "cpu", "--json", str(target), "+model=gpt_1b"],
        timeout=60,
    )
    line = one_line(done, f"--json {target}", "does not exist")
    assert line.startswith("meshtron.plan: ")
    assert done.stdout == ""  # nothing searched: the header line is printed after the search
    assert not target.parent.exists()  # refused, not created


@pytest.mark.parametrize("case", ["parent_is_a_file", "path_is_a_folder", "read_only_folder"])
def test_plan_json_path_checks(tmp_path, case):
    if case == "parent_is_a_file":
        (tmp_path / "f").write_text("x")
        text, expected = str(tmp_path / "f" / "plan.json"), "is a file, not a folder"
    elif case == "path_is_a_folder":
        text, expected = str(tmp_path), "is a folder"
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o555)
        text, expected = str(folder / "plan.json"), "cannot write into its folder"
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match=expected) as info:
        check_json_path(text)
    assert text in str(info.value) and "\n" not in str(info.value)
    assert sorted(tmp_path.rglob("*")) == before  # nothing created, no probe file left


def test_plan_json_is_written_whole_or_not_at_all(tmp_path):
    path = check_json_path(str(tmp_path / "plan.json"))
    write_json(path, {"candidates": [1, 2]})
    assert path.read_text() == '{\n "candidates": [\n  1,\n  2\n ]\n}\n'
    assert oct(path.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    gone = tmp_path / "gone" / "plan.json"
    with pytest.raises(ConfigError, match=f"--json {gone}: could not write the plan"):
        write_json(gone, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no temporary file left


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------- 2./3. train.py launchers


def _launcher_case(case: str, tmp: Path) -> tuple[list[str], list[str], dict | None]:
    """(train.py arguments, needles of the error line, environment) of one misuse; `tmp` is
    the case's own folder, which must stay empty (no sweep or run dir: nothing started)."""
    sweep = f"hydra.sweep.dir={tmp / 'sweep'}"
    if case == "nproc_per_node_0":
        return (
            ["-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=0", sweep],
            ["hydra.launcher.nproc_per_node=0 must be an integer >= 1"],
            None,
        )
    if case == "unknown_launcher":
        return (
            ["-m", "hydra/launcher=torchrn", sweep],
            [
                "unknown hydra/launcher option 'torchrn'",
                "did you mean hydra/launcher=torchrun?",
            ],
            None,
        )
    if case == "misspelt_launcher_key":
        return (
            ["-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_nod=2", sweep],
            [
                "unknown key hydra.launcher.nproc_per_nod of hydra/launcher=torchrun",
                "did you mean hydra.launcher.nproc_per_node?",
            ],
            None,
        )
    if case == "slurm_local_tasks_per_node_0":
        return (
            ["-m", "hydra/launcher=slurm_local", "hydra.launcher.tasks_per_node=0", sweep],
            ["hydra.launcher.tasks_per_node=0 must be an integer >= 1"],
            None,
        )
    if case == "missing_script":
        script = tmp / "no_such_train.py"
        return (
            ["-m", "hydra/launcher=torchrun", f"hydra.launcher.script={script}", sweep],
            [f"hydra.launcher.script='{script}' is not a file"],
            None,
        )
    if case == "slurm_gpu_without_slurm":  # a PATH without Slurm's tools, whatever this machine has
        return (
            ["-m", "hydra/launcher=slurm_gpu", sweep],
            [
                "hydra/launcher=slurm_gpu submits Slurm jobs, but sbatch and srun are not on PATH",
                "hydra/launcher=slurm_local",
            ],
            {"PATH": str(tmp)},
        )
    if case == "launcher_without_m":
        return (
            ["hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2", f"hydra.run.dir={tmp / 'run'}"],
            [
                "hydra/launcher=torchrun applies to a sweep only",
                "add -m",
            ],
            None,
        )
    raise AssertionError(case)


LAUNCHER_CASES = [
    "nproc_per_node_0",
    "unknown_launcher",
    "misspelt_launcher_key",
    "slurm_local_tasks_per_node_0",
    "missing_script",
    "slurm_gpu_without_slurm",
    "launcher_without_m",
]
SUBMITIT_CASES = {"slurm_local_tasks_per_node_0", "slurm_gpu_without_slurm"}


@pytest.fixture(scope="module")
def launcher_runs(tmp_path_factory) -> dict:
    """Every case's `python train.py ...` run, two at a time (each spends most of its ~3 s
    importing torch), keyed by case: (done, needles, its folder)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(case: str):
        tmp = tmp_path_factory.mktemp(case)
        args, needles, env = _launcher_case(case, tmp)
        return run([sys.executable, TRAIN, *args, "trainer.max_steps=1"], timeout=90, env=env), needles, tmp

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(LAUNCHER_CASES, pool.map(one, LAUNCHER_CASES)))


@pytest.mark.parametrize("case", LAUNCHER_CASES)
def test_train_launcher_misuse_is_one_line_before_anything_runs(launcher_runs, case):
    if case in SUBMITIT_CASES:
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs `pip install -e '.[slurm]'`")
    done, needles, tmp = launcher_runs[case]
    line = one_line(done, *needles)
    assert line.startswith("meshtron: configuration error: "), line
    assert list(tmp.iterdir()) == []  # no sweep or run dir: refused before Hydra started the job


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["-m", "optim.lr=1e-3,3e-3"],
        ["-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=2"],
        ["--multirun", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=1,2"],  # a sweep list: Hydra's
        ["hydra.mode=MULTIRUN", "hydra/launcher=torchrun"],
        ["-m", "hydra/sweeper=basic", "hydra.sweep.dir=x"],
        ["--config-name", "mine", "hydra/launcher=torchrun"],  # another primary config: not judged
        ["--cfg", "hydra", "hydra/launcher=torchrun"],  # prints the config, runs nothing
    ],
)
def test_launcher_check_passes_good_command_lines(argv):
    assert launcher_override_error(argv) is None


def test_launcher_check_names_misspellings_and_bad_values_and_needs_m_for_options():
    assert launcher_override_error(["hydra.launcher.nproc_per_node=2"]).startswith(
        "hydra.launcher.nproc_per_node applies to a sweep only"
    )
    assert launcher_override_error(["-m", "hydra.launcher.nproc_per_node=2"]).startswith(
        "unknown key hydra.launcher.nproc_per_node: Hydra's default launcher has no options"
    )
    assert launcher_override_error(["-m", "hydra/launchr=torchrun"]) == (
        "unknown key hydra/launchr; did you mean hydra/launcher=torchrun?"
    )
    assert launcher_override_error(["-m", "hydra/launcher=torchrun", "hydra.launcher.timeout_s=0"]).startswith(
        "hydra.launcher.timeout_s=0 must be > 0 or null"
    )


# ---------------------------------------------------------------- 4. meshtron-prepare under ulimit -f


def _prepare_under_limit(kib: int, args: list[str]):
    """`ulimit -f KIB; meshtron-prepare ARGS` as a shell user runs it (Python ignores SIGXFSZ,
    so the write fails with EFBIG instead of the signal killing the process)."""
    command = f"ulimit -f {kib} && exec {shlex.quote(sys.executable)} -m meshtron.textdata.prepare " + shlex.join(args)
    return run(["bash", "-c", command], timeout=60)


def test_prepare_refuses_a_file_size_limit_below_tokens_bin_before_reading(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "a.txt").write_bytes(b"x" * 20000)  # tokens.bin >= 40000 bytes (uint16 per byte)
    done = _prepare_under_limit(16, ["--src", str(src), "--out", str(out)])
    line = one_line(done, f"--out {str(out)!r}", "tokens.bin", "file-size limit of 16384 bytes", "--max-bytes")
    assert line.startswith("meshtron-prepare: error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_prepare_names_the_file_that_hit_the_limit_and_leaves_out_as_it_was(tmp_path):
    """tokens.bin fits under 8 KiB, index.json (one entry per document) does not: the write of
    index.json fails with EFBIG; the earlier --out keeps its file, no temporary dir is left."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for i in range(200):
        (src / f"document_with_a_long_file_name_{i:03d}.txt").write_text(f"doc {i}\n")
    out.mkdir()
    (out / "keep.txt").write_text("keep me")
    done = _prepare_under_limit(8, ["--src", str(src), "--out", str(out), "--overwrite"])
    one_line(done, f"--out {str(out)!r}", "writing index.json failed (File too large)", "ulimit -f")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no .out.tmp-* left
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "keep me"
