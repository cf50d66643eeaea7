from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs three workers on two cores: one thread each
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from xdist.scheduler import LoadScopeScheduling  # noqa: E402

if not torch.cuda.is_available():
    # Triton's interpreter for the kernel tests that run on the CPU: it must be on before triton is first
    # imported, or triton.language's own helpers stay compiled-only and every interpreted kernel fails
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, torch.get_num_threads()))


# the modules whose tests start a tritonserver (marked `server`): under `make test`'s pytest-xdist, two work units
# of about 7 minutes each on 2 cores, which run beside each other while a third worker takes the in-process tests;
# the modules of SERVER_A form one unit, the others the second (the modules that share a session's server, such as
# test_serving and test_openai, or test_churn and test_fuzz, must stay in one unit, or it starts twice)
SERVER_MODULES = ("tests/server/", "tests/test_replay.py")
SERVER_A = ("tests/server/test_faults.py", "tests/server/test_liveness.py", "tests/server/test_multiserver.py",
            "tests/server/test_repository.py", "tests/server/test_tensor_parallel.py",
            "tests/test_replay.py")  # fmt: skip


def work_unit(nodeid: str) -> str:
    """`make test`'s work unit of a test: "server-a" or "server-b" for the tests of SERVER_MODULES, else the test
    itself."""
    path = nodeid.split("::", 1)[0]
    if not path.startswith(SERVER_MODULES):
        return nodeid
    return "server-a" if path in SERVER_A else "server-b"


class ServerUnits(LoadScopeScheduling):
    """The tests of SERVER_MODULES as two work units, each run one after another in one worker (module- and
    session-scoped servers started once) and sent first, as the largest units; each other test a unit of its own
    for any worker. xdist's own grouping by `xdist_group` marks renames node ids, which pytest 9.2's structured ids
    ignore (pytest-xdist issue #1386): the server tests were spread test by test over the workers, and a module's
    server started again whenever a worker switched modules."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (`make test`): ServerUnits."""
    return ServerUnits(config, log) if config.getvalue("dist") == "loadgroup" else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test that starts a tritonserver must live in SERVER_MODULES (the scheduler above sees node ids only)."""
    stray = [i.nodeid for i in items if i.get_closest_marker("server") and work_unit(i.nodeid) == i.nodeid]
    if stray:
        raise pytest.UsageError(f"tests marked server outside {SERVER_MODULES} (tests/conftest.py): {stray}")


def _interpreter_patch(name: str):
    """A fixture's body: tests/<name>.py's patch of Triton's CPU interpreter (`install`) for the fixture's scope,
    then the interpreter as shipped again; nothing on a GPU."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import importlib

    restore = importlib.import_module(f"tests.{name}").install()
    yield
    restore()


@pytest.fixture(scope="session", autouse=True)
def _interpreter_calls():
    """In Triton's CPU interpreter, a kernel's calls of its @triton.jit helpers skip re-patching the language
    modules the launch patched already (tests/interpreter_calls.py): about a quarter of an interpreted model's time."""
    yield from _interpreter_patch("interpreter_calls")


@pytest.fixture(scope="module")
def ordered_dot():
    """For a module whose interpreted kernels are compared bit for bit: Triton's CPU interpreter computes tl.dot
    with a dot whose rounding does not depend on the BLAS build or the CPU (tests/interpreter_dot.py; the host's
    OPENBLAS_* variables are left as they are), for the module's tests, then as shipped again. On a GPU: nothing."""
    yield from _interpreter_patch("interpreter_dot")


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
