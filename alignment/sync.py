"""Explicit, measured weight sync from the trainer to the rollout replicas (through the object store)."""

from __future__ import annotations

import time

import ray


def sync_weights(trainer, rollouts: list) -> dict:
    """Copy the trainer's current weights into every rollout replica; returns `sync_seconds` (wall
    time until the last replica has loaded them) and `sync_bytes` (size of one copy)."""
    t0 = time.perf_counter()
    sizes = ray.get(start_sync(trainer, rollouts))
    return {"sync_seconds": time.perf_counter() - t0, "sync_bytes": int(sizes[0]) if sizes else 0}


def start_sync(trainer, rollouts: list) -> list:
    """Queue the copy without waiting: each replica loads the weights after the work already
    submitted to it (an actor runs one caller's tasks in submission order) and before anything
    submitted later. Returns the ObjectRefs of the loaded sizes."""
    state = trainer.state_dict.remote()  # one copy in the object store, shared by every replica
    version = trainer.version.remote()
    return [r.load_weights.remote(state, version) for r in rollouts]
