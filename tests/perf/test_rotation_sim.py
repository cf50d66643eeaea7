"""perf/scenario.py rotation-sim: the scheduler on a fake clock in the seed scenario's second phase."""

from __future__ import annotations

from perf.tools.rotation_sim import POLICIES, main, simulate


def test_smallest_victims_lose_less_than_round_robin_and_every_gap_stays_bounded():
    r = {p: simulate([5300] * 3, **kw) for p, kw in POLICIES.items()}
    plain = r["plain"]["tokens_per_s"]
    assert r["plain"]["largest_gap"] > 5 and r["plain"]["rotations"] == 0  # a paused answer waits for one to end
    for p in ("round-robin", "smallest", "smallest+prefetch"):
        assert r[p]["largest_gap"] <= 0.5 and r[p]["rotations"] > 0, (p, r[p])
    assert r["smallest"]["tokens_per_s"] > r["round-robin"]["tokens_per_s"] < plain
    assert r["smallest"]["swapped_in"] < 0.7 * r["round-robin"]["swapped_in"]
    assert r["smallest"]["batch1_steps"] < r["round-robin"]["batch1_steps"]


def test_the_command_prints_a_row_per_policy_and_scenario(capsys):
    assert main(["--policies", "plain", "smallest"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "+" in line]
    assert len(rows) == 4, rows


def test_a_turn_cost_is_paid_at_every_rotation_and_each_wait_gets_its_rows(capsys):
    base = simulate([5300] * 3, **POLICIES["smallest"])
    costly = simulate([5300] * 3, turn_cost=0.01, **POLICIES["smallest"])
    assert costly["rotations"] > 0 and costly["seconds"] > base["seconds"] + 0.5 * 0.01 * costly["rotations"]
    assert main(["--policies", "plain", "smallest", "--wait", "0.3", "0.4", "--turn-cost", "0.01"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3 x")]
    assert [r.split(" | ")[2] for r in rows] == ["-", "0.3", "0.4"], rows


def test_the_hybrid_shape_prefetches_kv_ahead_of_its_turns():
    """--shape qwen3.5-9b: state pages on the device and in the host tier; prefetch brings K/V back ahead of a
    hybrid turn as for a dense model, so decode waits for fewer tokens at its turns, gaps stay bounded."""
    from perf.tools.rotation_sim import SHAPES

    shape = SHAPES["qwen3.5-9b"]
    late = simulate([5300] * 3, **shape, **POLICIES["smallest"])
    ahead = simulate([5300] * 3, **shape, **POLICIES["smallest+prefetch"])
    for r in (late, ahead):
        assert r["rotations"] > 0 and r["largest_gap"] <= 0.5, r
    assert late["waited"] == late["swapped_in"] and ahead["waited"] < 0.8 * late["waited"], (late, ahead)
