"""Which positions of a chunk are scored (DESIGN §6), torch-free: the one statement of the rule.

Positions n_ctx//2 … n_ctx−2 are scored (the logits at p predict token p+1): the second half
of each chunk, n_ctx − 1 − n_ctx//2 tokens, as llama-perplexity scores them.
"""

from __future__ import annotations


def scored_range(n_ctx: int) -> range:
    """The scored positions of a chunk of n_ctx tokens (no check of n_ctx: a file's header
    may hold any size that its own reader validates)."""
    return range(n_ctx // 2, n_ctx - 1)


def n_scored(n_ctx: int) -> int:
    """How many positions of a chunk are scored: n_ctx − 1 − n_ctx//2."""
    return len(scored_range(n_ctx))


def scored_positions(n_ctx: int) -> range:
    """The scored positions of a run's chunk; n_ctx must be an even integer >= 4."""
    if not isinstance(n_ctx, int) or n_ctx < 4 or n_ctx % 2:
        raise ValueError(f"n_ctx must be an even integer >= 4, got {n_ctx!r}")
    return scored_range(n_ctx)
