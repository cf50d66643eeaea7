"""SplitDeployment reads like one server for the perf tools: metrics from decode, RSS of every role's processes."""

from __future__ import annotations

from backends.server_process import SplitDeployment


class FakeServer:
    def __init__(self, rss: dict, metrics: dict | None = None):
        self.rss, self.metrics_seen = rss, metrics or {}

    def process_rss(self) -> dict:
        return dict(self.rss)

    def read_metrics(self, specs: dict) -> dict:
        return {k: self.metrics_seen.get(v if isinstance(v, str) else v[0], 0.0) for k, v in specs.items()}


def test_split_deployment_names_each_role_and_reads_decode_metrics():
    d = object.__new__(SplitDeployment)  # without starting servers
    p0, p1 = FakeServer({"tritonserver": 1, "pd_prefill_0_0": 2}), FakeServer({"tritonserver": 3})
    dec = FakeServer({"tritonserver": 4, "pd_decode_0_0": 5}, {"pd_kv_slots_used": 7.0})
    mas = FakeServer({"tritonserver": 6, "pd_master_0_0": 8})
    d.servers, d.decode, d.master = [p0, p1, dec, mas], dec, mas
    assert d.process_rss() == {
        "prefill0:tritonserver": 1, "prefill0:pd_prefill_0_0": 2, "prefill1:tritonserver": 3,
        "decode:tritonserver": 4, "decode:pd_decode_0_0": 5, "master:tritonserver": 6, "master:pd_master_0_0": 8,
    }  # fmt: skip
    assert d.read_metrics({"used": "pd_kv_slots_used", "x": ("pd_absent", {})}) == {"used": 7.0, "x": 0.0}
