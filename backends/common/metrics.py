"""Custom metrics through the Python backend's metrics API (Triton's Prometheus endpoint). Outside the stub
every metric is a no-op, so roles can be unit-tested without Triton."""

from __future__ import annotations

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


class _Null:
    def set(self, v):
        pass

    def increment(self, v=1):
        pass

    def observe(self, v):
        pass

    def value(self):
        return 0


def _pb():
    try:
        import triton_python_backend_utils as pb_utils

        return pb_utils if hasattr(pb_utils, "MetricFamily") else None
    except ImportError:
        return None


class Metrics:
    def __init__(self, labels: dict[str, str]):
        self.labels = labels
        self._families = {}
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
        return self._family(name, desc, "HISTOGRAM").Metric(labels={**self.labels, **labels}, buckets=buckets)

    def _metric(self, name, desc, kind, labels):
        if self.pb is None:
            return _Null()
        return self._family(name, desc, kind).Metric(labels={**self.labels, **labels})
