"""DPO (offline pairs, reference log-probs precomputed once by the Reference actor) and online DPO
(sample n completions per prompt, rank them with the Reward actor, best vs worst).

    from raypai.alignment import DPOConfig, run_dpo
    from raypai.alignment.data import load, split
    train, held = split(load("prefs.jsonl", "preference"))            # prompt / chosen / rejected
    run_dpo("sft/", "dpo/", train, held, DPOConfig())
    prompts, held_prompts = split(load("prompts.jsonl", "prompt"))
    run_dpo("sft/", "odpo/", [], held, DPOConfig(online=True), prompts=prompts, held_out=held_prompts,
            rewards=["my_pkg.rewards:accuracy"])
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import asdict

import ray

from raypai.alignment._loop import asleep, launch, score_launched, scores_of
from raypai.alignment._tensors import encode_pairs, sequence_logprob
from raypai.alignment.config import LIVE_ENGINES, DPOConfig
from raypai.alignment.evaluate import reward_with
from raypai.alignment.losses import ChosenRejected, dpo_loss
from raypai.alignment.models import check_causal_lm, check_prompts, format_and_limit
from raypai.alignment.placement import Placement, RoleSpec
from raypai.alignment.rewards import resolve
from raypai.alignment.roles import PolicyTrainer, Reference, Reward, Rollout
from raypai.alignment.sync import start_sync, wait_loads
from raypai.errors import ConfigError


def _seq_lp(actor, batch, chunk: int = 64):
    """Summed response log-probs (B,), computed `chunk` rows at a time (a dataset's pairs need not fit one pass)."""
    import torch

    B = batch["input_ids"].shape[0]
    parts = [{k: v[i : i + chunk] for k, v in batch.items()} for i in range(0, B, chunk)]
    lps = ray.get([actor.logprobs.remote(p) for p in parts])
    return torch.cat([sequence_logprob(lp, p["response_mask"]) for lp, p in zip(lps, parts)])


def preference_metrics(policy, ref: ChosenRejected, chosen: dict, rejected: dict, beta: float) -> dict:
    """Implicit-reward accuracy and margin of the policy on fixed pairs (Rafailov et al. 2023 §5)."""
    out = dpo_loss(ChosenRejected(_seq_lp(policy, chosen), _seq_lp(policy, rejected)), ref, beta=beta)
    return {"preference_accuracy": out.accuracy, "margin": out.margin}


# Offline DPO: steps per call to the policy actor, and calls queued on it at once (the batches do
# not depend on the updates). A call costs ≈ 2 ms of Ray's own work in the actor (measured with the
# issue #14 benchmark model: 26.0 ms a step one per call, 24.0 ms forty per call, medians of 6), 8 %
# of a step that small; the metrics of a call's steps reach the logger together.
STEPS_PER_CALL = 4
CALLS_IN_FLIGHT = 2


def run_dpo(
    model_dir: str,
    out_dir: str,
    pairs: list,
    eval_pairs: list,
    cfg: DPOConfig,
    *,
    run_name: str = "dpo",
    prompts: list | None = None,
    held_out: list | None = None,
    rewards=None,
    logger=None,
    lineage: dict | None = None,
) -> dict:
    """Offline DPO on `pairs` (PreferenceExample) when `cfg.online` is False; online DPO on `prompts`
    (PromptExample, ranked by `rewards`) otherwise. Preference accuracy and margin are measured on
    `eval_pairs`; online runs also report the held-out reward of greedy completions on `held_out`."""
    cfg = cfg.validate()
    check_causal_lm(model_dir)
    fmt, trunc = format_and_limit(model_dir, cfg)
    reward_fns = resolve(rewards)
    if cfg.online and not prompts:
        raise ConfigError(
            [
                "online DPO needs `prompts` to sample from (got none): pass prompt examples, e.g. "
                "raypai.alignment.data.load('prompts.jsonl', 'prompt')"
            ],
            what="online DPO inputs",
        )
    if cfg.online and not reward_fns:
        raise ConfigError(
            ["online DPO ranks its samples with rewards: pass rewards=['my_pkg.rewards:fn']"], what="online DPO inputs"
        )
    if not cfg.online and not pairs:
        raise ConfigError(["DPO needs preference pairs (got none)"], what="DPO inputs")
    if not eval_pairs:
        raise ConfigError(
            ["DPO needs held-out preference pairs to measure preference accuracy (got none)"], what="DPO inputs"
        )
    if cfg.online:
        check_prompts(fmt, prompts, trunc, cfg.max_new_tokens, "training prompt")
    ev_c, ev_r = encode_pairs(fmt, eval_pairs, trunc, "held-out pair")  # bad pairs fail before any actor starts
    if not cfg.online:
        all_c, all_r = encode_pairs(fmt, pairs, trunc, "training pair")
    pad_id = fmt.tok.pad_token_id
    g = cfg.gpus  # on a GPU: the trainer half of it, the reference (and online, the rollout) the rest
    specs = {
        "policy": RoleSpec(cpus=1, gpus=g / 2),
        "reference": RoleSpec(cpus=0.5, gpus=g / 4 if cfg.online else g / 2),
    }
    if cfg.online:
        specs.update(rollout=RoleSpec(cpus=0.5, gpus=g / 4), reward=RoleSpec(cpus=0.25))
    device = "cuda" if g else "cpu"
    # the roles take turns (reference log-probs first, or per step before the update): one shared bundle,
    # and each role works with all of its CPUs
    place = Placement(run_name, specs, colocate=(tuple(specs),))
    threads = max(1, round(sum(r.cpus for r in specs.values())))
    try:
        # online: sampling and updates take turns, so the replica reads the trainer's own parameters
        [policy] = place.place(
            "policy",
            PolicyTrainer,
            model_dir,
            cfg.lr,
            cfg.zero_stage,
            cfg.seed,
            threads=threads,
            live_weights=cfg.online and cfg.rollout_engine in LIVE_ENGINES,
            device=device,
            sync_dtype="bfloat16" if g else None,
        )
        [reference] = place.place("reference", Reference, model_dir, threads=threads, device=device)
        if cfg.online:  # every role starts now, together (their processes start in parallel)
            [rollout] = place.place(
                "rollout",
                Rollout,
                model_dir,
                cfg.seed,
                threads=threads,
                engine=cfg.rollout_engine,
                compiled=cfg.compile_rollout,
                device=device,
                gpu_share=specs["rollout"].gpus,
            )
            [reward] = place.place("reward", Reward, reward_fns)
        ev_ref = ChosenRejected(_seq_lp(reference, ev_c), _seq_lp(reference, ev_r))  # computed once
        before = preference_metrics(policy, ev_ref, ev_c, ev_r, cfg.beta)
        rng = random.Random(cfg.seed)
        if cfg.online:
            held = held_out or []
            eval_before = reward_with(rollout, reward, held, cfg.max_new_tokens) if held else None
        else:  # reference log-probs of every pair, computed once, held by the trainer with the pairs:
            # a step then names its rows, instead of shipping its tensors through Ray (≈ 1 ms a step)
            ray.get(policy.hold_pairs.remote(all_c, all_r, _seq_lp(reference, all_c), _seq_lp(reference, all_r)))
            del all_c, all_r  # the trainer's copy is the one used: a large dataset is not held twice

        def log(step, m):
            if logger is not None:
                logger.log_metrics({f"dpo/{k}": v for k, v in m.items()}, step=step)

        if cfg.online:
            # per step the driver submits the whole chain and waits only for its results: Ray hands the
            # samples to the reward, the samples and scores to the reference (the pairs' log-probs) and
            # all three to the trainer, each call starting as soon as its inputs are in
            sampled = {"pad_id": pad_id, "n": cfg.num_samples}
            dpo_args = {"beta": cfg.beta, "loss_type": cfg.loss_type, "label_smoothing": cfg.label_smoothing}
            for step in range(1, cfg.steps + 1):
                with asleep([policy], on_gpu=bool(g)) as offload:  # on a GPU the trainer sleeps while sampling
                    now = launch(
                        [rollout],
                        rng.sample(prompts, min(cfg.batch_size, len(prompts))),
                        cfg.num_samples,
                        max_new_tokens=cfg.max_new_tokens,
                        temperature=cfg.temperature,
                    )
                    if g:
                        ray.wait(now.refs, num_returns=len(now.refs))
                scored = score_launched(reward, now)
                on = {**sampled, "rows": now.rows}
                ref = reference.pair_logprobs_on.remote(scored, on, *now.refs)
                update = policy.online_dpo_step_on.remote(scored, ref, on, *now.refs, **dpo_args)
                loads = start_sync(policy, [rollout])  # queued behind the update on the trainer
                scores = scores_of(scored)["total"]  # a reward function's own error surfaces here, as itself
                m = ray.get(update)
                t0 = time.perf_counter()  # sync_seconds: the wait for the replica's load left after the update
                sizes = wait_loads(loads)
                sync = {"sync_seconds": time.perf_counter() - t0, "sync_bytes": sizes[0] if sizes else 0}
                if not m["pairs"]:  # every group tied: no preference to learn from this step
                    continue
                m.update(reward_mean=sum(scores) / len(scores), **offload, **sync)
                log(step, m)
        else:
            # the first step alone (its metrics come at once), then STEPS_PER_CALL steps a call with
            # CALLS_IN_FLIGHT calls queued on the policy actor: the driver's round trip and Ray's
            # per-call work leave the critical path
            steps = list(range(1, cfg.steps + 1))
            calls = [steps[:1]] + [steps[i : i + STEPS_PER_CALL] for i in range(1, len(steps), STEPS_PER_CALL)]
            in_flight: deque = deque()
            for call in calls:
                idx = [[rng.randrange(len(pairs)) for _ in range(cfg.batch_size)] for _ in call]
                in_flight.append(
                    (call, policy.dpo_steps_held.remote(idx, cfg.beta, cfg.loss_type, cfg.label_smoothing))
                )
                while len(in_flight) >= CALLS_IN_FLIGHT or (in_flight and call is calls[-1]):
                    done, ref_m = in_flight.popleft()
                    for step, m in zip(done, ray.get(ref_m)):
                        log(step, m)
        after = preference_metrics(policy, ev_ref, ev_c, ev_r, cfg.beta)
        metrics = {
            "preference_accuracy_before": before["preference_accuracy"],
            "preference_accuracy_after": after["preference_accuracy"],
            "margin_before": before["margin"],
            "margin_after": after["margin"],
        }
        metrics["truncated"] = trunc.truncated
        if cfg.online and held:
            metrics.update(
                eval_reward_before=eval_before, eval_reward_after=reward_with(rollout, reward, held, cfg.max_new_tokens)
            )
        ray.get(
            policy.export.remote(
                out_dir,
                {
                    "algorithm": "online_dpo" if cfg.online else "dpo",
                    "config": asdict(cfg),
                    "metrics": metrics,
                    "lineage": lineage or {},
                },
            )
        )
    finally:
        place.shutdown()
    if logger is not None:
        logger.log_metrics(metrics)
    return metrics
