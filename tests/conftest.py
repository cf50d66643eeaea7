from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers on two cores: one thread each
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton's interpreter for the kernel tests that run on the CPU: it must be on before triton is first
    # imported, or triton.language's own helpers stay compiled-only and every interpreted kernel fails
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, torch.get_num_threads()))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`), every test that starts a tritonserver runs in one worker, one after
    another (`--dist loadgroup`), as in a serial run, while the other worker takes the in-process tests."""
    for item in items:
        if item.get_closest_marker("server"):
            item.add_marker(pytest.mark.xdist_group("server"))


@pytest.fixture(scope="session", autouse=True)
def _interpreter_calls():
    """In Triton's CPU interpreter, a kernel's calls of its @triton.jit helpers skip re-patching the language
    modules the launch patched already (tests/interpreter_calls.py): a third of an interpreted model's time."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from tests import interpreter_calls

    restore = interpreter_calls.install()
    yield
    restore()


@pytest.fixture(scope="module")
def ordered_dot():
    """For a module whose interpreted kernels are compared bit for bit: Triton's CPU interpreter computes tl.dot
    with a dot whose rounding does not depend on the BLAS build or the CPU (tests/interpreter_dot.py; the host's
    OPENBLAS_* variables are left as they are), for the module's tests, then as shipped again. On a GPU: nothing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from tests import interpreter_dot

    restore = interpreter_dot.install()
    yield
    restore()


@pytest.fixture(scope="session")
def smollm2_source():
    from backends.common.model import loader

    return loader.resolve("smollm2")


@pytest.fixture(scope="session")
def engine():
    """A shared fp32 SmolLM2 engine; tests must leave it idle (every request finished)."""
    from backends.common.engine.engine import Engine

    return Engine("smollm2", dtype="float32", device="cpu", kv_tokens=8192)


@pytest.fixture(scope="session")
def hf_model(smollm2_source):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_source.folder), dtype=torch.float32)
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers' own KV cache and no EOS stop."""
    out_ids = []
    with torch.no_grad():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            out_ids.append(tok)
            out = model(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return out_ids
