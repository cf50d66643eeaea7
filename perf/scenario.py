"""The scenario this project exists for: decode's pool over-committed while answers stream. The seed scenario
(largest gap, throughput, close-all) per policy in one run (rotate, plain, restart, roomy), pause against restart,
and the rotation policies in the scheduler's simulation."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.tools import dispatch  # noqa: E402

TABLE = {
    "seed": ("seed_stalls", "the seed scenario on a real server, each policy against plain and roomy in one run"),
    "pause-vs-restart": ("pause_vs_restart", "pause and recover vs end and re-submit on a small pool, same run"),
    "rotation-sim": ("rotation_sim", "rotation policies vs plain in the scheduler's simulation: gaps, swap traffic"),
    "overload-sim": ("overload_sim", "rotate vs plain and restart under the soak's sustained load, simulated"),
}

if __name__ == "__main__":
    sys.exit(dispatch("perf/scenario.py", __doc__, TABLE))
