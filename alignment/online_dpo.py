"""Online DPO (Guo et al. 2024): per step, sample `num_samples` completions per prompt, rank them
with the Reward actor, and train DPO on best vs worst of each group, the Reference scoring the pairs.

    from raypai.alignment import DPOConfig
    from raypai.alignment.online_dpo import run_online_dpo
    from raypai.alignment.data import load, split
    prompts, held_prompts = split(load("prompts.jsonl", "prompt"))
    run_online_dpo("sft/", "odpo/", prompts, held_prompts, DPOConfig(online=True),
                   eval_pairs=split(load("prefs.jsonl", "preference"))[1], rewards=["my_pkg.rewards:accuracy"])

Per step the driver submits the whole chain and waits only for its results: Ray hands the samples to
the reward, the samples and scores to the reference (the pairs' log-probs) and all three to the
trainer, each call starting as soon as its inputs are in.
"""

from __future__ import annotations

import random
import time

import ray

from raypai.alignment._driver import Run, check_plan, resume_state, rl_inputs, sync_dtype, sync_path
from raypai.alignment._loop import asleep, launch, score_launched, scores_of
from raypai.alignment._tensors import encode_pairs
from raypai.alignment.checkpoint import save_run
from raypai.alignment.config import LIVE_ENGINES, DPOConfig
from raypai.alignment.dpo import dpo_objective, preference_metrics, preference_summary, seq_logprobs
from raypai.alignment.evaluate import reward_with
from raypai.alignment.losses import ChosenRejected
from raypai.alignment.losses.objectives import OnlineDPO
from raypai.alignment.placement import RoleSpec
from raypai.alignment.roles import Rollout
from raypai.alignment.sync import start_sync, wait_loads
from raypai.errors import ConfigError


def run_online_dpo(
    model_dir: str,
    out_dir: str,
    train: list,
    held_out: list,
    cfg: DPOConfig,
    *,
    eval_pairs: list,
    rewards=None,
    run_name: str = "online_dpo",
    logger=None,
    lineage: dict | None = None,
    checkpoint_dir: str | None = None,
) -> dict:
    """`train`/`held_out`: PromptExample lists (sampled from / the held-out reward of greedy
    completions); `eval_pairs`: PreferenceExample pairs for preference accuracy and margin; `rewards`
    as in run_grpo (they rank the samples). `checkpoint_dir`: a checkpoint every
    `cfg.checkpoint_every` steps (policy, the driver's and the rollout's RNG); a re-run resumes."""
    inputs = rl_inputs("online DPO", model_dir, cfg, train, held_out, rewards=rewards)
    check_plan("online_dpo", model_dir, cfg)
    if not eval_pairs:
        raise ConfigError(
            ["online DPO needs held-out preference pairs to measure preference accuracy (got none)"],
            what="online DPO inputs",
        )
    ev_c, ev_r = encode_pairs(inputs.fmt, eval_pairs, inputs.trunc, "held-out pair")
    g = cfg.gpu_share  # of each GPU: the trainer half of it, the reference and the rollout a quarter each
    specs = {
        "policy": RoleSpec(cpus=1, gpus=g / 2, replicas=cfg.ranks),
        **(
            {} if cfg.lora() else {"reference": RoleSpec(cpus=0.5, gpus=g / 4, replicas=cfg.reference_ranks)}
        ),  # LoRA: the policy's base
        "rollout": RoleSpec(cpus=0.5, gpus=g / 4, tensor_parallel=cfg.rollout_tensor_parallel),
        "reward": RoleSpec(cpus=0.25, replicas=cfg.reward_ranks),
    }
    device = "cuda" if g else "cpu"
    threads = max(1, round(sum(r.cpus for r in specs.values())))
    objective = OnlineDPO(dpo_objective(cfg))
    # sampling, scoring and updates take turns: one shared bundle, each role with all of its CPUs
    with Run(run_name, specs, colocate=(tuple(specs),), logger=logger, gpus=cfg.gpus, placement=cfg.placement) as run:
        # the replica reads the trainer's own parameters (they never work at the same time)
        policy = run.place_policy(
            model_dir,
            cfg,
            threads=threads,
            live_weights=cfg.rollout_engine in LIVE_ENGINES,
            device=device,
            sync_dtype=sync_dtype(cfg, model_dir),
        )
        reference = run.place_reference(model_dir, cfg, policy, threads=threads, device=device)
        [rollout] = run.place(
            "rollout",
            Rollout,
            model_dir,
            cfg.seed,
            threads=threads,
            engine=cfg.rollout_engine,
            compiled=cfg.compile_rollout,
            device=device,
            dtype=cfg.dtype(model_dir),
            gpu_share=run.placement.share["rollout"],
            **run.placement.tensor_parallel("rollout", 0),
        )
        reward = run.place_reward(cfg, inputs.reward_fns)
        ev_ref = ChosenRejected(seq_logprobs(reference, ev_c), seq_logprobs(reference, ev_r))  # computed once
        rng = random.Random(cfg.seed)
        start, saved = resume_state("online_dpo", checkpoint_dir, rng, policy, [rollout], **sync_path(cfg))
        before = saved["before"] if start else preference_metrics(policy, ev_ref, ev_c, ev_r, cfg.beta)
        eval_before = saved["eval_before"] if start else reward_with(rollout, reward, held_out, cfg.max_new_tokens)
        extra = {"before": before, "eval_before": eval_before}
        sampled = {"pad_id": inputs.pad_id, "n": cfg.num_samples}
        for step in range(start + 1, cfg.steps + 1):
            with asleep([policy], on_gpu=bool(g)) as offload:  # on a GPU the trainer sleeps while sampling
                now = launch(
                    [rollout],
                    rng.sample(train, min(cfg.batch_size, len(train))),
                    cfg.num_samples,
                    max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                )
                if g:
                    ray.wait(now.refs, num_returns=len(now.refs))
            scored = score_launched(reward, now)
            on = {**sampled, "rows": now.rows}
            ref = reference.pair_logprobs_on.remote(scored, on, *now.refs)
            update = policy.update_on.remote(objective, scored, ref, on, *now.refs)
            loads = start_sync(policy, [rollout], **sync_path(cfg))  # queued behind the update on the trainer
            scores = scores_of(scored)["total"]  # a reward function's own error surfaces here, as itself
            m = ray.get(update)
            t0 = time.perf_counter()  # sync_seconds: the wait for the replica's load left after the update
            sizes = wait_loads(loads)
            if checkpoint_dir and (step % cfg.checkpoint_every == 0 or step == cfg.steps):
                save_run(checkpoint_dir, step=step, rng=rng, policy=policy, rollouts=[rollout], extra=extra)
            if m.get("skipped"):  # every group tied: no preference to learn from this step
                continue
            m.update(
                reward_mean=sum(scores) / len(scores),
                **offload,
                sync_seconds=time.perf_counter() - t0,
                sync_bytes=sizes[0] if sizes else 0,
            )
            if logger is not None:
                logger.log_metrics({f"dpo/{k}": v for k, v in m.items()}, step=step)
        after = preference_metrics(policy, ev_ref, ev_c, ev_r, cfg.beta)
        metrics = {
            **preference_summary(before, after),
            "truncated": inputs.trunc.truncated,
            "eval_reward_before": eval_before,
            "eval_reward_after": reward_with(rollout, reward, held_out, cfg.max_new_tokens),
            "sync_setup_seconds": saved["sync_setup_seconds"],  # the first round, before step 1
        }
        return run.finish(policy, out_dir, "online_dpo", cfg, metrics, lineage)
