"""Explicit, measured weight sync from the trainer to the rollout replicas (through the object store)."""

from __future__ import annotations

import time

import ray


def sync_weights(trainer, rollouts: list) -> dict:
    """Copy the trainer's current weights into every rollout replica; returns `sync_seconds` (wall
    time until the last replica has loaded them) and `sync_bytes` (size of one copy)."""
    t0 = time.perf_counter()
    state = trainer.state_dict.remote()  # one copy in the object store, shared by every replica
    sizes = ray.get([r.load_weights.remote(state) for r in rollouts])
    return {"sync_seconds": time.perf_counter() - t0, "sync_bytes": int(sizes[0]) if sizes else 0}
