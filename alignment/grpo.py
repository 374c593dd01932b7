"""GRPO with policy, rollout, reward and (with a KL term, beta > 0) reference as separate Ray actors.

    from raypai.alignment import GRPOConfig, run_grpo
    from raypai.alignment.data import load, split
    train, held_out = split(load("prompts.jsonl", "prompt"))          # `prompt` + columns for the rewards
    run_grpo("sft_model/", "grpo_model/", train, held_out, GRPOConfig(steps=30),
             rewards=["my_pkg.rewards:accuracy"], checkpoint_dir="ckpt/")

The loop reads like single-process code: rollout → reference log-probs + rewards → advantages →
train → sync weights → eval → checkpoint. Re-running with the same `checkpoint_dir` resumes.

`async_rollout=True` overlaps the next step's generation with this step's scoring and training
(one-step off-policy, as in AReaL/verl's one-step-off-policy recipes): the batch trained on at step
t was sampled with the weights from before step t−1's update, and the clipped ratio is taken
against the log-probs of those sampling weights (returned by the rollout with the samples).
"""

from __future__ import annotations

import os
import random
import time

import ray

from raypai.alignment._driver import Run, check_plan, resume_state, rl_inputs, sync_dtype, sync_path
from raypai.alignment._loop import (
    Sections,
    asleep,
    collect,
    end_step,
    launch,
    response_length,
    rl_summary,
    score_launched,
    scores_of,
    to_tensor,
)
from raypai.alignment.checkpoint import save_run
from raypai.alignment.config import LIVE_ENGINES, GRPOConfig
from raypai.alignment.evaluate import reward_with
from raypai.alignment.losses.objectives import GRPO
from raypai.alignment.placement import RoleSpec
from raypai.alignment.sync import start_sync, wait_loads

TIMES = ("time_rollout", "time_reward", "time_reference", "time_train", "time_sync")


def run_grpo(
    model_dir: str,
    out_dir: str,
    train: list,
    held_out: list,
    cfg: GRPOConfig,
    *,
    run_name: str = "grpo",
    rewards=None,
    reward_model_dir: str | None = None,
    checkpoint_dir: str | None = None,
    logger=None,
    lineage: dict | None = None,
) -> dict:
    """`train`/`held_out`: PromptExample lists (extra columns reach the rewards). `rewards`: callables,
    'mod:fn[=weight]' import paths or (fn, weight) pairs; a reward model is scored in with weight
    `cfg.reward_model_weight` when `reward_model_dir` is given. Returns the summary (held-out reward
    of greedy completions before/after, samples/s and time split); the aligned policy is written to
    `out_dir` as an HF folder with `raypai.json`."""
    inputs = rl_inputs("GRPO", model_dir, cfg, train, held_out, rewards=rewards, reward_model_dir=reward_model_dir)
    check_plan("grpo", model_dir, cfg, reward_model_dir)
    use_rm, pad_id = inputs.use_rm, inputs.pad_id
    g = cfg.gpu_share  # of each GPU
    specs = role_specs(cfg, use_rm)
    device = {role: "cuda" if spec.gpus else "cpu" for role, spec in specs.items()}
    # synchronous: the roles take turns, so they share one bundle and the working one uses all of its
    # CPUs (several rollout replicas split the batch and those CPUs between them); async: rollout and
    # update overlap, each in its own bundle with one thread
    colocate = () if cfg.async_rollout else (tuple(specs),)
    # the bundle's CPUs, but no more threads than the machine has cores (oversubscribed threads only wait)
    shared = (
        max(1, min(round(sum(r.cpus * r.replicas for r in specs.values())), os.cpu_count() or 1)) if colocate else 1
    )
    objective = GRPO(
        group_size=cfg.group_size,
        clip_eps=cfg.clip_eps,
        clip_eps_high=cfg.clip_eps_high,
        beta=cfg.beta,
        aggregation=cfg.aggregation,
        max_new_tokens=cfg.max_new_tokens,
    )
    with Run(run_name, specs, colocate=colocate, logger=logger, gpus=cfg.gpus, placement=cfg.placement) as run:
        # synchronous: no replica samples while the trainer updates, so the replicas read the trainer's
        # own parameters (a sync is a version check); async: they sample during updates, so they copy
        # (on a GPU the replicas take each update as a bf16 copy through host shared memory)
        policy = run.place_policy(
            model_dir,
            cfg,
            threads=cfg.train_threads or shared,
            live_weights=not cfg.async_rollout and cfg.rollout_engine in LIVE_ENGINES,
            device=device["policy"],
            sync_dtype=sync_dtype(cfg, model_dir),
        )
        rollouts, reward = run.place_sampling(
            model_dir,
            cfg,
            inputs,
            reward_model_dir,
            device=device["rollout"],
            threads=cfg.rollout_threads or max(1, shared // cfg.rollout_replicas),
        )
        reference = run.place_reference(model_dir, cfg, policy, device=device.get("reference")) if cfg.beta else None
        rng = random.Random(cfg.seed)
        start, saved = resume_state("grpo", checkpoint_dir, rng, policy, rollouts, **sync_path(cfg))
        eval_before = reward_with(rollouts[0], reward, held_out, cfg.max_new_tokens)
        history = []
        pick = lambda: rng.sample(train, min(cfg.prompts_per_step, len(train)))  # noqa: E731
        gen = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p}
        # async: the first batch is launched now; every later one while the previous step trains
        pending = launch(rollouts, pick(), cfg.group_size, logprobs=True, **gen) if cfg.async_rollout else None
        queued = None  # async: the last step, its update queued on the trainer and not yet waited for
        done_at = time.perf_counter()  # when the last step finished (step_seconds: the wall time between two)

        def finish(step_t) -> dict:
            """Wait for a step's update and weight loads; its metrics."""
            nonlocal done_at
            step, update, loads_t, t, s, rewards, offload = step_t
            with t("time_train"):  # synchronous: the update; async: what is left of it when the driver asks
                m = ray.get(update)
            with t("time_sync"):  # the replicas' loads (each runs after the work already queued on it)
                sizes = wait_loads(loads_t)
            now = time.perf_counter()
            seconds, done_at = now - done_at, now
            return {
                "reward_mean": rewards.mean().item(),
                "reward_std": rewards.std().item(),
                "policy_loss": m["loss"],
                "kl": m["kl"],
                "clip_fraction": m["clip_fraction"],
                "entropy": m["entropy"],
                "grad_norm": m["grad_norm"],
                "update_seconds": m["update_seconds"],
                "response_length": response_length(s.batch),
                "sync_bytes": sizes[0] if sizes else 0,
                "sync_seconds": t.seconds["time_sync"],
                **t.seconds,
                **offload,
                "samples": len(s.completions),
                # measured: trainer updates between the weights that sampled this batch and the update
                "policy_lag_steps": (m["policy_version"] - s.weights_version) // cfg.inner_iterations,
                "step_seconds": seconds,
                "samples_per_s": len(s.completions) / seconds,
            }

        def checkpoint(step: int) -> float:
            return save_run(checkpoint_dir, step=step, rng=rng, policy=policy, rollouts=rollouts)

        def record(step: int, metrics: dict) -> None:
            nonlocal done_at
            end_step(
                "grpo",
                step,
                metrics,
                steps=cfg.steps,
                eval_every=cfg.eval_every,
                evaluate=lambda: reward_with(rollouts[0], reward, held_out, cfg.max_new_tokens),
                checkpoint_every=cfg.checkpoint_every,
                checkpoint=checkpoint if checkpoint_dir else None,
                logger=logger,
                history=history,
            )
            done_at = time.perf_counter()  # evaluation, checkpoint and logging are not a step's time

        for step in range(start + 1, cfg.steps + 1):
            t, offload = Sections(), {}
            s = None
            with t("time_rollout"):  # async: only the wait for the generation that ran during the last step
                if cfg.async_rollout:
                    now = pending
                    s = collect(now, pad_id=pad_id)
                    pending = (
                        launch(rollouts, pick(), cfg.group_size, logprobs=True, **gen) if step < cfg.steps else None
                    )
                else:  # on a GPU the trainer sleeps while the replicas sample, and wakes when they are done
                    with asleep([policy], on_gpu=bool(g)) as offload:
                        now = launch(rollouts, pick(), cfg.group_size, **gen)
                        if g:
                            s = collect(now, pad_id=pad_id)
            # the reward and then the update take the replicas' outputs straight from Ray, each as soon
            # as what it needs is in: no round trip through this process between the phases
            scored = score_launched(reward, now)
            if s is None and (cfg.beta or cfg.inner_iterations > 1):  # the reference/rollout score the batch
                with t("time_rollout"):
                    s = collect(now, pad_id=pad_id)
            # reference and reward work in parallel; time_reference is the wait left after the rewards
            ref_lp = reference.logprobs.remote(s.batch) if cfg.beta else None
            # old log-probs: async, the sampling weights' (off-policy ratio); μ = 1 on-policy, the
            # trainer detaches its own (no extra pass); μ > 1, the rollout's before the updates
            if s is not None and s.behaviour_lp is not None:
                old_lp = s.behaviour_lp
            else:
                old_lp = rollouts[0].logprobs.remote(s.batch) if cfg.inner_iterations > 1 else None
            with t("time_reference"):
                ref_lp, old_lp = (ray.get(x) if isinstance(x, ray.ObjectRef) else x for x in (ref_lp, old_lp))
            sampled = {"rows": now.rows, "pad_id": pad_id}
            # queued on the trainer (it runs its calls in order), then the sync queued on every
            # replica: each loads the new weights after the work already submitted to it (async: the
            # generation in flight) and before the next generation
            with t("time_train"):
                for _ in range(cfg.inner_iterations):
                    update = policy.update_on.remote(
                        objective, scored, sampled, *now.refs, old_lp=old_lp, ref_lp=ref_lp
                    )
            with t("time_sync"):
                loads = start_sync(policy, rollouts, **sync_path(cfg))
            # while they work: the samples and their rewards, for the metrics
            if s is None:
                with t("time_rollout"):
                    s = collect(now, pad_id=pad_id)
            with t("time_reward"):
                rewards = to_tensor(scores_of(scored)["total"])
            this = (step, update, loads, t, s, rewards, offload)
            # async: the driver waits for the previous step's update only now, with this one queued
            # behind it, so the trainer never idles while the driver collects, scores and submits;
            # a step that evaluates or checkpoints (and the last) is waited for at once
            if queued is not None:
                record(queued[0], finish(queued))
                queued = None
            if cfg.async_rollout and not (
                step == cfg.steps or step % cfg.eval_every == 0 or (checkpoint_dir and step % cfg.checkpoint_every == 0)
            ):
                queued = this
            else:
                record(step, finish(this))
        # the last step was waited for, its weight loads included: every replica has the final weights
        eval_after = reward_with(rollouts[0], reward, held_out, cfg.max_new_tokens)
        summary = rl_summary(
            eval_before, eval_after, history, ("reward_mean", "sync_seconds", "update_seconds", *TIMES)
        )
        summary["sync_bytes"] = history[-1]["sync_bytes"] if history else 0
        summary["sync_setup_seconds"] = saved["sync_setup_seconds"]  # the first round, before step 1
        return run.finish(policy, out_dir, "grpo", cfg, summary, lineage)


def role_specs(cfg: GRPOConfig, use_rm: bool) -> dict[str, RoleSpec]:
    """The run's roles. On GPUs the trainer gets half of each GPU, the rollout replicas (and the
    reference when it is queried, beta > 0) the rest; the reward stays on CPUs. On one GPU
    (`gpus` ≤ 1) the replicas split the rollout's share of it; over several GPUs each replica's share
    is of its own GPU (`placement.gpu_layout` stacks ranks that land on one GPU itself)."""
    g = cfg.gpu_share  # of each GPU
    split = cfg.rollout_replicas if cfg.gpus <= 1 else 1
    # beta = 0 (the default, as TRL's): no KL term, so no reference model is loaded at all
    return {
        "policy": RoleSpec(cpus=1, gpus=g / 2, replicas=cfg.ranks),
        "rollout": RoleSpec(
            cpus=0.5,
            gpus=g / (4 if cfg.beta else 2) / split,
            replicas=cfg.rollout_replicas,
            tensor_parallel=cfg.rollout_tensor_parallel,
        ),
        # (with LoRA the reference is the policy's own base: no actor)
        **(
            {"reference": RoleSpec(cpus=0.5, gpus=g / 4, replicas=cfg.reference_ranks)}
            if cfg.beta and not cfg.lora()
            else {}
        ),
        "reward": RoleSpec(cpus=0.5 if use_rm else 0.25, replicas=cfg.reward_ranks),
    }
