"""GRPO with policy, rollout, reference and reward as separate Ray actors.

    from raypai.alignment.grpo import run_grpo
    from raypai.alignment.tasks import arithmetic as ar
    train, held_out = ar.split()
    run_grpo("sft_model/", "grpo_model/", train, held_out, GRPOConfig(steps=30), checkpoint_dir="ckpt/")

The loop reads like single-process code: rollout → reference log-probs + rewards → advantages →
train → sync weights → eval → checkpoint. Re-running with the same `checkpoint_dir` resumes.
"""

from __future__ import annotations

import random
from dataclasses import asdict

import ray

from raypai.alignment._loop import Sections, mean_of, response_length, sample, throughput, to_tensor
from raypai.alignment.checkpoint import load_run, save_run
from raypai.alignment.config import GRPOConfig
from raypai.alignment.evaluate import accuracy_with
from raypai.alignment.losses import grpo_advantages
from raypai.alignment.placement import Placement, RoleSpec
from raypai.alignment.roles import PolicyTrainer, Reference, Reward, Rollout
from raypai.alignment.sync import sync_weights
from raypai.alignment.tasks.arithmetic import Problem, exact_match_reward

TIMES = ("time_rollout", "time_reward", "time_reference", "time_train", "time_sync")


def run_grpo(model_dir: str, out_dir: str, train: list[Problem], held_out: list[Problem], cfg: GRPOConfig, *,
             run_name: str = "grpo", reward_fns=None, reward_model_dir: str | None = None,
             checkpoint_dir: str | None = None, logger=None, lineage: dict | None = None) -> dict:
    """Returns the summary (held-out greedy accuracy before/after, mean samples/s and time split);
    the aligned policy is written to `out_dir` as an HF folder with `raypai.json`.
    `reward_fns`: [(callable, weight)], default the exact-answer rule; a reward model scored in
    with weight `cfg.reward_model_weight` when `reward_model_dir` is given."""
    from transformers import AutoTokenizer

    cfg = cfg.validate()
    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    use_rm = bool(reward_model_dir and cfg.reward_model_weight)
    place = Placement(run_name, {"policy": RoleSpec(cpus=1), "rollout": RoleSpec(cpus=0.5, replicas=cfg.rollout_replicas),
                                 "reference": RoleSpec(cpus=0.5), "reward": RoleSpec(cpus=0.5 if use_rm else 0.25)})
    try:
        [policy] = place.place("policy", PolicyTrainer, model_dir, cfg.lr, cfg.zero_stage, cfg.seed)
        rollouts = place.place("rollout", Rollout, model_dir, cfg.seed)
        [reference] = place.place("reference", Reference, model_dir)
        [reward] = place.place("reward", Reward, reward_fns or [(exact_match_reward, 1.0)],
                               reward_model_dir if use_rm else None, cfg.reward_model_weight)
        rng = random.Random(cfg.seed)
        start = load_run(checkpoint_dir, rng=rng, policy=policy, rollouts=rollouts) if checkpoint_dir else 0
        if start:
            sync_weights(policy, rollouts)
            print(f"[raypai.grpo] resumed from {checkpoint_dir} at step {start}", flush=True)
        acc_before = accuracy_with(rollouts[0], held_out, cfg.max_new_tokens)
        history = []
        for step in range(start + 1, cfg.steps + 1):
            t = Sections()
            with t("time_rollout"):
                s = sample(rollouts, rng.sample(train, min(cfg.prompts_per_step, len(train))), cfg.group_size,
                           pad_id=pad_id, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                           top_p=cfg.top_p)
            # reference and reward work in parallel; time_reference is the wait left after the rewards
            ref_lp = reference.logprobs.remote(s.batch) if cfg.beta else None
            # μ = 1: the old policy *is* the current one, the trainer detaches its own log-probs (no extra pass)
            old_lp = rollouts[0].logprobs.remote(s.batch) if cfg.inner_iterations > 1 else None
            with t("time_reward"):
                scores = ray.get(reward.score.remote(s.prompts, s.completions, s.rows))
            with t("time_reference"):
                ref_lp, old_lp = (ray.get(x) if x is not None else None for x in (ref_lp, old_lp))
            rewards = to_tensor(scores["total"])
            adv = grpo_advantages(rewards, cfg.group_size)  # (B,) one per completion
            with t("time_train"):
                for _ in range(cfg.inner_iterations):
                    m = ray.get(policy.grpo_step.remote(s.batch, old_lp, ref_lp, adv, cfg.clip_eps, cfg.clip_eps_high,
                                                        cfg.beta, cfg.aggregation, cfg.max_new_tokens))
            with t("time_sync"):
                sync = sync_weights(policy, rollouts)
            metrics = {"reward_mean": rewards.mean().item(), "reward_std": rewards.std().item(),
                       "policy_loss": m["loss"], "kl": m["kl"], "clip_fraction": m["clip_fraction"],
                       "entropy": m["entropy"], "grad_norm": m["grad_norm"], "response_length": response_length(s.batch),
                       **sync, **t.seconds, "samples": len(s.completions),
                       "step_seconds": t.total(), "samples_per_s": len(s.completions) / t.total()}
            if step % cfg.eval_every == 0:
                metrics["eval_accuracy"] = accuracy_with(rollouts[0], held_out, cfg.max_new_tokens)
                print(f"[raypai.grpo] step {step}/{cfg.steps} reward {metrics['reward_mean']:.3f} "
                      f"held-out accuracy {metrics['eval_accuracy']:.3f}", flush=True)
            if checkpoint_dir and step % cfg.checkpoint_every == 0:
                metrics["checkpoint_seconds"] = save_run(checkpoint_dir, step=step, rng=rng, policy=policy,
                                                         rollouts=rollouts)
            if logger is not None:
                logger.log_metrics(metrics, step=step)
            history.append(metrics)
        summary = {"eval_accuracy_before": acc_before,
                   "eval_accuracy_after": accuracy_with(rollouts[0], held_out, cfg.max_new_tokens),
                   "steps_run": len(history), "samples_per_s": throughput(history),
                   **mean_of(history, ("reward_mean", "sync_seconds", *TIMES)),
                   "sync_bytes": history[-1]["sync_bytes"] if history else 0}
        ray.get(policy.export.remote(out_dir, {"algorithm": "grpo", "config": asdict(cfg), "metrics": summary,
                                               "lineage": lineage or {}}))
    finally:
        place.shutdown()
    if logger is not None:
        logger.log_metrics(summary)
    return summary
