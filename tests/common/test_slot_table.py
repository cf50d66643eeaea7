"""The GPU runner's host-side packing of index lists (backends.common.model.slot_table.pack): what the pinned
upload ring copies to the device in one transfer. Runs on the CPU; the upload itself is covered by the GPU tests."""

from __future__ import annotations

import numpy as np

from backends.common.model.slot_table import pack


def test_pack_writes_every_part_at_16_byte_offsets():
    parts = [[5, 6, 7], [], list(range(100, 110)), [1], range(3)]
    buf = np.full(64, -1, dtype=np.int32)
    offsets, n = pack(parts, buf)
    assert offsets == [0, 4, 4, 16, 20] and n == 23
    assert all(o % 4 == 0 for o in offsets)
    for p, o in zip(parts, offsets):
        assert buf[o : o + len(p)].tolist() == list(p)
    assert (buf[n:] == -1).all()  # nothing past the last part


def test_pack_into_a_buffer_too_small_writes_nothing_and_says_what_it_needs():
    parts = [list(range(5000)), list(range(5000, 10000)), [7] * 3]
    small = np.zeros(8, dtype=np.int32)
    offsets, n = pack(parts, small)
    assert n == 10003 and (small == 0).all()
    big = np.zeros(n, dtype=np.int32)
    assert pack(parts, big) == (offsets, n)
    assert big[offsets[1] : offsets[1] + 5000].tolist() == parts[1] and big[-3:].tolist() == [7, 7, 7]
