"""perf.hybrid_bench --profile's split of a kernel by launch grid, on a Chrome trace shaped like torch.profiler's
(kernel events carry their grid in args): the GPU host is where it runs, the arithmetic is checked here."""

from perf.tools.hybrid_bench import kernels_by_grid


def kernel(name, grid, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "dur": dur, "args": {"grid": list(grid), "block": [128, 1, 1]}}


def test_a_kernel_with_several_grids_splits_by_grid_and_one_grid_kernels_are_left_out():
    reps = 2
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 999.0, "args": {}}]  # not a kernel
    for _ in range(reps):  # per call: in_proj-like 3 launches at 20 us, out-like 3 at 10 us, norm 6 at 2 us
        events += [kernel("_skinny_kernel", (386, 1, 1), 20.0) for _ in range(3)]
        events += [kernel("_skinny_kernel", (64, 4, 1), 10.0) for _ in range(3)]
        events += [kernel("_add_rms_norm_kernel", (32, 1, 1), 2.0) for _ in range(6)]
        events += [kernel("_decode_kernel", (12, 8, 1), 5.0), kernel("_decode_kernel", (12, 16, 1), 7.0)]
        events[-1]["cat"] = "Kernel"  # older kineto's spelling
    rows = kernels_by_grid({"traceEvents": events}, reps)
    assert [(r[0], r[1]) for r in rows] == [
        ("_skinny_kernel", (386, 1, 1)),  # the larger total first, within the name with the larger total first
        ("_skinny_kernel", (64, 4, 1)),
        ("_decode_kernel", (12, 16, 1)),
        ("_decode_kernel", (12, 8, 1)),
    ]
    name, grid, ms, n, us = rows[0]
    assert (n, us) == (3, 20.0) and abs(ms - 0.060) < 1e-12  # 3 x 20 us per call
    assert rows[1][2:] == (0.030, 3, 10.0)
    assert rows[2][2:] == (0.007, 1, 7.0)


def test_a_trace_without_grids_gives_nothing():
    trace = {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "dur": 3.0, "args": {}}]}
    assert kernels_by_grid(trace, 1) == []
    assert kernels_by_grid({}, 1) == []
