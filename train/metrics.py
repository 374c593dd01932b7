"""Throughput, MFU and straggler detection: small pure pieces the training loop calls on rank 0."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilization (Chowdhery et al. 2022, PaLM App. B): achieved model FLOP/s over the
    hardware peak of all workers. `peak_flops` is the sum over workers."""
    return tokens_per_s * flops_per_token / peak_flops if peak_flops > 0 else 0.0


@dataclass
class StragglerDetector:
    """Flags a worker whose step time exceeds `ratio` × the median of its peers (the other workers;
    with two workers the median of all would include the straggler itself) for `patience`
    consecutive observations: a persistent "grey failure" (slow but alive, as PAI's AIMaster calls
    it), not a one-off hiccup such as a checkpoint or GC pause."""

    world: int
    ratio: float = 1.5
    patience: int = 3
    _streak: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._streak = [0] * self.world

    def observe(self, step_times: list[float]) -> list[int]:
        """Record one step time per rank; return the ranks that just became persistent stragglers."""
        flagged = []
        for rank, t in enumerate(step_times):
            peers = step_times[:rank] + step_times[rank + 1 :]
            slow = bool(peers) and t > self.ratio * statistics.median(peers)
            self._streak[rank] = self._streak[rank] + 1 if slow else 0
            if self._streak[rank] == self.patience:
                flagged.append(rank)
        return flagged
