"""Speculative decoding with one draft token per step, verified exactly.

A step feeds the request's next input token and a draft of the token after it; the model's sample at the input
position is drawn exactly as without speculation (the sampler's randomness depends only on seed and output
position), and the draft is kept only if it equals that sample, in which case the sample at the draft's position is
a second token from the same step. So the output is token for token the non-speculative one, greedy or seeded,
whatever the drafts are; drafts only change how many steps it takes.

Drafters: `mtp`, the model's own multi-token-prediction head (Qwen3-Next ships one), and `ngram`, draft-free
prompt lookup (the token that followed the latest earlier occurrence of the history's last n tokens), for any model.
A rejected draft leaves K/V at its position, which the next step overwrites (it is that step's reserved slot), and,
in a hybrid model, a state advanced past it: the step saved the state after the input token in a scratch page, and
the request's page is rolled back to it."""

from __future__ import annotations

MODES = ("off", "ngram", "mtp")


def ngram_draft(ids: list[int], max_n: int = 3, window: int = 512) -> int | None:
    """The token that followed the most recent earlier occurrence of the last n tokens of ids (n = max_n .. 1,
    looking back at most `window` tokens), or None."""
    hist = ids[-window:]
    length = len(hist)
    for n in range(min(max_n, length - 1), 0, -1):
        tail = hist[length - n :]
        for i in range(length - n - 1, -1, -1):
            if hist[i : i + n] == tail:
                return hist[i + n]
    return None


def check_mode(mode: str, has_mtp: bool) -> str:
    if mode not in MODES:
        raise ValueError(f"speculative must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "mtp" and not has_mtp:
        raise ValueError("speculative 'mtp': this model ships no MTP head (mtp.* weights); use 'ngram'")
    return mode
