"""Served through a real tritonserver against the offline engine: time per output token against the engine's
step, answers token for token against the engine's, and speculative decoding's acceptance."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from perf.tools import dispatch  # noqa: E402

TABLE = {
    "vs-offline": ("served_vs_offline", "served time per output token vs the offline engine's step, same run"),
    "exactness": ("served_exactness", "served greedy answers vs the offline engine's, token for token"),
    "speculative": ("speculative_acceptance", "--speculative drafts kept per step, served, vs plain decoding"),
}

if __name__ == "__main__":
    sys.exit(dispatch("perf/served.py", __doc__, TABLE))
