"""Pipeline steps: sft, reward_model, dpo, online_dpo, grpo, ppo, evaluate — on the arithmetic task.
Each takes model Artifacts (HF folders) and plain parameters and returns a model Artifact whose
metadata holds the run's metrics and parent ids (see docs/alignment.md)."""

from __future__ import annotations

import hashlib

from raypai import Artifact, StepContext, step
from raypai.alignment.config import DPOConfig, GRPOConfig, PPOConfig, RewardModelConfig, SFTConfig
from raypai.alignment.dpo import run_dpo
from raypai.alignment.evaluate import accuracy, perplexity
from raypai.alignment.grpo import run_grpo
from raypai.alignment.ppo import run_ppo
from raypai.alignment.reward_model import train_reward_model
from raypai.alignment.sft import run_sft
from raypai.alignment.tasks import arithmetic as ar


def _save_model(ctx: StepContext, out, name: str, metrics: dict, parents: dict[str, Artifact]) -> Artifact:
    ctx.log_metrics(metrics)
    return ctx.save(out, kind="model", name=name,
                    metadata={"metrics": metrics, "parents": {k: a.id for k, a in parents.items()}})


@step(cpus=0.5)
def sft(ctx: StepContext, base_model: Artifact, steps: int = 150, lr: float = 3e-3, batch_size: int = 16,
        seed: int = 0) -> Artifact:
    train, held = ar.split(seed=seed)
    out = ctx.output_dir("sft")
    m = run_sft(str(base_model.local_path()), str(out), ar.sft_rows(train), ar.sft_rows(held),
                SFTConfig(steps=steps, lr=lr, batch_size=batch_size, seed=seed),
                run_name=f"sft-{ctx.step_run_id[:8]}", logger=ctx.logger, lineage={"base_model": base_model.id})
    m["eval_accuracy"] = accuracy(out, held)
    return _save_model(ctx, out, "sft_model", m, {"base_model": base_model})


@step(cpus=0.5)
def reward_model(ctx: StepContext, sft_model: Artifact, steps: int = 300, lr: float = 5e-4, batch_size: int = 32,
                 seed: int = 0) -> Artifact:
    train, held = ar.split(seed=seed)
    out = ctx.output_dir("rm")
    # held-out = pairs with wrong answers the model never saw (the pair split of RM data)
    m = train_reward_model(str(sft_model.local_path()), str(out), ar.preference_pairs(train, seed, 3),
                           ar.preference_pairs(train, seed + 7, 1), RewardModelConfig(steps=steps, lr=lr, batch_size=batch_size, seed=seed),
                           run_name=f"rm-{ctx.step_run_id[:8]}", logger=ctx.logger)
    return _save_model(ctx, out, "reward_model", m, {"sft_model": sft_model})


@step(cpus=0.5)
def grpo(ctx: StepContext, sft_model: Artifact, reward_model: Artifact | None = None, steps: int = 40,
         prompts_per_step: int = 16, group_size: int = 8, lr: float = 5e-4, beta: float = 0.0,
         aggregation: str = "dapo", reward_model_weight: float = 0.0, seed: int = 0,
         async_rollout: bool = False) -> Artifact:
    """GRPO with the exact-answer rule reward (plus the reward model, weighted, when given);
    `async_rollout` overlaps generation with training, one step off-policy (docs/alignment.md)."""
    cfg = GRPOConfig(steps=steps, prompts_per_step=prompts_per_step, group_size=group_size, lr=lr, beta=beta,
                     aggregation=aggregation, reward_model_weight=reward_model_weight if reward_model else 0.0,
                     async_rollout=async_rollout,
                     seed=seed, eval_every=max(1, steps // 4), checkpoint_every=max(1, steps // 4), max_new_tokens=4)
    train, held = ar.split(seed=seed)
    # the checkpoint folder is keyed by inputs + config, so a retried step resumes its own run
    key = hashlib.sha256(f"{sft_model.digest}{reward_model.digest if reward_model else ''}{cfg}".encode()).hexdigest()[:16]
    out = ctx.output_dir("grpo")
    m = run_grpo(str(sft_model.local_path()), str(out), train, held, cfg, run_name=f"grpo-{ctx.step_run_id[:8]}",
                 reward_model_dir=str(reward_model.local_path()) if reward_model else None,
                 checkpoint_dir=str(ctx.settings.home / "work" / f"grpo-{key}"), logger=ctx.logger,
                 lineage={"sft_model": sft_model.id, "reward_model": reward_model.id if reward_model else None})
    parents = {"sft_model": sft_model, **({"reward_model": reward_model} if reward_model else {})}
    return _save_model(ctx, out, "aligned_model", m, parents)


@step(cpus=0.5)
def dpo(ctx: StepContext, sft_model: Artifact, steps: int = 60, lr: float = 5e-4, beta: float = 0.1,
        loss_type: str = "sigmoid", seed: int = 0) -> Artifact:
    train, held = ar.split(seed=seed)
    out = ctx.output_dir("dpo")
    m = run_dpo(str(sft_model.local_path()), str(out), ar.preference_pairs(train, seed, 1),
                ar.preference_pairs(train, seed + 7, 1), DPOConfig(steps=steps, lr=lr, beta=beta, loss_type=loss_type,
                                                               seed=seed),
                run_name=f"dpo-{ctx.step_run_id[:8]}", logger=ctx.logger, lineage={"sft_model": sft_model.id})
    return _save_model(ctx, out, "aligned_model", m, {"sft_model": sft_model})


@step(cpus=0.5)
def online_dpo(ctx: StepContext, sft_model: Artifact, steps: int = 40, lr: float = 5e-4, beta: float = 0.1,
               num_samples: int = 4, seed: int = 0) -> Artifact:
    """Online DPO: sample `num_samples` answers per prompt, rule reward picks best vs worst."""
    train, held = ar.split(seed=seed)
    out = ctx.output_dir("odpo")
    m = run_dpo(str(sft_model.local_path()), str(out), [], ar.preference_pairs(held, seed + 1),
                DPOConfig(steps=steps, lr=lr, beta=beta, online=True, num_samples=num_samples, seed=seed,
                          max_new_tokens=4),
                problems=train, held_out=held, run_name=f"odpo-{ctx.step_run_id[:8]}", logger=ctx.logger,
                lineage={"sft_model": sft_model.id})
    return _save_model(ctx, out, "aligned_model", m, {"sft_model": sft_model})


@step(cpus=0.5)
def ppo(ctx: StepContext, sft_model: Artifact, reward_model: Artifact | None = None, steps: int = 30,
        prompts_per_step: int = 16, lr: float = 5e-4, kl_coef: float = 0.05, reward_model_weight: float = 0.2,
        seed: int = 0) -> Artifact:
    """PPO with a critic (initialised from the reward model when given) and the exact-answer rule reward."""
    cfg = PPOConfig(steps=steps, prompts_per_step=prompts_per_step, lr=lr, kl_coef=kl_coef, seed=seed,
                    reward_model_weight=reward_model_weight if reward_model else 0.0, max_new_tokens=4,
                    eval_every=max(1, steps // 4), checkpoint_every=max(1, steps // 4))
    train, held = ar.split(seed=seed)
    key = hashlib.sha256(f"{sft_model.digest}{reward_model.digest if reward_model else ''}{cfg}".encode()).hexdigest()[:16]
    out = ctx.output_dir("ppo")
    m = run_ppo(str(sft_model.local_path()), str(out), train, held, cfg, run_name=f"ppo-{ctx.step_run_id[:8]}",
                reward_model_dir=str(reward_model.local_path()) if reward_model else None,
                checkpoint_dir=str(ctx.settings.home / "work" / f"ppo-{key}"), logger=ctx.logger,
                lineage={"sft_model": sft_model.id, "reward_model": reward_model.id if reward_model else None})
    parents = {"sft_model": sft_model, **({"reward_model": reward_model} if reward_model else {})}
    return _save_model(ctx, out, "aligned_model", m, parents)


@step(cpus=0.5)
def evaluate(ctx: StepContext, candidate: Artifact, baseline: Artifact, shards: Artifact, seed: int = 0) -> dict:
    """Held-out arithmetic accuracy and perplexity, candidate vs baseline; `improved` gates promotion."""
    _, held = ar.split(seed=seed)
    res = {"accuracy_candidate": accuracy(candidate.local_path(), held),
           "accuracy_baseline": accuracy(baseline.local_path(), held),
           "ppl_candidate": perplexity(candidate.local_path(), shards.local_path()),
           "ppl_baseline": perplexity(baseline.local_path(), shards.local_path())}
    res["improved"] = res["accuracy_candidate"] > res["accuracy_baseline"]
    ctx.log_metrics({k: float(v) for k, v in res.items()})
    return res
