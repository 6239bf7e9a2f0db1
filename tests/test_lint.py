"""The code passes `ruff check` with the rules in pyproject.toml ([tool.ruff.lint]), so CI (which
runs this suite) lints every commit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"ruff check found problems (fix them, or `ruff check --fix`):\n{out.stdout[-4000:]}"
