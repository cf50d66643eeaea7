"""perf.tools.timing, the benchmarks' one timer, with fake CUDA events (no GPU here)."""

from perf.tools import timing


def test_cuda_series_times_each_series_of_calls(monkeypatch):
    """cuda_series: one untimed call, then `series` series of `reps` calls, each timed between its own pair of
    events (a fake event here reads a call counter, and elapsed_time gives calls between two events as ms)."""
    calls = [0]

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = calls[0]

        def elapsed_time(self, later):
            return float(later.at - self.at) * (1 + self.at)  # later series take longer per call

    monkeypatch.setattr(timing.torch.cuda, "Event", Event)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)

    def fn():
        calls[0] += 1

    got = timing.cuda_series(fn, reps=4, series=3)
    assert calls[0] == 1 + 3 * 4
    assert got == [1e-3 * (1 + at) for at in (1, 5, 9)]
    assert timing.cuda_time(fn, 5) == 1e-3 * (1 + 14)


def test_wall_median_is_the_median_of_single_calls(monkeypatch):
    """wall_median: one untimed call, then `reps` calls each timed alone; an outlier does not move the median."""
    clock, durations = [0.0], iter([9.0, 1.0, 2.0, 50.0, 3.0, 2.5])  # the first is the untimed warm-up

    def fn():
        clock[0] += next(durations)

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    assert timing.wall_median(fn, 5) == 2.5
