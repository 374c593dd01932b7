"""The order of a generation's samples across rollout replicas, without torch (the Reward actor's
process imports this and nothing heavier for plain Python reward functions)."""

from __future__ import annotations


def sample_rows(outs: list[dict], rows: list | None) -> list:
    """(replica, row) of each sample in the samples' order (`_loop.Pending.rows`); None: the
    replicas' outputs one after another."""
    return rows or [(i, j) for i, o in enumerate(outs) for j in range(len(o["seqs"]))]


def gather_completions(outs: list[dict], rows: list | None) -> list[str]:
    """The replicas' completion texts in the samples' order."""
    return [outs[i]["completions"][j] for i, j in sample_rows(outs, rows)]
