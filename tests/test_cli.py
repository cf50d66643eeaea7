"""`triton-pd generate --offline`: JSON output, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "backends.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_offline_generate_json_chat():
    r = run_cli(
        "generate",
        "--offline",
        "--model",
        "smollm2",
        "--prompt",
        "What is the capital of France?",
        "--chat",
        "--max-tokens",
        "30",
        "--temperature",
        "0",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["text"] == "The capital of France is Paris."
    assert out["finish_reason"] == "stop" and out["output_ids"][-1] == 2


def test_offline_generate_plain_length():
    r = run_cli(
        "generate",
        "--offline",
        "--prompt",
        "1, 2, 3, 4,",
        "--max-tokens",
        "5",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "7",
        "--ignore-eos",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(out["output_ids"]) == 5 and out["finish_reason"] == "length"


@pytest.mark.parametrize(
    "args,needle",
    [
        # two in `make test-fast`, the rest in `make test` (each a CLI process importing torch: about 4 s)
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--max-tokens", "0"], "max_tokens: must be > 0"),
        *(
            pytest.param(args, needle, marks=pytest.mark.slow)
            for args, needle in [
                (["--model", "/nonexistent/model.gguf"], "GGUF file not found: /nonexistent/model.gguf"),
                (["--model", "random:gpt-17"], "unknown random shape 'gpt-17'"),
                (["--top-p", "1.5"], "top_p: must be in (0, 1]"),
                (["--top-p", "0"], "top_p: must be in (0, 1]"),
                (["--temperature", "-1"], "temperature: must be a number >= 0"),
                (["--prompt-file-too-long"], "prompt: has"),
                (["--model", "random:smollm2-135m", "--tp", "2"], "num_heads (9) is not divisible by the 2 ranks"),
            ]
        ),
    ],
)
def test_bad_input_one_line_error(args, needle):
    base = ["generate", "--offline", "--max-tokens", "4"]
    if args == ["--prompt-file-too-long"]:
        args = ["--prompt", "word " * 9000]
    else:
        args = ["--prompt", "hi", *args]
    r = run_cli(*base, *args)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("[triton-pd]")]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr and needle in lines[0]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--role", "decode", "--internal-key-file", "KEY"], "--role decode needs --prefill-urls"),
        (["--role", "master", "--internal-key-file", "KEY"], "--role master needs --decode-urls"),
        (
            ["--role", "prefill", "--prefill-urls", "h:1", "--internal-key-file", "KEY"],
            "--prefill-urls is for --role decode",
        ),  # fmt: skip
        (["--role", "prefill"], "--role prefill needs --internal-key-file"),
        (["--role", "decode", "--prefill-urls", "nohost", "--internal-key-file", "KEY"], "'nohost' is not host:port"),
        (["--role", "prefill", "--internal-key-file", "/nonexistent/key"], "/nonexistent/key is missing or empty"),
        (["--exit-timeout", "-1"], "--exit-timeout: must be >= 0"),
        (["--rotation-wait", "-0.5"], "--rotation-wait: must be >= 0, got -0.5"),
        (["--prefill-concurrency", "0"], "--prefill-concurrency: must be >= 1, got 0"),
        (["--decode-tp", "3"], "--decode-tp 3: tp: num_heads (4) is not divisible by the 3 ranks"),
        (["--decode-tp", "2", "--device", "gpu"], "--decode-tp 2: tensor parallelism runs on the CPU path"),
        (["--decode-tp", "2", "--speculative", "ngram"], "--decode-tp 2: speculative decoding does not run"),
        (["--prefill-tp", "2", "--model", "random:tiny-hybrid"], "--prefill-tp 2: hybrid models' state pages"),
    ],
)
def test_serve_roles_refuse_incomplete_deployments(args, needle, tmp_path, capsys):
    """In this process (the checks run before any server starts): exit status 2 and one line naming the option."""
    from backends.cli import main

    key = tmp_path / "key"
    assert main(["key", str(key)]) == 0 and len(key.read_text()) == 48
    assert key.stat().st_mode & 0o777 == 0o600
    capsys.readouterr()
    rc = main(["serve", "--model", "random:tiny-test", "--workdir", str(tmp_path / "w"),
               *[str(key) if a == "KEY" else a for a in args]])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port", "--metrics-port"])
def test_serve_refuses_a_port_in_use_naming_it(flag, tmp_path, capsys):
    """Before anything starts: tritonserver would load every model, then fail to bind, while the process that
    holds the port answered the launcher's readiness probe (seen with four role servers on one host)."""
    import socket

    from backends.cli import main
    from backends.server_process import free_ports

    ports = dict(zip(("--http-port", "--grpc-port", "--metrics-port"), free_ports(3)))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", ports[flag]))
        holder.listen()
        rc = main(["serve", "--model", "random:tiny-test", "--workdir", str(tmp_path / "w"),
                   *[str(x) for kv in ports.items() for x in kv]])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and f"{flag} {ports[flag]}: already in use" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "w" / "tritonserver.log").exists()  # nothing was started
