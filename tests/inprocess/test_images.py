"""Qwen3.5 with images through the three roles in one process (tests/inprocess/fake_triton.py): pd_master's
`image` input (base64 PNG), master expanding the prompt, decode carrying the request's image info, prefill
encoding the images once and keeping them under the request's id until decode says the request ended. Answers
equal the offline engine's (which equal transformers', tests/hybrid/test_vision.py) unpaused, and through pauses
recovered by prefill, by host swap-in and from decode's own cache; every recovery reuses what prefill kept; the gauges
are back to 0 after a finish, a cancel and a refused request."""

from __future__ import annotations

import base64
import time

import pytest

from backends.common.core.request import ReqState, SamplingParams
from tests.hybrid.conftest import hybrid_folder, make_engine  # noqa: F401 (fixtures)
from tests.hybrid.test_vision import END, IMAGE, START, _save, png
from tests.inprocess.fake_triton import Server, generate

N_OUT = 80


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    return _save(tmp_path_factory, moe=False)[0]


@pytest.fixture(scope="module")
def engine(vl_folder):
    return make_engine(vl_folder)


@pytest.fixture
def serve(serve_model):
    return serve_model


def b64(data: bytes) -> bytes:
    return base64.b64encode(data)


def request(i: int) -> tuple[list[int], list[bytes]]:
    """Prompt ids with one image placeholder (two for i == 3) and the images: 84 x 56 to 140 x 112 pixels."""
    images = [png(84 + 28 * (i % 3), 56 + 28 * (i % 2), 40 + i)] + ([png(56, 56, 90)] if i == 3 else [])
    ids = [7 + i, 8] + [t for _ in images for t in (START, IMAGE, END)] + [11 + i, 12, 13]
    return ids, images


def params(i: int) -> dict:
    base = {"max_tokens": N_OUT, "ignore_eos": True}
    return {**base, "temperature": 0.8, "top_p": 0.9, "seed": 7} if i == 2 else {**base, "temperature": 0}


@pytest.fixture(scope="module")
def expected(engine):
    reqs = [request(i) for i in range(4)]
    outs = engine.generate([ids for ids, _ in reqs], [SamplingParams(**params(i)) for i in range(4)],
                           images=[ims for _, ims in reqs])  # fmt: skip
    return [o.output_ids for o in outs]


def run(s: Server) -> list:
    """The four requests, their prompt jobs held at prefill until all four have arrived there, so that they run
    at once however the threads are scheduled (a loaded machine let the first finish before the last arrived)."""
    seen = []
    gate = s.hold("pd_prefill", lambda inputs: seen.append(1) or True)
    answers = []
    for i in range(4):
        ids, images = request(i)
        answers.append(generate(s, ids, images=[b64(x) for x in images], **params(i)))
    t0 = time.monotonic()
    while len(seen) < 4 and time.monotonic() - t0 < 60:
        time.sleep(0.01)
    gate.set()  # every later call passes at once
    return [a.wait() for a in answers]


def assert_exact(answers, expected) -> None:
    for i, (a, want) in enumerate(zip(answers, expected)):
        assert a.error is None, a.error
        assert a.finish_reason == "length" and a.ids == want, f"stream {i} differs from the offline engine"


def assert_nothing_held(s: Server) -> None:
    assert s.wait_metric("pd_mm_requests_held", lambda v: v == 0) == 0
    assert s.metric("pd_mm_bytes_held") == 0 and not s.prefill.kept
    assert s.wait_metric("pd_kv_slots_used", lambda v: v == 0) == 0
    assert not s.decode.sched.reqs and not s.decode.sched.check_invariants()


def test_images_served_unpaused_equal_the_offline_engine(serve, vl_folder, expected):
    s = serve(vl_folder)
    assert_exact(run(s), expected)
    assert s.metric("pd_pauses_total") == 0
    assert s.metric("pd_mm_encodes_total") == 4  # each request's images, once
    assert_nothing_held(s)


@pytest.mark.parametrize(
    "decode,path",
    [
        (dict(kv_tokens=160, host_kv_tokens=0, fault_injection="drop_paused_kv"), "prefill"),
        (dict(kv_tokens=160), "host"),
    ],
    ids=["prefill", "host"],
)
def test_paused_image_requests_recover_exactly(serve, vl_folder, expected, decode, path):
    """A pool too small for the four answers at once: they pause and recover by `path`, exactly; a prefill
    recovery reuses the images prefill kept (no image encoded twice)."""
    s = serve(vl_folder, **decode)
    assert_exact(run(s), expected)
    assert s.metric("pd_pauses_total") > 0
    paths = {p: s.metric("pd_recoveries_total", path=p) for p in ("local", "recompute", "host", "prefill")}
    assert sum(paths[p] for p in path.split("+")) > 0, paths
    assert s.metric("pd_mm_encodes_total") == 4
    prefill_recoveries = s.metric("pd_recoveries_total", path="prefill")
    assert s.metric("pd_mm_recoveries_reused_total") == s.metric("pd_prefill_jobs_total", kind="recovery")
    if path == "prefill":
        assert prefill_recoveries > 0 and s.metric("pd_mm_recoveries_reused_total") > 0
    assert_nothing_held(s)


def test_paused_image_requests_resume_from_decodes_own_cache(serve, vl_folder, expected):
    """Paused with the pool's room to spare (the scheduler made to pause each request once, 10 tokens in), every
    request resumes from decode's own cache at once: its image positions are found under their content keys, prefill
    recomputes nothing, and the answers are exact. (A pool small enough to pause them gives this path only when a
    resumption comes before the others' growth evicts the paused tail, which a loaded machine's timing decides.)"""
    s = serve(vl_folder, host_kv_tokens=0)
    sched, paused = s.decode.sched, set()
    rotate = sched._rotate

    def pause_each_once(plan):
        for r in sched.by_state(ReqState.RUNNING):
            if r.rid not in paused and len(r.output_ids) >= 10:
                paused.add(r.rid)
                sched._pause(r, plan)
        return rotate(plan)

    sched._rotate = pause_each_once
    assert_exact(run(s), expected)
    assert len(paused) == 4 and s.metric("pd_pauses_total") == 4
    own = s.metric("pd_recoveries_total", path="local") + s.metric("pd_recoveries_total", path="recompute")
    assert own == 4 and s.metric("pd_recoveries_total", path="prefill") == 0
    assert s.metric("pd_mm_encodes_total") == 4 and s.metric("pd_prefill_jobs_total", kind="recovery") == 0
    assert_nothing_held(s)


def test_a_recovery_on_a_prefill_that_kept_nothing_rebuilds_from_the_jobs_copy(serve, vl_folder, expected):
    """After a failover the recovery job lands on a prefill that never saw the request (here: the one prefill
    forgets a request's images before its first recovery job). Master's copy of the images, which decode forwards
    with every job, rebuilds them there: the answer is still exact, at the cost of one more encode."""
    s = serve(vl_folder, kv_tokens=160, host_kv_tokens=0, fault_injection="drop_paused_kv")
    forgot, kept = [], s.prefill._multimodal

    def forgetful(job):
        if not job.sample and not forgot and job.rid in s.prefill.kept:
            s.prefill._release(job.rid)  # as decode's release does, its byte count with it
            forgot.append(job.rid)
        return kept(job)

    s.prefill._multimodal = forgetful
    assert_exact(run(s), expected)
    assert forgot and s.metric("pd_mm_encodes_total") == 5
    assert_nothing_held(s)


def test_a_cancelled_image_request_releases_its_images(serve, vl_folder):
    s = serve(vl_folder)
    ids, images = request(0)
    a = generate(s, ids, images=[b64(x) for x in images], max_tokens=400, ignore_eos=True, temperature=0)
    assert s.wait_metric("pd_mm_requests_held", lambda v: v == 1) == 1
    assert s.metric("pd_mm_bytes_held") > 0
    a.cancel()
    a.wait()
    assert_nothing_held(s)


def test_a_deadline_and_a_prefill_failure_leave_nothing_held(tmp_path, vl_folder):
    """Master's deadline passing while prefill waits (slow_prefill), and a prefill step that fails after the
    images were kept: the client gets the error, and prefill lets go of the images when decode ends the request."""
    ids, images = request(1)
    s = Server(tmp_path, str(vl_folder), prefill={"fault_injection": "slow_prefill"}, master={"request_timeout": 1.0})
    try:
        a = generate(s, ids, images=[b64(x) for x in images], max_tokens=8, temperature=0).wait()
        assert a.error is not None and "timed out" in a.error
        assert_nothing_held(s)
    finally:
        s.close()
    s = Server(tmp_path, str(vl_folder))
    try:
        step, failed = s.prefill.engine.step, []

        def failing_step():
            if not failed:
                assert s.prefill.kept  # the images are kept before the step that fails
                failed.append(1)
                raise RuntimeError("injected prefill failure")
            return step()

        s.prefill.engine.step = failing_step
        a = generate(s, ids, images=[b64(x) for x in images], max_tokens=8, temperature=0).wait()
        assert failed and a.error is not None and "injected prefill failure" in a.error
        assert_nothing_held(s)
    finally:
        s.close()


@pytest.mark.parametrize(
    "ids,images,field",
    [
        ([7, 8], [b64(png(56, 56, 0))], "image"),  # no placeholder
        ([7, START, IMAGE, END], [b"%%%notbase64"], "image[0]"),
        ([7, START, IMAGE, END], [b64(b"GIF89a not a png")], "image[0]"),
        ([7, START, IMAGE, END], [b64(png(56, 56, 0))] * 9, "image"),  # over --max-images-per-request (8)
    ],
    ids=["no-placeholder", "bad-base64", "not-an-image", "too-many"],
)
def test_bad_images_are_refused_naming_the_input_and_nothing_is_held(serve, vl_folder, ids, images, field):
    s = serve(vl_folder)
    a = generate(s, ids, images=images, max_tokens=4).wait()
    assert a.error is not None and a.error.startswith(f"{field}:"), a.error
    ok = generate(s, *request(0)[:1], images=[b64(request(0)[1][0])], max_tokens=3, temperature=0).wait()
    assert ok.error is None and len(ok.ids) == 3  # still serving
    assert_nothing_held(s)


def test_a_text_only_model_refuses_images(serve, hybrid_folder):  # noqa: F811
    s = serve(hybrid_folder)
    a = generate(s, [7, 8], images=[b64(png(56, 56, 0))], max_tokens=2).wait()
    assert a.error is not None and a.error.startswith("image: ") and "takes no images" in a.error
