"""kernels.linear's tuning cache: picks kept across processes, merged under a lock, a broken file survived."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch

linear = pytest.importorskip("kernels.linear")
TuneCache = linear.TuneCache

PICK = {"block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 3, "dot": True, "norm": True}
TIMES = {"cublas": 1.9e-05, str(PICK): 1.7e-05, "{'block_n': 64}": "OutOfResources('shared memory')"}


def test_a_pick_comes_back_in_a_new_process(tmp_path):
    path = tmp_path / "tune.json"
    TuneCache(path).put("k", PICK, TIMES)
    fresh = TuneCache(path)
    assert fresh.get("k") == {"choice": PICK, "times": TIMES}
    assert fresh.get("other") is None
    assert (fresh.hits, fresh.misses) == (1, 1)
    TuneCache(path).put("none", None, {"cublas": 1e-5})  # cuBLAS won: None is a pick too
    assert TuneCache(path).get("none") == {"choice": None, "times": {"cublas": 1e-5}}


def _put(path, key):
    TuneCache(path).put(key, dict(PICK, block_n=int(key[1:])), {"cublas": 1.0})


@pytest.mark.slow  # `make test` only: too long for `make test-fast`
def test_writers_merge_their_entries(tmp_path):
    """Two caches that read the file before either wrote keep both entries; so do processes writing at once."""
    path = tmp_path / "tune.json"
    a, b = TuneCache(path), TuneCache(path)
    assert a.get("x") is None and b.get("y") is None
    a.put("x", PICK, TIMES)
    b.put("y", None, TIMES)
    entries = json.loads(path.read_text())["entries"]
    assert sorted(entries) == ["x", "y"]
    # forked, not spawned: a spawned child imports this module, torch and triton again (about 8 s of CPU each);
    # what is tested is the lock and the whole-file replace between processes, not a fresh interpreter
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_put, args=(path, f"p{i}")) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 3
    entries = json.loads(path.read_text())["entries"]
    assert sorted(entries) == sorted(["x", "y"] + [f"p{i}" for i in range(3)])
    assert entries["p2"]["choice"]["block_n"] == 2
    assert not list(tmp_path.glob("*.tmp"))


def test_a_broken_file_is_tuned_afresh_and_replaced(tmp_path, capsys):
    path = tmp_path / "tune.json"
    path.write_text('{"entries": {"k": ')  # cut off mid-write by something else
    c = TuneCache(path)
    assert c.get("k") is None and c.get("j") is None
    err = capsys.readouterr().err
    assert err.count("not read") == 1 and str(path) in err
    c.put("k", PICK, TIMES)
    assert TuneCache(path).get("k")["choice"] == PICK
    path.write_text('{"entries": {"k": {"choice": 3, "times": {}}}}')  # well-formed JSON, not an entry
    assert TuneCache(path).get("k") is None


def test_a_cache_that_cannot_be_written_keeps_picks_in_memory(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    c = TuneCache(blocker / "tune.json")  # its folder is a file
    c.put("k", PICK, TIMES)
    c.put("j", PICK, TIMES)
    assert c.get("k")["choice"] == PICK
    assert capsys.readouterr().err.count("not written") == 1


def test_picks_of_other_kernel_code_do_not_apply_and_are_replaced(tmp_path):
    path = tmp_path / "tune.json"
    TuneCache(path, code="old").put("k", PICK, TIMES)
    TuneCache(path, code="old").put("j", PICK, TIMES)
    new = TuneCache(path, code="new")
    assert new.get("k") is None and new.misses == 1
    new.put("i", None, TIMES)
    data = json.loads(path.read_text())
    assert data["code"] == "new" and sorted(data["entries"]) == ["i"]  # the old picks are gone, not piled up
    assert TuneCache(path, code="old").get("i") is None
    assert TuneCache(path).code == linear.TUNE_VERSION  # a declared version, not a hash of the files' bytes


def test_where_the_cache_lives(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_PD_TUNE_CACHE", raising=False)
    monkeypatch.setenv("TRITON_PD_CACHE", str(tmp_path))
    assert TuneCache.default_path() == tmp_path / "linear-tune.json"
    monkeypatch.setenv("TRITON_PD_TUNE_CACHE", str(tmp_path / "mine.json"))
    assert TuneCache.default_path() == tmp_path / "mine.json"
    monkeypatch.setenv("TRITON_PD_TUNE_CACHE", "off")
    assert TuneCache.default_path() is None
    off = TuneCache(None)
    off.put("k", PICK, TIMES)
    assert off.get("k") is None


def test_the_key_names_what_a_pick_depends_on():
    w = [torch.zeros(64, 32, dtype=torch.bfloat16)] * 3
    key = linear._tune_key(w, 8, "norm", 0, None)
    assert key == linear._tune_key(list(w), 8, "norm", 0, None)
    others = [
        linear._tune_key(w, 16, "norm", 0, None),
        linear._tune_key(w, 8, None, 0, None),
        linear._tune_key(w, 8, "norm", 16, None),
        linear._tune_key(w, 8, "norm", 0, "glu"),
        linear._tune_key(w[:2], 8, "norm", 0, None),
        linear._tune_key([torch.zeros(32, 64, dtype=torch.bfloat16)] * 3, 8, "norm", 0, None),
        linear._tune_key([x.half() for x in w], 8, "norm", 0, None),
    ]
    assert len({key, *others}) == 1 + len(others)
    assert triton_version() in key and torch.__version__ in key


def triton_version() -> str:
    import triton

    return triton.__version__
