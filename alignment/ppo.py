"""PPO for RLHF with policy, critic, rollout, reference and reward as separate Ray actors.

    from raypai.alignment import PPOConfig, run_ppo
    from raypai.alignment.data import load, split
    train, held_out = split(load("prompts.jsonl", "prompt"))
    run_ppo("sft_model/", "ppo_model/", train, held_out, PPOConfig(steps=30), rewards=["my_pkg.rewards:fn"],
            reward_model_dir="rm/")

Per step: rollout → reference log-probs, critic values, rewards → per-token rewards (score at the
last token − β·KL) → GAE → μ epochs of clipped policy and value updates → sync → eval → checkpoint.
The driver submits a step's calls at once and Ray hands each role its inputs from the others (the
trainers compute the advantages and returns themselves); it waits only for the metrics.
"""

from __future__ import annotations

import random

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
from raypai.alignment.config import LIVE_ENGINES, PPOConfig
from raypai.alignment.evaluate import reward_with
from raypai.alignment.losses import masked_mean
from raypai.alignment.losses.objectives import PPOPolicy, PPOValue
from raypai.alignment.placement import RoleSpec
from raypai.alignment.sync import start_sync, wait_loads

TIMES = ("time_rollout", "time_score", "time_train", "time_sync")


def run_ppo(
    model_dir: str,
    out_dir: str,
    train: list,
    held_out: list,
    cfg: PPOConfig,
    *,
    run_name: str = "ppo",
    rewards=None,
    reward_model_dir: str | None = None,
    checkpoint_dir: str | None = None,
    logger=None,
    lineage: dict | None = None,
) -> dict:
    """`train`/`held_out`: PromptExample lists; `rewards` as in run_grpo. Returns the summary
    (held-out reward before/after, mean losses and time split); the aligned policy is written to
    `out_dir`. The critic starts from the reward model when given."""
    inputs = rl_inputs("PPO", model_dir, cfg, train, held_out, rewards=rewards, reward_model_dir=reward_model_dir)
    check_plan("ppo", model_dir, cfg, reward_model_dir)
    use_rm, pad_id = inputs.use_rm, inputs.pad_id
    g = cfg.gpu_share  # of each GPU
    specs = role_specs(cfg, use_rm)
    device = "cuda" if g else "cpu"
    # the roles take turns on one GPU, so they share a bundle there; on CPUs each keeps its own
    targets = {"kl_coef": cfg.kl_coef, "gamma": cfg.gamma, "lam": cfg.lam}
    policy_objective, value_objective = (
        PPOPolicy(clip_eps=cfg.clip_eps, **targets),
        PPOValue(clip=cfg.value_clip, **targets),
    )
    with Run(
        run_name, specs, colocate=(tuple(specs),) if g else (), logger=logger, gpus=cfg.gpus, placement=cfg.placement
    ) as run:
        # the roles take turns: the replica reads the trainer's own parameters (raypai.alignment.sync;
        # on a GPU, a bf16 copy through host shared memory)
        policy = run.place_policy(
            model_dir,
            cfg,
            live_weights=cfg.rollout_engine in LIVE_ENGINES,
            device=device,
            sync_dtype=sync_dtype(cfg, model_dir),
        )
        critic = run.place_trained(
            "critic",
            reward_model_dir or model_dir,
            cfg.lr_of(cfg.critic_lr),
            cfg,
            head="token_value",
            device=device,
        )  # a scalar per position; from the reward model, its score head carries over
        rollouts, reward = run.place_sampling(model_dir, cfg, inputs, reward_model_dir, device=device)
        reference = run.place_reference(model_dir, cfg, policy, device=device)
        rng = random.Random(cfg.seed)
        start, saved = resume_state("ppo", checkpoint_dir, rng, policy, rollouts, critic, **sync_path(cfg))
        eval_before = reward_with(rollouts[0], reward, held_out, cfg.max_new_tokens)
        history = []
        for step in range(start + 1, cfg.steps + 1):
            t = Sections()
            with asleep([policy, critic], on_gpu=bool(g)) as offload:
                now = launch(
                    rollouts,
                    rng.sample(train, min(cfg.prompts_per_step, len(train))),
                    1,
                    max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                )
                if g:  # on a GPU the trainers sleep until the replicas are done
                    with t("time_rollout"):
                        ray.wait(now.refs, num_returns=len(now.refs))
            # the whole step is submitted at once: Ray hands the samples to the reward, the rollout's
            # and the reference's log-probs and the critic's values (which run in parallel), and all
            # of them to both trainers, each call starting as soon as its inputs are in; every trainer
            # computes the step's advantages and returns itself (`losses.ppo_targets`)
            on = {"rows": now.rows, "pad_id": pad_id}
            scored = score_launched(reward, now)
            old_lp, ref_lp, values = (
                rollouts[0].logprobs_on.remote(on, *now.refs),
                reference.logprobs_on.remote(on, *now.refs),
                critic.values_on.remote(on, *now.refs),
            )
            handed = (scored, old_lp, ref_lp, values, on, *now.refs)
            updates = [
                [
                    policy.update_on.remote(policy_objective, *handed),
                    critic.update_on.remote(value_objective, *handed),
                ]
                for _ in range(cfg.ppo_epochs)
            ]  # each trainer runs its epochs in turn
            loads = start_sync(
                policy, rollouts, **sync_path(cfg)
            )  # each replica loads after the updates queued before it
            # while they work: what the metrics need (the time_* sections: what this process waited)
            with t("time_rollout"):
                s = collect(now, pad_id=pad_id)
            with t("time_score"):
                score, (old, ref) = to_tensor(scores_of(scored)["total"]), ray.get([old_lp, ref_lp])
            with t("time_train"):
                # every epoch waited for (an error in any is raised); the metrics are the last epoch's
                *_, pm, vm = ray.get([ref for epoch in updates for ref in epoch])
            with t("time_sync"):
                sizes = wait_loads(loads)
            mask = s.batch["response_mask"]
            seconds = t.total()
            metrics = {
                "reward_mean": score.mean().item(),
                "reward_std": score.std().item(),
                "kl": masked_mean(old - ref, mask).item(),
                "policy_loss": pm["loss"],
                "clip_fraction": pm["clip_fraction"],
                "entropy": pm["entropy"],
                "grad_norm": pm["grad_norm"],
                "value_loss": vm["loss"],
                "value_grad_norm": vm["grad_norm"],
                "response_length": response_length(s.batch),
                "sync_seconds": t.seconds["time_sync"],
                "sync_bytes": sizes[0] if sizes else 0,
                **t.seconds,
                **offload,
                "samples": len(s.completions),
                "step_seconds": seconds,
                "samples_per_s": len(s.completions) / seconds,
            }
            end_step(
                "ppo",
                step,
                metrics,
                steps=cfg.steps,
                eval_every=cfg.eval_every,
                evaluate=lambda: reward_with(rollouts[0], reward, held_out, cfg.max_new_tokens),
                checkpoint_every=cfg.checkpoint_every,
                checkpoint=(
                    lambda k: save_run(checkpoint_dir, step=k, rng=rng, policy=policy, rollouts=rollouts, critic=critic)
                )
                if checkpoint_dir
                else None,
                logger=logger,
                history=history,
            )
        eval_after = reward_with(rollouts[0], reward, held_out, cfg.max_new_tokens)
        summary = rl_summary(
            eval_before, eval_after, history, ("reward_mean", "value_loss", "policy_loss", "kl", *TIMES)
        )
        summary["sync_setup_seconds"] = saved["sync_setup_seconds"]  # the first round, before step 1
        return run.finish(policy, out_dir, "ppo", cfg, summary, lineage)


def role_specs(cfg: PPOConfig, use_rm: bool) -> dict[str, RoleSpec]:
    """The run's roles, with their shares of each GPU for the trainers, the replicas and the
    reference; the reward on CPUs."""
    g = cfg.gpu_share  # of each GPU
    return {
        "policy": RoleSpec(cpus=1, gpus=0.4 * g, replicas=cfg.ranks),
        "critic": RoleSpec(cpus=0.5, gpus=0.2 * g, replicas=cfg.ranks),
        "rollout": RoleSpec(
            cpus=0.5,
            # on one GPU the replicas split the rollout's share; over several, each holds it on its own GPU
            gpus=0.2 * g / (cfg.rollout_replicas if cfg.gpus <= 1 else 1),
            replicas=cfg.rollout_replicas,
            tensor_parallel=cfg.rollout_tensor_parallel,
        ),
        **(
            {} if cfg.lora() else {"reference": RoleSpec(cpus=0.5, gpus=0.2 * g, replicas=cfg.reference_ranks)}
        ),  # LoRA: the policy's base
        "reward": RoleSpec(cpus=0.5 if use_rm else 0.25, replicas=cfg.reward_ranks),
    }
