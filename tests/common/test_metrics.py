"""backends.common.metrics against a fake of the Python backend's metrics API: every update runs on one worker
thread, and close() frees the metrics and families before it returns (while a stub's shared memory is there)."""

from __future__ import annotations

import threading
import weakref

from backends.common import metrics as mod


class FakeMetric:
    def __init__(self, labels, log):
        self.labels, self.log = labels, log

    def set(self, v):
        self.log.append(("set", self.labels["k"], v, threading.current_thread().name))

    def increment(self, v):
        self.log.append(("inc", self.labels["k"], v, threading.current_thread().name))

    def observe(self, v):
        self.log.append(("obs", self.labels["k"], v, threading.current_thread().name))


class FakeFamily:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
    log: list = []
    made: list = []

    def __init__(self, name, description, kind):
        self.name = name
        FakeFamily.made.append(weakref.ref(self))

    def Metric(self, labels, **kw):  # noqa: N802 (the Python backend's name)
        m = FakeMetric(labels, FakeFamily.log)
        FakeFamily.made.append(weakref.ref(m))
        return m


class FakePb:
    MetricFamily = FakeFamily


def test_updates_run_in_order_on_one_thread_and_close_frees_everything(monkeypatch):
    monkeypatch.setattr(mod, "_pb", lambda: FakePb)
    FakeFamily.log, FakeFamily.made = [], []
    m = mod.Metrics({"model": "x"})
    g = m.gauge("pd_g", "a gauge", k="g")
    c = m.counter("pd_c", "a counter", k="c")
    h = m.histogram("pd_h", "a histogram", k="h")
    done = []
    threads = [threading.Thread(target=lambda i=i: (g.set(i), c.increment(1), done.append(i))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    h.observe(0.5)
    c.increment(0)  # a zero increment is not sent
    m.close()  # runs what was queued first
    assert len(FakeFamily.log) == 8 + 8 + 1
    assert {name for *_, name in FakeFamily.log} == {"pd-metrics"}
    assert FakeFamily.log[-1][:3] == ("obs", "h", 0.5)
    assert sum(v for op, _, v, _ in FakeFamily.log if op == "inc") == 8
    # every metric and family is gone once close() returns, though the role still holds its handles
    assert FakeFamily.made and all(r() is None for r in FakeFamily.made)
    g.set(3.0)
    c.increment(2)
    assert len(FakeFamily.log) == 17  # handles are no-ops after close
    # a later Metrics (a model reloaded in the same stub) gets a fresh worker
    m2 = mod.Metrics({"model": "y"})
    m2.gauge("pd_g2", "again", k="g2").set(1.0)
    m2.close()
    assert FakeFamily.log[-1][:3] == ("set", "g2", 1.0)
