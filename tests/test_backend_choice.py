"""ModelRunner's backend choice: argument, TRITON_PD_BACKEND override, and the interpreter switch on the CPU."""

from __future__ import annotations

import pytest
import torch

from backends.common.engine.runner import pick_backend

CPU = torch.device("cpu")


def test_auto_on_cpu_is_plain_pytorch(monkeypatch):
    monkeypatch.delenv("TRITON_PD_BACKEND", raising=False)
    assert pick_backend("auto", CPU) == "torch"


def test_environment_overrides_the_argument(monkeypatch):
    monkeypatch.setenv("TRITON_PD_BACKEND", "torch")
    assert pick_backend("triton", CPU) == "torch"


def test_unknown_backend_is_named(monkeypatch):
    monkeypatch.setenv("TRITON_PD_BACKEND", "cuda")
    with pytest.raises(ValueError, match="backend must be one of auto, triton, torch, got 'cuda'"):
        pick_backend("auto", CPU)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_PD_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        pick_backend("triton", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pick_backend("triton", CPU) == "triton"
