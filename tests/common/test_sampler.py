from __future__ import annotations

import torch

from backends.common.engine.sampler import sample


def _logits(n=4, vocab=1000, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_seeded_draw_independent_of_batch_composition():
    logits = _logits(8)
    alone = [sample(logits[i : i + 1], [0.9], [0.95], [50], [7], [i])[0].item() for i in range(8)]
    batched = sample(logits, [0.9] * 8, [0.95] * 8, [50] * 8, [7] * 8, list(range(8))).tolist()
    assert alone == batched
    # mixed with other requests' rows in a different order
    mixed = sample(
        torch.cat([_logits(3, seed=5), logits.flip(0)]),
        [1.0] * 3 + [0.9] * 8,
        [1.0] * 3 + [0.95] * 8,
        [-1] * 3 + [50] * 8,
        [1, 2, 3] + [7] * 8,
        [0, 0, 0] + list(range(7, -1, -1)),
    ).tolist()
    assert mixed[3:] == batched[::-1]


def test_different_seeds_differ_and_distribution_follows_softmax():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    draws = [sample(logits, [1.0], [1.0], [-1], [s], [0])[0].item() for s in range(3000)]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert abs(freq[0] - 0.5) < 0.04 and abs(freq[1] - 0.3) < 0.04 and abs(freq[2] - 0.2) < 0.04
    assert len(set(draws[:20])) > 1


def test_temperature_zero_and_top_k_one_are_greedy():
    logits = _logits(6)
    greedy = logits.argmax(-1).tolist()
    assert sample(logits, [0.0] * 6, [1.0] * 6, [-1] * 6, list(range(6)), [0] * 6).tolist() == greedy
    assert sample(logits, [1.5] * 6, [1.0] * 6, [1] * 6, list(range(6)), [0] * 6).tolist() == greedy


def test_top_p_and_top_k_restrict_support():
    logits = torch.log(torch.tensor([[0.6, 0.25, 0.1, 0.05]]))
    p_draws = {sample(logits, [1.0], [0.7], [-1], [s], [0])[0].item() for s in range(400)}
    assert p_draws == {0, 1}  # 0.6 < 0.7, so the second token is still needed; the rest are cut
    k_draws = {sample(logits, [1.0], [1.0], [3], [s], [0])[0].item() for s in range(400)}
    assert k_draws == {0, 1, 2}


def test_banned_ids_never_drawn():
    logits = torch.zeros(1, 5)
    logits[0, 2] = 10
    assert sample(logits, [0.0], [1.0], [-1], [0], [0], [[2]])[0].item() != 2
    draws = {sample(logits, [1.0], [1.0], [-1], [s], [0], [[2, 3]])[0].item() for s in range(200)}
    assert draws == {0, 1, 4}


def test_noise_is_finite_over_large_vocab_and_many_positions():
    from backends.common.engine.sampler import gumbel_noise, row_key

    keys = torch.tensor([row_key(s, p) for s in range(4) for p in range(16)], dtype=torch.int64)
    g = gumbel_noise(keys, 152_000)
    assert torch.isfinite(g).all()
    # masked tokens are never drawn, however large their noise
    logits = torch.full((1, 152_000), float("-inf"))
    logits[0, 17] = 0.0
    assert all(sample(logits, [1.0], [1.0], [-1], [s], [p])[0].item() == 17 for s in range(3) for p in range(16))
