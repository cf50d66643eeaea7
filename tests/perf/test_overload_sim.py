"""perf/scenario.py overload-sim: the scheduler under the soak's sustained load on a fake clock."""

from __future__ import annotations

from perf.tools.overload_sim import POLICIES, main, parser, simulate


def test_the_turns_bound_keeps_swap_ins_within_ten_per_output_token_where_fixed_turns_do_not():
    """Issue #72's CPU check: 128 users on the soak's pool (30% long answers, 20% cancelled, a turn charged 6 ms of
    decode). Rotation with a turn whenever the longest-paused request has waited swaps back more than 10 tokens of
    K/V per output token; with the turns' bound (the default) it stays under that, delivers more, and every
    paused answer still gets its turns (p99 gap under 2 s). Both end with nothing left."""
    a = parser().parse_args(["--duration", "30", "--warmup", "10", "--turn-cost", "0.006"])
    fixed = simulate(a, 128, POLICIES["fixed-turns"])
    bounded = simulate(a, 128, POLICIES["rotate"])
    assert fixed["swap_per_token"] > 10, fixed
    assert bounded["swap_per_token"] <= 10, bounded
    assert bounded["tokens_per_s"] > 1.2 * fixed["tokens_per_s"], (bounded["tokens_per_s"], fixed["tokens_per_s"])
    assert bounded["gap_p99"] <= 2.0 and bounded["rotations"] > 0, bounded
    for r in (fixed, bounded):
        assert r["end"]["requests"] == r["end"]["used"] == r["end"]["host_copies"] == 0, r["end"]
        assert r["finished"] > 0 and r["cancelled"] > 0


def test_the_command_prints_a_row_per_policy_and_load(capsys):
    argv = ["--users", "8", "24", "--policies", "plain", "restart", "--duration", "6", "--warmup", "2", "--pool",
            "2048", "--long-tokens", "400"]  # fmt: skip
    assert main(argv) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "all 0" in line]
    assert [r.split(" | ")[:2] for r in rows] == [["| 8", "plain"], ["| 8", "restart"], ["| 24", "plain"],
                                                  ["| 24", "restart"]], rows  # fmt: skip
