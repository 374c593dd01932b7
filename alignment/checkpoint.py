"""Checkpoint and resume of a whole alignment run.

    folder/critic/   DeepSpeed checkpoint of the critic (PPO only), written first
    folder/policy/   DeepSpeed checkpoint of the policy: weights + optimizer state, and as client
                     state the next step, the driver's `random.Random` state (= the data position:
                     which prompts come next) and every rollout replica's torch RNG state.
The policy's `latest` file is written last, so its presence marks a complete checkpoint.
"""

from __future__ import annotations

import time
from pathlib import Path

import ray


def has_checkpoint(folder: str | Path | None) -> bool:
    return folder is not None and (Path(folder) / "policy" / "latest").exists()


def save_run(folder: str | Path, *, step: int, rng, policy, rollouts: list, critic=None) -> float:
    """Returns the seconds it took (every role waits for it; logged as `checkpoint_seconds`)."""
    t0 = time.perf_counter()
    folder = Path(folder)
    if critic is not None:
        ray.get(critic.save_checkpoint.remote(str(folder / "critic")))
    rollout_rng = ray.get([r.rng_state.remote() for r in rollouts])
    ray.get(policy.save_checkpoint.remote(str(folder / "policy"),
                                          {"step": step, "rng": rng.getstate(), "rollout_rng": rollout_rng}))
    return time.perf_counter() - t0


def load_run(folder: str | Path, *, rng, policy, rollouts: list, critic=None) -> int:
    """Restores every role and the driver's RNG; returns the step to continue from (0 if none)."""
    if not has_checkpoint(folder):
        return 0
    folder = Path(folder)
    state = ray.get(policy.load_checkpoint.remote(str(folder / "policy")))
    if critic is not None:
        ray.get(critic.load_checkpoint.remote(str(folder / "critic")))
    rng.setstate(_tuple(state["rng"]))
    for r, s in zip(rollouts, state.get("rollout_rng", [])):
        ray.get(r.set_rng_state.remote(s))
    return int(state["step"])


def _tuple(x):
    """`random.Random.setstate` wants the nested tuples that a round trip may have made lists."""
    return tuple(_tuple(i) for i in x) if isinstance(x, list) else x
