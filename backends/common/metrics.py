"""Custom metrics through the Python backend's metrics API (Triton's Prometheus endpoint).

Every metric operation of a process goes through one worker thread: the 2.51 Python backend crashes the server
(SIGSEGV in Metric::LoadFromSharedMemory) when several stub threads update metrics at once, and each update is an
inter-process message that the decode loop and the relay threads should not wait for. Outside the stub every
metric is a no-op, so roles can be unit-tested without Triton."""

from __future__ import annotations

import gc
import queue
import threading

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class _Null:
    def set(self, v):
        pass

    def increment(self, v=1):
        pass

    def observe(self, v):
        pass


class _Worker:
    _lock = threading.Lock()
    _instance = None

    def __init__(self):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="pd-metrics", daemon=True).start()

    @classmethod
    def get(cls) -> _Worker:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _loop(self):
        while True:
            fn, v = self.q.get()
            if fn is None:  # close(): every operation queued before has run
                v.set()
                return
            try:
                fn(v)
            except Exception:
                pass  # a metric must never take the server down

    @classmethod
    def close(cls, timeout: float = 5.0) -> None:
        """Run what is queued, then stop the thread (a later metric starts a new one)."""
        with cls._lock:
            worker, cls._instance = cls._instance, None
        if worker is not None:
            done = threading.Event()
            worker.q.put((None, done))
            done.wait(timeout)


class _Queued:
    """A metric whose operations run on the worker thread."""

    def __init__(self, metric):
        self._m = metric
        self._q = _Worker.get().q

    def set(self, v):
        if self._m is not None:
            self._q.put((self._m.set, float(v)))

    def increment(self, v=1):
        if v and self._m is not None:
            self._q.put((self._m.increment, float(v)))

    def observe(self, v):
        if self._m is not None:
            self._q.put((self._m.observe, float(v)))

    def release(self) -> None:
        self._m = None  # later operations are no-ops


def _pb():
    try:
        import triton_python_backend_utils as pb_utils

        return pb_utils if hasattr(pb_utils, "MetricFamily") else None
    except ImportError:
        return None


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
        return self._metric(name, desc, "HISTOGRAM", labels, buckets=buckets)

    def _metric(self, name, desc, kind, labels, **kw):
        if self.pb is None:
            return _Null()
        q = _Queued(self._family(name, desc, kind).Metric(labels={**self.labels, **labels}, **kw))
        self._metrics.append(q)
        return q

    def close(self) -> None:
        """Run the queued updates, then free every metric and family now, while the stub's shared memory is there;
        the roles' metric handles become no-ops."""
        _Worker.close()
        for q in self._metrics:
            q.release()
        self._metrics.clear()
        self._families.clear()
        gc.collect()  # a reference cycle may hold a metric; free it here, not at the interpreter's exit
