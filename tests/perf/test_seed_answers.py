"""perf/scenario.py seed's answer comparison: which streams equal the reference policy's token for token, and where
the others first differ (the served check of `--deterministic`, issue #29)."""

from __future__ import annotations

import pytest

from perf.tools import seed_stalls


def test_same_answers_names_the_first_difference_of_each_stream():
    ref = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    assert seed_stalls.same_answers([[1, 2, 3, 4], [5, 6, 7], [8, 9]], ref) == "3 of 3"
    got = seed_stalls.same_answers([[1, 2, 0, 4], [5, 6, 7], [8]], ref)
    assert got == "1 of 3 (first differences at tokens 2, 1)"  # a shorter answer differs where it stops


def test_compare_answers_against_the_reference_policy_per_phase():
    answers = {
        "roomy": {"3x5500": [[1, 2], [3, 4]], "4x4000": [[9]]},
        "rotate": {"3x5500": [[1, 2], [3, 5]]},
        "plain": {"3x5500": [[1, 2], [3, 4]], "4x4000": [[9]]},
    }
    got = seed_stalls.compare_answers(answers, "roomy")
    assert got == {
        "3x5500": {"rotate": "1 of 2 (first differences at tokens 1)", "plain": "2 of 2"},
        "4x4000": {"plain": "1 of 1"},
    }
    assert seed_stalls.compare_answers(answers, "missing") == {}


def test_report_lists_the_warm_up_apart_from_the_measured_phases():
    """A real run's summary (tiny model, `--scale 0.05`): the unmeasured warm-up of each server is one line, not a
    phase of the tables."""
    import json
    from pathlib import Path

    summary = json.loads((Path(__file__).parent / "data" / "seed_summary_warmup.json").read_text())
    assert all("warmup" in runs for runs in summary["policies"].values())
    text = seed_stalls.report(summary)
    assert "Warm-up on each server before the measured phases (not measured): plain 2 of 2" in text
    assert "## 4x4000" in text and "## warmup" not in text


def test_report_of_a_run_stopped_by_its_time_limit_says_so():
    """A run stopped by --time-limit (perf.limits.wall_clock_limit writes the summary with a note): the report keeps
    every measured table and ends with the note; a run that finished has none."""
    import json
    from pathlib import Path

    summary = json.loads((Path(__file__).parent / "data" / "seed_summary_warmup.json").read_text())
    assert "TIME LIMIT" not in seed_stalls.report(summary)
    summary["note"] = "TIME LIMIT: stopped after 300 s"
    text = seed_stalls.report(summary)
    assert "## 4x4000" in text and text.rstrip().endswith("**TIME LIMIT: stopped after 300 s**")


def test_the_report_names_every_read_first_reason_the_decode_loop_counts():
    """seed_stalls keeps its own copy of the reasons (it runs without torch): it must match the loop's labels."""
    from backends.pd_decode.steps import DecodeSteps

    assert seed_stalls.READ_FIRST == DecodeSteps.READ_FIRST


def test_the_report_names_every_part_of_the_decode_loop():
    """Likewise the loop's parts of pd_decode_loop_seconds_total, which the report reads by label."""
    from backends.pd_decode.loop_metrics import LOOP_PARTS

    assert seed_stalls.LOOP_PARTS == LOOP_PARTS


def _summary(setup: str, runs: dict) -> dict:
    phase = lambda tok, gap: {"output_tok_s": tok, "largest_gap_s": gap, "completed": 3, "streams": 3}  # noqa: E731
    return {"setup": setup, "command": "python perf/scenario.py seed ...", "policies": {
        pol: {"3x5500": phase(*r), "close_all": {}} for pol, r in runs.items()}}  # fmt: skip


def test_merged_runs_give_each_policy_its_mean_range_and_loss(tmp_path):
    """--merge: two runs that measured both policies and one of rotate alone; the loss is of the means over every
    run of each policy, and per run only where that run measured plain too; runs of another setup are refused."""
    import json

    runs = {
        "a": _summary("m, pool 8192", {"plain": (380.0, 7.2), "rotate": (342.0, 0.40)}),
        "b": _summary("m, pool 8192", {"rotate": (361.0, 0.33), "plain": (380.0, 7.4)}),
        "c": _summary("m, pool 8192", {"rotate": (368.0, 0.36)}),
    }
    for name, s in runs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(s))
    out = tmp_path / "merged"
    assert seed_stalls.main(["--out", str(out), "--merge", *(str(tmp_path / n) for n in "abc")]) == 0
    text = (out / "merged.md").read_text()
    assert "over 3 runs: m, pool 8192" in text
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["plain"].startswith("| plain | 2 | 3/3, 3/3 | 380.0 (380.0 - 380.0) | 7.40 | - | - |")
    # rotate: mean 357.0 of (342, 361, 368) -> 6.1% below 380; per run with plain: 10.0%, 5.0%
    assert "| rotate | 3 | 3/3, 3/3, 3/3 | 357.0 (342.0 - 368.0) | 0.40 | +6.1% | +10.0%, +5.0% |" in rows["rotate"]
    other = tmp_path / "d"
    other.mkdir()
    (other / "summary.json").write_text(json.dumps(_summary("other model", {"plain": (1.0, 1.0)})))
    with pytest.raises(SystemExit):
        seed_stalls.main(["--out", str(out), "--merge", str(tmp_path / "a"), str(other)])


def test_report_of_a_base_policy_that_served_nothing_gives_no_loss():
    """A real run cut short by --time-limit (tests/perf/data/README.md): plain, the base of the loss row, served
    0 tokens/s in its one-second phase; the report still comes out, with no loss against it rather than a
    division by zero, and the measured policy's figures kept."""
    import json
    from pathlib import Path

    summary = json.loads((Path(__file__).parent / "data" / "seed_summary_cut_short.json").read_text())
    assert summary["policies"]["plain"]["3x5500"]["output_tok_s"] == 0.0
    text = seed_stalls.report(summary)
    row = next(line for line in text.splitlines() if line.startswith("| throughput loss vs plain"))
    assert row == "| throughput loss vs plain | - | - |"
    assert "| output tokens/s | 292.8 | 0.0 |" in text and "**TIME LIMIT" in text
