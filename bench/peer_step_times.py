"""Run a ../shared/peers benchmark unchanged, adding every timed step to its JSON.

The peers' shared helper (../shared/peers/common.py) reports a run's step times only as
median / min / max / mean. The side-by-side benchmarks compare quantiles of all steps pooled
over rounds (bench/peer_rounds.py), so this wrapper replaces `common.summarize` before the
peer script imports it: the result gains `step_times_s` (seconds, in order), nothing else
changes. Usage, also as the script torchrun starts on every rank:

    python bench/peer_step_times.py ../shared/peers/mcore_moe.py --layers 4 ...
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: peer_step_times.py PEER_SCRIPT [ARGS...]")
    script = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(script.parent))  # where the peer finds common.py
    import common  # noqa: E402  (the peer's helper, found through the path above)

    summarize = common.summarize

    def summarize_with_steps(times, tokens_per_step):
        return {**summarize(times, tokens_per_step), "step_times_s": [round(t, 6) for t in times]}

    common.summarize = summarize_with_steps
    sys.argv = [str(script), *sys.argv[2:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
