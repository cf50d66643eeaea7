"""perf/seed_stalls.py's answer comparison: which streams equal the reference policy's token for token, and where
the others first differ (the served check of `--deterministic`, issue #29)."""

from __future__ import annotations

from perf import seed_stalls


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
