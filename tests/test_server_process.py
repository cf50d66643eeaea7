"""SplitDeployment reads like one server for the perf tools: metrics from decode, RSS of every role's processes."""

from __future__ import annotations

import pytest

from backends.server_process import ServerProcess, SplitDeployment, exit_message


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


SCRAPE = """# HELP pd_kv_slots_used KV slots held by requests
# TYPE pd_kv_slots_used gauge
pd_kv_slots_used{model="pd_decode",version="1"} 3
pd_recoveries_total{model="pd_decode",version="1",path="host"} 2
pd_recoveries_total{model="pd_decode",version="1",path="prefill"} 5
"""


def test_snapshot_and_read_metrics_take_one_scrape(monkeypatch):
    """Values a backend sets together are read from one scrape (separate scrapes may fall between two of its
    updates); labels select samples and several matching ones add up; a metric without samples is a KeyError for
    snapshot and 0 for read_metrics, and an endpoint that does not answer gives read_metrics zeros."""
    s = object.__new__(ServerProcess)
    scrapes = []
    monkeypatch.setattr(s, "_scrape", lambda: scrapes.append(1) or SCRAPE, raising=False)
    specs = {"used": "pd_kv_slots_used", "host": ("pd_recoveries_total", {"path": "host"})}
    specs["all"] = "pd_recoveries_total"
    assert s.snapshot(specs) == {"used": 3.0, "host": 2.0, "all": 7.0}
    assert len(scrapes) == 1
    with pytest.raises(KeyError):
        s.snapshot({"x": "pd_kv_slots"})  # a prefix of a name is not that metric
    assert s.read_metrics({"used": "pd_kv_slots_used", "x": "pd_absent"}) == {"used": 3.0, "x": 0.0}
    assert len(scrapes) == 3

    def down():
        raise OSError("refused")

    monkeypatch.setattr(s, "_scrape", down, raising=False)
    assert s.read_metrics({"used": "pd_kv_slots_used"}) == {"used": 0.0}
    with pytest.raises(OSError):
        s.snapshot({"used": "pd_kv_slots_used"})


def test_the_stubs_embed_this_pythons_own_libpython(monkeypatch, tmp_path):
    """A Python built with a shared libpython outside the system's folders (pyenv's) puts that folder first on
    the stubs' library path: with the system's older libpython, the stub could not load this Python's `_ssl` and
    nothing that imports ssl (transformers, for the image processor) loaded in a role. A system Python adds
    nothing."""
    from backends import tritonserver

    (tmp_path / "libpython3.11.so.1.0").write_bytes(b"")
    values = {"LIBDIR": str(tmp_path), "INSTSONAME": "libpython3.11.so.1.0"}
    monkeypatch.setattr(tritonserver.sysconfig, "get_config_var", values.get)
    assert tritonserver.python_lib_dir() == [tmp_path]
    values["LIBDIR"] = "/usr/lib/x86_64-linux-gnu"
    assert tritonserver.python_lib_dir() == []
    values.update(LIBDIR=str(tmp_path), INSTSONAME="libpython3.11.a")  # a static build: nothing to put first
    assert tritonserver.python_lib_dir() == []


def test_an_exited_servers_message_keeps_tritons_error_lines():
    """A model's failed initialize is one `E` line far above the config table Triton prints as it stops: the
    message keeps it, and the log's end."""
    error = "E1207 13:13:10.1 1085 model_lifecycle.cc:654] failed to load 'pd_decode': ValueError: no room"
    log = "I1207 loading\n" + error + "\n" + "| a config row |\n" * 500 + "error: creating server: failed\n"
    msg = exit_message(log)
    assert error in msg and msg.endswith("error: creating server: failed\n") and len(msg) <= 3100
    assert exit_message("just the end\n") == "just the end\n"
