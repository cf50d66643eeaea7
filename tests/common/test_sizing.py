"""Decode's state pages on a GPU: the full-batch default where it fits the decode instance's share of memory, fewer
where the weights leave too little (the H100's case for Qwen3.5-9B), never none."""

from __future__ import annotations

from backends.common.core.config import SHAPES
from backends.common.engine.runner import default_state_pages, state_pages_within

GIB = 1 << 30


def test_state_pages_fit_the_share_left_after_weights_and_kv():
    page = SHAPES["qwen3.5-9b"].state_page_bytes()
    default = default_state_pages(256)
    # an H100 (79.2 GiB): half of it, less 17.4 GiB of bf16 weights and a 0.26 GiB KV pool
    h100 = state_pages_within(default, int(0.5 * 79.2 * GIB) - int(17.7 * GIB), page, 256)
    assert 16 <= h100 < default
    assert (h100 + 256 + 1) * page <= int(0.5 * 79.2 * GIB) - int(17.7 * GIB)  # scratch and padding page included
    # an H200 (139.8 GiB): the default fits
    assert state_pages_within(default, int(0.5 * 139.8 * GIB) - int(17.7 * GIB), page, 256) == default
    # no room at all: a few pages still (the allocation, not the sizing, says whether they fit)
    assert state_pages_within(default, -GIB, page, 256) == 16
    assert state_pages_within(8, 0, page, 4) == 8  # never more than asked for
