"""Errors every folder may raise: `ConfigError` for a run configuration that cannot run, and
`say_one_line`, how an entry point reports one.

They live at the import root so lower folders (observability, planning) raise the same type
the run's entry catches without importing training/ (upward)."""

import sys


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and what to change."""


def say_one_line(line: str) -> None:
    """Write `line` to stderr in one write: ranks sharing a pipe (torchrun) never interleave
    inside it (print writes the text and the newline separately)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
