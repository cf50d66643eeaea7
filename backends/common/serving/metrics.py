"""Custom metrics through the Python backend's metrics API (Triton's Prometheus endpoint).

Every metric operation of a process goes through one worker thread: the 2.51 Python backend crashes the server
(SIGSEGV in Metric::LoadFromSharedMemory) when several stub threads update metrics at once, and each update is an
inter-process message that the decode loop and the relay threads should not wait for.

Updates are coalesced: a gauge sends its last value, a counter the sum of its increments, and a histogram is kept as
Prometheus keeps one, cumulative `<name>_bucket{le=...}`, `<name>_sum` and `<name>_count` counters, so that a burst
of observations is one increment per bucket touched. The worker sends what changed as soon as it is idle, then at
most every FLUSH_INTERVAL seconds while updates keep coming. Each message is a blocking round trip between the
stub and tritonserver (with the free-while-waking hand-off described in docs/operations.md), and
pd_master used to send one per token generated (its inter-token latency histogram). Coalescing did not remove the
512+-stream crash.

Outside the stub every metric is a no-op, so roles can be unit-tested without Triton."""

from __future__ import annotations

import bisect
import gc
import threading
import time

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
FLUSH_INTERVAL = 0.05  # seconds between two sends while updates keep coming


class _Null:
    def set(self, v):
        pass

    def increment(self, v=1):
        pass

    def observe(self, v):
        pass


class _Worker:
    """The one thread that calls the metrics API; holds the metrics with updates not yet sent."""

    _lock = threading.Lock()  # guards _instance
    _instance = None

    def __init__(self):
        self.lock = threading.Lock()  # guards `dirty` and every metric's pending values
        self.dirty: dict[int, object] = {}
        self.wake = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="pd-metrics", daemon=True)
        self.thread.start()

    @classmethod
    def get(cls) -> _Worker:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def mark(self, m) -> None:
        """Called with self.lock held, after m's pending values changed."""
        self.dirty[id(m)] = m
        self.wake.set()

    def flush(self) -> None:
        with self.lock:
            todo, self.dirty = list(self.dirty.values()), {}
            ops = [op for m in todo for op in m.take()]
        for fn, v in ops:
            try:
                fn(v)
            except Exception:
                pass  # a metric must never take the server down

    def _loop(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            if self.stopped:
                return
            self.flush()
            time.sleep(FLUSH_INTERVAL)

    @classmethod
    def close(cls, timeout: float = 5.0) -> None:
        """Stop the thread, then send what is pending (a later metric starts a new worker)."""
        with cls._lock:
            worker, cls._instance = cls._instance, None
        if worker is not None:
            worker.stopped = True
            worker.wake.set()
            worker.thread.join(timeout)
            worker.flush()


class _Queued:
    """A gauge or counter whose updates the worker sends, coalesced."""

    def __init__(self, metric):
        self._m = metric
        self._w = _Worker.get()
        self._value = None  # a gauge's last value not yet sent
        self._delta = 0.0  # a counter's increments not yet sent

    def set(self, v):
        if self._m is not None:
            with self._w.lock:
                self._value = float(v)
                self._w.mark(self)

    def increment(self, v=1):
        if v and self._m is not None:
            with self._w.lock:
                self._delta += float(v)
                self._w.mark(self)

    def take(self) -> list:
        """The API calls for what is pending, and nothing pending after (called with the worker's lock held)."""
        if self._m is None:
            return []
        ops = []
        if self._value is not None:
            ops.append((self._m.set, self._value))
        if self._delta:
            ops.append((self._m.increment, self._delta))
        self._value, self._delta = None, 0.0
        return ops

    def release(self) -> None:
        self._m = None  # later operations are no-ops


class _Histogram:
    """A Prometheus histogram kept as counters: cumulative `_bucket{le}`, `_sum` and `_count`."""

    def __init__(self, buckets: list[float], bucket_metrics: list, sum_metric, count_metric):
        self.bounds = list(buckets)
        self._buckets, self._sum, self._count = bucket_metrics, sum_metric, count_metric  # buckets: len(bounds) + 1
        self._w = _Worker.get()
        self._hits = [0] * (len(self.bounds) + 1)  # observations per bucket (not cumulative), +Inf last
        self._total = 0.0

    def observe(self, v):
        if self._sum is None:
            return
        v = float(v)
        with self._w.lock:
            self._hits[bisect.bisect_left(self.bounds, v)] += 1  # le is inclusive
            self._total += v
            self._w.mark(self)

    def take(self) -> list:
        if self._sum is None or not any(self._hits):
            return []
        ops, running = [], 0
        for metric, hits in zip(self._buckets, self._hits):
            running += hits
            if running:
                ops.append((metric.increment, float(running)))
        ops += [(self._sum.increment, self._total), (self._count.increment, float(running))]
        self._hits, self._total = [0] * len(self._hits), 0.0
        return ops

    def release(self) -> None:
        self._buckets, self._sum, self._count = [], None, None


class Metrics:
    """Keep this object alive as long as its metrics: a MetricFamily must outlive its Metric objects. A role calls
    close() in its finalize(): left to the interpreter's exit, a family's destructor wrote to the stub's shared
    memory after it was gone (SIGSEGV in Metric::SaveToSharedMemory under Py_FinalizeEx, a core file at each stop)."""

    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self._families = {}
        self._metrics = []
        self.pb = _pb()

    def _family(self, name, desc, kind):
        if name not in self._families:
            fam = self.pb.MetricFamily
            self._families[name] = fam(name=name, description=desc, kind=getattr(fam, kind))
        return self._families[name]

    def gauge(self, name: str, desc: str, **labels):
        return self._metric(name, desc, "GAUGE", labels)

    def counter(self, name: str, desc: str, **labels):
        return self._metric(name, desc, "COUNTER", labels)

    def histogram(self, name: str, desc: str, buckets=LATENCY_BUCKETS, **labels):
        if self.pb is None:
            return _Null()
        base = {**self.labels, **labels}
        les = [f"{b:g}" for b in buckets] + ["+Inf"]
        fam = self._family(f"{name}_bucket", f"{desc} (cumulative count of observations <= le)", "COUNTER")
        bucket_metrics = [fam.Metric(labels={**base, "le": le}) for le in les]
        total = self._family(f"{name}_sum", f"{desc} (sum of observations)", "COUNTER").Metric(labels=base)
        count = self._family(f"{name}_count", f"{desc} (number of observations)", "COUNTER").Metric(labels=base)
        h = _Histogram(buckets, bucket_metrics, total, count)
        self._metrics.append(h)
        return h

    def _metric(self, name, desc, kind, labels):
        if self.pb is None:
            return _Null()
        q = _Queued(self._family(name, desc, kind).Metric(labels={**self.labels, **labels}))
        self._metrics.append(q)
        return q

    def close(self) -> None:
        """Send the pending updates, then free every metric and family now, while the stub's shared memory is
        there; the roles' metric handles become no-ops."""
        _Worker.close()
        for m in self._metrics:
            m.release()
        self._metrics.clear()
        self._families.clear()
        gc.collect()  # a reference cycle may hold a metric; free it here, not at the interpreter's exit


def _pb():
    try:
        import triton_python_backend_utils as pb_utils

        return pb_utils if hasattr(pb_utils, "MetricFamily") else None
    except ImportError:
        return None
