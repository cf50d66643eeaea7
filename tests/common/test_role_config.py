"""Each role's typed config: `serve`'s options are generated from its fields, a role given no config runs with
`serve`'s defaults, the rendered JSON survives config.pbtxt as Triton parses it, and bad values are refused with
the role and the field named."""

from __future__ import annotations

import dataclasses
import string
from pathlib import Path

import pytest

from backends.cli import build_parser
from backends.common.core.role_config import (
    DEFAULT_MAX_STREAMS,
    ROLES,
    DecodeConfig,
    MasterConfig,
    PrefillConfig,
    cli_fields,
    mailbox_dir,
    pbtxt_string,
    read_key,
)
from backends.common.engine import sizing
from backends.common.model.loader import load_config, resolve
from backends.deployment import Deployment

ROOT = Path(__file__).resolve().parents[2]
WIRING = {"model", "internal_key_file", "deployment", "mailbox_dir"}  # set per deployment by serve


def serve_args(*extra):
    return build_parser().parse_args(["serve", "--device", "cpu", "--model", "random:tiny-test", *extra])


def test_every_config_field_has_one_serve_option_of_its_type_and_default():
    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith(" serve"))
    options = {a.dest: a for a in serve._actions}
    for f in cli_fields():
        opt = options[f.name]  # KeyError: a field without its option
        assert opt.option_strings == ["--" + f.name.replace("_", "-")]
        assert opt.default == f.metadata.get("flag_default", f.default), f.name
        assert (opt.choices and tuple(opt.choices)) == (f.metadata["choices"] or None), f.name
        assert opt.help == f.metadata["help"]
    fields_of = {f.name for cls in ROLES for f in dataclasses.fields(cls)}
    assert {f.name for f in cli_fields()} == fields_of - {"internal_key_file", "deployment", "mailbox_dir"}


def test_a_role_given_no_config_runs_with_serves_defaults(tmp_path):
    """What a role resolves from an empty config on this machine equals what `serve` renders with no options,
    field by field, except the deployment's own wiring (its id, key file and mailbox)."""
    dep = Deployment.from_args(serve_args("--model", "smollm2", "--workdir", str(tmp_path)), n_gpus=0)
    model_cfg = load_config(resolve("smollm2"))
    roles = {
        "decode": (sizing.resolve_decode(DecodeConfig(), model_cfg, False, 0, 1), dep.decode),
        "prefill": (sizing.resolve_prefill(PrefillConfig(), model_cfg, False, 1), dep.prefill),
        "master": (MasterConfig(), dep.master),
    }
    for role, (alone, served) in roles.items():
        for f in dataclasses.fields(alone):
            if f.name in WIRING:
                continue
            mine, theirs = getattr(alone, f.name), getattr(served, f.name)
            if role == "master" and f.name == "max_streams":
                mine = mine or DEFAULT_MAX_STREAMS  # 0: the role's default, which serve computes the same
            assert mine == theirs, (role, f.name, mine, theirs)


def test_configs_round_trip_through_config_pbtxt_as_triton_parses_it(tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    odd = DecodeConfig(model="/models/it's here\\v2", fault_injection='stale,"quoted"', kv_tokens=77)
    template = string.Template((ROOT / "model_repository" / "pd_decode" / "config.pbtxt").read_text())
    text = template.substitute(PROJECT_ROOT="/x", DECODE_GROUPS="{ count: 1 kind: KIND_CPU }",
                               DECODE_CONFIG=pbtxt_string(odd.to_json()))  # fmt: skip
    mc = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert DecodeConfig.from_json(mc.parameters["config"].string_value) == odd
    for cls in ROLES:
        assert cls.from_json(cls().to_json()) == cls() == cls.from_json("") == cls.from_json(None)


@pytest.mark.parametrize(
    "cls,text,needle",
    [
        (DecodeConfig, '{"kv_tokenz": 5}', "pd_decode config: unknown field 'kv_tokenz'"),
        (DecodeConfig, '{"kv_tokens": "5"}', "pd_decode config: 'kv_tokens' must be int, got '5'"),
        (DecodeConfig, '{"max_batch": true}', "'max_batch' must be int, got True"),
        (DecodeConfig, '{"max_batch": 0}', "'max_batch' must be >= 1, got 0"),
        (DecodeConfig, '{"rotation_wait": -1}', "'rotation_wait' must be >= 0, got -1"),
        (DecodeConfig, '{"pause_policy": "newest"}', "'pause_policy' must be one of latest, oldest, longest"),
        (DecodeConfig, '{"host_kv_tokens": 1.5}', "'host_kv_tokens' must be int or null, got 1.5"),
        (PrefillConfig, '{"chunk_size": 0}', "pd_prefill config: 'chunk_size' must be >= 1"),
        (MasterConfig, '{"max_streams": -2}', "pd_master config: 'max_streams' must be >= 0"),
        (MasterConfig, "[1, 2]", "pd_master config: must be a JSON object, got list"),
        (MasterConfig, "{max_streams: 2}", "pd_master config: malformed JSON"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(cls, text, needle):
    with pytest.raises(ValueError) as e:
        cls.from_json(text)
    assert needle in str(e.value)


def test_numbers_and_nulls_where_the_type_allows():
    c = DecodeConfig.from_json('{"rotation_quantum": 0, "host_kv_tokens": null, "kv_memory_fraction": 1}')
    assert c.rotation_quantum == 0.0 and isinstance(c.rotation_quantum, float) and c.host_kv_tokens is None
    assert isinstance(c.kv_memory_fraction, float)


def test_the_internal_key_file_is_required_and_read(tmp_path):
    with pytest.raises(ValueError, match="'internal_key_file' is required"):
        read_key(MasterConfig())
    key = tmp_path / "key"
    key.write_text("secret\n")
    assert read_key(MasterConfig(internal_key_file=str(key))) == "secret"
    assert mailbox_dir(MasterConfig(deployment="d1")) == "/dev/shm/triton-pd-d1"
    assert mailbox_dir(MasterConfig(mailbox_dir="/tmp/m")) == "/tmp/m"


def test_serve_options_reach_the_roles_configs(tmp_path):
    dep = Deployment.from_args(
        serve_args("--workdir", str(tmp_path), "--prefill-concurrency", "3", "--prefill-max-batch", "5",
                   "--rotation-wait", "0.5", "--kv-backend", "gloo", "--max-inflight", "9"),
        n_gpus=0,
    )  # fmt: skip
    assert (dep.decode.prefill_concurrency, dep.decode.rotation_wait, dep.decode.kv_backend) == (3, 0.5, "gloo")
    assert dep.prefill.prefill_max_batch == 5 and dep.master.max_inflight == 9
    assert dep.decode.deployment == dep.prefill.deployment == dep.master.deployment == dep.deployment_id


@pytest.mark.parametrize("extra,want", [((), "off"), (("--deterministic",), "on"), (("--deterministic", "off"), "off")])
def test_deterministic_reaches_prefill_and_decode_alike(tmp_path, extra, want):
    """`--deterministic` alone means on; prefill and decode must agree, or a recomputed K/V would differ."""
    dep = Deployment.from_args(serve_args("--workdir", str(tmp_path), *extra), n_gpus=0)
    assert dep.decode.deterministic == dep.prefill.deterministic == want


def test_deterministic_refuses_a_hybrid_model_on_the_gpu_before_starting(tmp_path):
    args = build_parser().parse_args(
        ["serve", "--device", "gpu", "--model", "random:qwen3.5-9b", "--workdir", str(tmp_path), "--deterministic"]
    )
    with pytest.raises(ValueError, match="--deterministic: hybrid"):
        Deployment.from_args(args, n_gpus=1)
