"""The prefill boundary: N-1 with recurrent state, N otherwise, minus what D has cached."""

from __future__ import annotations

import pytest

from kvbridge.core import blocks_for_tokens, prefill_token_count, remote_prefill_token_count


@pytest.mark.parametrize(
    ("prompt", "has_state", "cached", "remote", "prefill"),
    [
        (100, False, 0, 100, 100),  # attention only: D loads all N, vLLM recomputes the last
        (100, True, 0, 99, 99),  # state: P stops at N-2, D recomputes N-1
        (100, True, 32, 67, 99),  # D's prefix cache hit is subtracted
        (100, False, 32, 68, 100),
        (1, False, 0, 1, 1),  # one-token prompt without state
        (1, True, 0, 0, 1),  # one-token prompt with state: nothing to load, P still runs
        (100, True, 100, 0, 99),  # fully cached prompt: never negative
        (100, False, 100, 0, 100),
        (0, True, 0, 0, 0),
    ],
)
def test_remote_prefill_and_prefill_counts(prompt, has_state, cached, remote, prefill):
    assert remote_prefill_token_count(prompt, has_state, cached) == remote
    assert prefill_token_count(prompt, has_state) == prefill


def test_p_computes_what_d_loads():
    # Whatever D loads, P must have prefilled; with state, exactly that many tokens.
    for n in range(1, 50):
        for has_state in (False, True):
            assert remote_prefill_token_count(n, has_state) <= prefill_token_count(n, has_state)
            if has_state and n > 1:
                assert remote_prefill_token_count(n, True) == prefill_token_count(n, True)


def test_negative_inputs_are_rejected():
    with pytest.raises(ValueError):
        remote_prefill_token_count(-1, False)
    with pytest.raises(ValueError):
        prefill_token_count(-1, True)


def test_blocks_for_tokens():
    assert [blocks_for_tokens(t, 16) for t in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
