"""backends.common.serving.metrics against a fake of the Python backend's metrics API: every update runs on one worker
thread, coalesced (a gauge's last value, a counter's summed increments, a histogram as cumulative bucket counters),
and close() sends what is pending, then frees the metrics and families before it returns."""

from __future__ import annotations

import threading
import time
import weakref

from backends.common.serving import metrics as mod


class FakeMetric:
    def __init__(self, family: str, labels: dict, log: list):
        self.family, self.labels, self.log = family, labels, log

    def _record(self, op: str, v: float) -> None:
        self.log.append((op, self.family, self.labels.get("le"), v, threading.current_thread().name))

    def set(self, v):
        self._record("set", v)

    def increment(self, v):
        self._record("inc", v)


class FakeFamily:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
    log: list = []
    made: list = []

    def __init__(self, name, description, kind):
        self.name = name
        FakeFamily.made.append(weakref.ref(self))

    def Metric(self, labels):  # noqa: N802 (the Python backend's name)
        m = FakeMetric(self.name, labels, FakeFamily.log)
        FakeFamily.made.append(weakref.ref(m))
        return m


class FakePb:
    MetricFamily = FakeFamily


def totals(log: list) -> dict:
    out: dict = {}
    for op, fam, le, v, _ in log:
        key = (fam, le)
        out[key] = v if op == "set" else out.get(key, 0.0) + v
    return out


def test_updates_are_coalesced_on_one_thread_and_close_frees_everything(monkeypatch):
    monkeypatch.setattr(mod, "_pb", lambda: FakePb)
    monkeypatch.setattr(mod, "FLUSH_INTERVAL", 0.2)  # a burst within one interval is one send per metric
    FakeFamily.log, FakeFamily.made = [], []
    m = mod.Metrics({"model": "x"})
    g = m.gauge("pd_g", "a gauge")
    c = m.counter("pd_c", "a counter")
    h = m.histogram("pd_h", "a histogram", buckets=[0.1, 1.0])
    g.set(-1.0)  # a first update after idle goes out at once
    deadline = time.monotonic() + 5
    while not FakeFamily.log and time.monotonic() < deadline:
        time.sleep(0.01)
    assert FakeFamily.log[0][:4] == ("set", "pd_g", None, -1.0)
    threads = [threading.Thread(target=lambda i=i: (g.set(i), c.increment(1))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for v in (0.05, 0.1, 0.5, 3.0):  # le is inclusive: 0.1 counts in le="0.1"
        h.observe(v)
    c.increment(0)  # a zero increment is nothing to send
    m.close()  # sends what is pending
    assert {name for *_, name in FakeFamily.log} <= {"pd-metrics", threading.current_thread().name}
    assert len(FakeFamily.log) < 8 + 8 + 4  # coalesced: fewer sends than updates
    t = totals(FakeFamily.log)
    assert t[("pd_c", None)] == 8
    assert t[("pd_g", None)] in set(range(8))  # the last value set, whichever thread was last
    assert t[("pd_h_bucket", "0.1")] == 2 and t[("pd_h_bucket", "1")] == 3 and t[("pd_h_bucket", "+Inf")] == 4
    assert t[("pd_h_count", None)] == 4 and abs(t[("pd_h_sum", None)] - 3.65) < 1e-9
    # every metric and family is gone once close() returns, though the role still holds its handles
    assert FakeFamily.made and all(r() is None for r in FakeFamily.made)
    n = len(FakeFamily.log)
    g.set(3.0)
    c.increment(2)
    h.observe(1.0)
    assert len(FakeFamily.log) == n  # handles are no-ops after close
    # a later Metrics (a model reloaded in the same stub) gets a fresh worker
    m2 = mod.Metrics({"model": "y"})
    m2.gauge("pd_g2", "again").set(1.0)
    m2.close()
    assert FakeFamily.log[-1][:4] == ("set", "pd_g2", None, 1.0)
