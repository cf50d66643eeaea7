"""Instance placement (pure Python): the instance_group entries `triton-pd serve` renders across GPUs, and the
CPU threads each compute instance gets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from backends.common.engine.runner import set_cpu_threads
from backends.common.engine.sizing import cpu_threads_per_instance, default_host_kv_tokens
from backends.deployment import instance_groups, parse_gpus

ROOT = Path(__file__).resolve().parents[1]


def test_two_prefill_one_decode_on_three_gpus():
    assert instance_groups(2, True, "1,2", 3, "--prefill-gpus") == (
        "{ count: 1 kind: KIND_GPU gpus: [ 1 ] }, { count: 1 kind: KIND_GPU gpus: [ 2 ] }"
    )
    assert instance_groups(1, True, "0", 3, "--decode-gpus") == "{ count: 1 kind: KIND_GPU gpus: [ 0 ] }"


def test_round_robin_and_same_gpu_layout():
    # 3 instances over 2 GPUs: two on the first, one on the second; the one-GPU run of the 2P1D layout
    assert instance_groups(3, True, "0,1", 2) == (
        "{ count: 2 kind: KIND_GPU gpus: [ 0 ] }, { count: 1 kind: KIND_GPU gpus: [ 1 ] }"
    )
    assert instance_groups(2, True, "0", 1) == "{ count: 2 kind: KIND_GPU gpus: [ 0 ] }"
    assert instance_groups(2, False, "7", 0) == "{ count: 2 kind: KIND_CPU }"  # CPU ignores the GPU list


@pytest.mark.parametrize(
    "gpus,available,needle", [("0,3", 2, "names GPU 3"), ("a", 2, "comma-separated"), ("", 2, "names no GPU")]
)
def test_bad_gpu_lists_name_the_flag(gpus, available, needle):
    with pytest.raises(SystemExit) as e:
        parse_gpus(gpus, available, "--prefill-gpus")
    assert "--prefill-gpus" in str(e.value) and needle in str(e.value)


def test_cpu_threads_divide_the_usable_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpu_threads_per_instance(2) == 4  # 1 prefill + 1 decode on 8 cores
    assert cpu_threads_per_instance(3) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert cpu_threads_per_instance(2) == 1  # the CI machine: never 2 + 2 threads on 2 cores
    assert cpu_threads_per_instance(5) == 1


def test_compute_instances_take_their_thread_count():
    before = torch.get_num_threads()
    try:
        set_cpu_threads(1)
        assert torch.get_num_threads() == 1
        set_cpu_threads(0)  # 0: unchanged
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_host_kv_default_is_four_pools_within_a_quarter_of_ram_per_decode_instance(monkeypatch):
    from backends.common.engine import sizing

    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": (64 << 30) // 4096}  # 64 GiB of RAM
    monkeypatch.setattr(sizing.os, "sysconf", pages.__getitem__)
    mib = 1 << 20  # KV bytes per token
    assert default_host_kv_tokens(mib, 1000) == 4000
    assert default_host_kv_tokens(mib, 100_000) == 16 * 1024  # 16 GiB: a quarter of RAM
    assert default_host_kv_tokens(mib, 100_000, instances=4) == 4 * 1024
    assert default_host_kv_tokens(mib, 100_000, page_bytes=6 << 30) == 10 * 1024  # host state pages come first
    assert default_host_kv_tokens(mib, 100_000, page_bytes=20 << 30) == 0


def test_host_tier_is_on_by_default_for_hybrid_models_with_its_state_pages_counted(monkeypatch):
    """A hybrid model's decode gets a host tier as a dense model's does (four pools within a quarter of RAM), less
    the bytes of its host state pages (one per host copy: --max-batch of them, at most 64)."""
    from backends.common.core.role_config import DecodeConfig
    from backends.common.engine import sizing
    from backends.common.model import loader

    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": (64 << 30) // 4096}  # 64 GiB of RAM
    monkeypatch.setattr(sizing.os, "sysconf", pages.__getitem__)
    cfg = loader.load_config(loader.resolve("random:qwen3.5-9b"))
    per_token = sizing.kv_bytes_per_token(cfg, "float32")  # the CPU's dtype
    page_bytes = cfg.state_page_bytes()
    roomy = sizing.resolve_decode(DecodeConfig(kv_tokens=8192), cfg, gpu=False, device=0, instances=1)
    assert roomy.host_kv_tokens == 4 * 8192 and cfg.is_hybrid
    big = sizing.resolve_decode(DecodeConfig(kv_tokens=10**6), cfg, gpu=False, device=0, instances=1)
    assert big.host_kv_tokens == ((16 << 30) - 64 * page_bytes) // per_token
    small = sizing.resolve_decode(DecodeConfig(kv_tokens=10**6, max_batch=8), cfg, gpu=False, device=0, instances=1)
    assert small.host_kv_tokens == ((16 << 30) - 8 * page_bytes) // per_token
    off = sizing.resolve_decode(DecodeConfig(kv_tokens=8192, host_kv_tokens=0), cfg, gpu=False, device=0, instances=1)
    assert off.host_kv_tokens == 0


def test_deployment_values_fill_every_template_and_reach_the_configs(tmp_path):
    from backends.cli import build_parser
    from backends.deployment import Deployment
    from backends.tritonserver import MODELS, render

    a = build_parser().parse_args(
        ["serve", "--device", "cpu", "--kv-tokens", "1000", "--host-kv-tokens", "0", "--max-streams", "7",
         "--workdir", str(tmp_path), "--request-timeout", "-1"]
    )  # fmt: skip
    dep = Deployment.from_args(a, n_gpus=0)
    assert (dep.gpu, dep.dtype, dep.kv_tokens, dep.host_kv_tokens) == (False, "float32", 1000, 0)
    assert dep.request_timeout == -1 and dep.prefill_groups == "{ count: 1 kind: KIND_CPU }"
    dep.write_key()
    assert len(dep.key_file.read_text()) == 48 and (dep.key_file.stat().st_mode & 0o077) == 0
    repo = render(tmp_path / "models", dep.template_values())  # string.Template.substitute: a missing value raises
    configs = {m: (repo / m / "config.pbtxt").read_text() for m in MODELS}
    assert all("${" not in c for c in configs.values())
    decode, prefill, master = (config_of(configs[m]) for m in ("pd_decode", "pd_prefill", "pd_master"))
    assert decode.kv_tokens == 1000 and decode.host_kv_tokens == 0 and master.max_streams == 7
    assert master.request_timeout == -1 and prefill.internal_key_file == str(dep.key_file)
    assert master.mailbox_dir == decode.mailbox_dir == str(dep.mailbox)


def config_of(pbtxt: str):
    """The role config a rendered config.pbtxt holds, read as Triton reads it (protobuf text format)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from backends.common.core.role_config import DecodeConfig, MasterConfig, PrefillConfig

    mc = text_format.Parse(pbtxt, model_config_pb2.ModelConfig())
    assert set(mc.parameters) == {"project_root", "config"}  # a role reads its config and nothing else
    cls = {"pd_decode": DecodeConfig, "pd_prefill": PrefillConfig, "pd_master": MasterConfig}[mc.name]
    return cls.from_json(mc.parameters["config"].string_value)


def test_max_streams_defaults_to_what_decode_can_run_at_once(tmp_path):
    from backends.cli import build_parser
    from backends.deployment import Deployment

    def deploy(*extra):
        a = build_parser().parse_args(["serve", "--device", "cpu", "--workdir", str(tmp_path), *extra])
        return Deployment.from_args(a, n_gpus=0)

    assert deploy().max_streams == 256  # one decode instance, --max-batch 256
    assert deploy("--decode-instances", "2", "--max-batch", "128").max_streams == 256
    assert deploy("--max-batch", "2").max_streams == 64  # the floor: small batches still queue on decode
    assert deploy("--max-streams", "9").max_streams == 9
