"""Load held for a while: a steady mixed soak (throughput, memory and counts over time, every count back to 0 at
the end), the same load against each decode-OOM policy, and sustained overload in rounds (each round against the
first)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.tools import dispatch  # noqa: E402

TABLE = {
    "steady": ("soak", "a mixed load with cancels: each window's tokens/s and RSS vs the first's; end checks"),
    "policies": ("soak_policies", "rotate vs plain and restart on the same mixed load: tokens/s, gaps, swap traffic"),
    "overload": ("overload_rounds", "rounds of N concurrent streams: each round's wall time, TTFT, RSS vs the first's"),
}

if __name__ == "__main__":
    sys.exit(dispatch("perf/soak.py", __doc__, TABLE))
