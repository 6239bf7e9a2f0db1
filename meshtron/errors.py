"""Errors every folder may raise: `ConfigError` for a run configuration that cannot run.

They live at the import root so lower folders (observability, planning) raise the same type
the run's entry catches without importing training/ (upward)."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and what to change."""
