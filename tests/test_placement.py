"""Instance placement across GPUs (pure Python): the instance_group entries `triton-pd serve` renders."""

from __future__ import annotations

import pytest

from backends.serve import instance_groups, parse_gpus


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
