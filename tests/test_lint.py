"""The code passes `ruff check` with the rules in pyproject.toml ([tool.ruff.lint]) and is as
`ruff format` writes it, so CI (which runs this suite) lints and format-checks every commit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"ruff check found problems (fix them, or `ruff check --fix`):\n{out.stdout[-4000:]}"


def test_ruff_format_is_clean():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--no-cache", "--check", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"files ruff format would change (run `ruff format .`):\n{out.stdout[-4000:]}"
