"""Checkpoint and resume of a whole alignment run (every algorithm: the loops over batches of SFT,
the reward model and DPO save through `Every`).

    folder/critic/   DeepSpeed checkpoint of the critic (PPO only), written first
    folder/policy/   DeepSpeed checkpoint of the policy: weights + optimizer state, and in each tag's
                     `raypai_state.json`/`.npz` (JSON and arrays, never pickled: raypai.checkpoint_io)
                     the next step, the driver's `random.Random` state (= the data position: which
                     prompts come next) and every rollout replica's torch RNG state.
DeepSpeed's own files are read back with `weights_only=True` and an allow-list of its types.
Each save goes into new folders named by its step (DeepSpeed tags `step-000012`), and the policy's
`latest` file is replaced atomically after its save finished, so it only ever names a complete
checkpoint: a process killed in the middle of a save leaves the previous checkpoint intact (the
old scheme overwrote one `state` folder in place, and a kill mid-save left a torn file behind). The
two newest tags are kept; the critic is loaded at the tag the policy's `latest` names.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import ray


def has_checkpoint(folder: str | Path | None) -> bool:
    return folder is not None and (Path(folder) / "policy" / "latest").exists()


def save_run(
    folder: str | Path, *, step: int, rng, policy, rollouts: list = (), critic=None, extra: dict | None = None
) -> float:
    """Returns the seconds it took (every role waits for it; logged as `checkpoint_seconds`).
    `extra`: what else the driver needs on resume (JSON-able, e.g. the metrics measured before step 1)."""
    t0 = time.perf_counter()
    folder, tag = Path(folder), tag_of(step)
    if critic is not None:
        # one more tag kept than the policy's: the critic may be a save ahead of the policy's `latest`
        ray.get(critic.save_checkpoint.remote(str(folder / "critic"), tag, keep=3, point_latest=False))
    rollout_rng = ray.get([r.rng_state.remote() for r in rollouts])
    ray.get(
        policy.save_checkpoint.remote(
            str(folder / "policy"),
            tag,
            {"step": step, "rng": rng.getstate(), "rollout_rng": rollout_rng, "extra": extra or {}},
        )
    )
    return time.perf_counter() - t0


def tag_of(step: int) -> str:
    return f"step-{step:06d}"


def latest_tag(folder: str | Path) -> str:
    return (Path(folder) / "latest").read_text().strip()


def commit(folder: str | Path, tag: str, keep: int = 2, *, point_latest: bool = True) -> None:
    """After a finished save under `tag`: point `latest` at it (write + atomic rename) and remove
    all but the `keep` newest tags (never the one `latest` names)."""
    folder = Path(folder)
    if point_latest:
        tmp = folder / f".latest.{os.getpid()}"
        tmp.write_text(tag)
        os.replace(tmp, folder / "latest")
    tags = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name.startswith("step-"))
    current = latest_tag(folder) if (folder / "latest").exists() else tag
    for old in tags[:-keep]:
        if old != current:
            shutil.rmtree(folder / old, ignore_errors=True)


def load_run(folder: str | Path, *, rng, policy, rollouts: list = (), critic=None) -> int:
    """Restores every role and the driver's RNG; returns the step to continue from (0 if none)."""
    return load_run_state(folder, rng=rng, policy=policy, rollouts=rollouts, critic=critic)[0]


def load_run_state(folder: str | Path, *, rng, policy, rollouts: list = (), critic=None) -> tuple[int, dict]:
    """`load_run`, and the `extra` the checkpoint was saved with."""
    if not has_checkpoint(folder):
        return 0, {}
    folder = Path(folder)
    tag = latest_tag(folder / "policy")
    state = ray.get(policy.load_checkpoint.remote(str(folder / "policy"), tag))
    if critic is not None:
        ray.get(critic.load_checkpoint.remote(str(folder / "critic"), tag))
    rng.setstate(_tuple(state["rng"]))
    for r, s in zip(rollouts, state.get("rollout_rng", [])):
        ray.get(r.set_rng_state.remote(s))
    return int(state["step"]), state.get("extra") or {}


class Every:
    """Checkpoints of a loop over batches (SFT, reward model, DPO) into `folder` (None: none): at
    the end of each call whose steps reach a multiple of `every`, and at the last step.

        ckpt = Every(folder, cfg.checkpoint_every, cfg.steps, rng, policy, extra={"before": before})
        start, extra = ckpt.resume("sft")
        ...; ckpt.after(call_steps)      # once the call's updates are done and no other is queued
    """

    def __init__(self, folder, every: int, steps: int, rng, trained, *, extra: dict | None = None):
        self.folder, self.every, self.steps, self.rng, self.trained = folder, every, steps, rng, trained
        self.extra = extra or {}

    def resume(self, algo: str) -> tuple[int, dict]:
        """(the step to continue after, the `extra` saved) from the folder's checkpoint; (0, {}) without one."""
        if not self.folder or not has_checkpoint(self.folder):
            return 0, {}
        start, extra = load_run_state(self.folder, rng=self.rng, policy=self.trained)
        print(f"[raypai.{algo}] resumed from {self.folder} at step {start}", flush=True)
        return start, extra

    def due(self, steps: list[int]) -> bool:
        return bool(self.folder) and any(s % self.every == 0 or s == self.steps for s in steps)

    def after(self, steps: list[int]) -> None:
        """Save after `steps` (the driver's RNG as it is now: the rows of later steps not yet drawn)."""
        if self.due(steps):
            save_run(self.folder, step=steps[-1], rng=self.rng, policy=self.trained, extra=self.extra)


def _tuple(x):
    """`random.Random.setstate` wants the nested tuples that a round trip may have made lists."""
    return tuple(_tuple(i) for i in x) if isinstance(x, list) else x
