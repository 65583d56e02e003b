"""The prefill boundary: how many prompt tokens P computes and D loads.

A recurrent state cannot be advanced twice over the same token, yet D must compute at least the
last prompt token itself to produce logits. So with any STATE group P prefills the first N-1
tokens and D loads their cache (including the state after token N-2) and recomputes token N-1.
"""

from __future__ import annotations

import math


def prefill_token_count(prompt_len: int, has_state: bool) -> int:
    """Prompt tokens P must prefill for a request whose decode runs remotely.

    N-1 with STATE groups (at least 1, as an engine cannot schedule an empty prefill); N otherwise.
    """
    if prompt_len < 0:
        raise ValueError(f"prompt length must not be negative, got {prompt_len}")
    if has_state and prompt_len > 1:
        return prompt_len - 1
    return prompt_len


def remote_prefill_token_count(prompt_len: int, has_state: bool, cached_tokens: int = 0) -> int:
    """Tokens D loads from P for a prompt of ``prompt_len`` tokens, of which it has cached some.

    With STATE groups this is N-1 (0 for a one-token prompt: loading the state after token 0 and
    recomputing token 0 would advance it twice); without, N. Never negative.
    """
    if prompt_len < 0 or cached_tokens < 0:
        raise ValueError("prompt length and cached tokens must not be negative")
    loadable = prompt_len - 1 if has_state else prompt_len
    return max(0, loadable - cached_tokens)


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """Logical blocks that hold ``tokens`` tokens."""
    return math.ceil(tokens / block_size) if tokens > 0 else 0
