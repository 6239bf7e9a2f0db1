"""`python -m hydra_plugins.meshtron_torchrun_launcher._torchrun ARGS` is `torchrun ARGS`, except
that it exits with the first failed worker's exit code: torchrun itself exits 1 whatever its
workers returned, and a sweep record should keep the run's own code (2 = a configuration
error). The leading `_` keeps Hydra's plugin scan from importing torch through this module."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main


def run(argv: list[str]) -> int:
    """Run torchrun with `argv`; 0, the first failed worker's exit code, or 128 + its signal."""
    try:
        torchrun_main(argv)
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        code = failure.exitcode
        return code if code > 0 else 128 - code if code < 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
