"""DPO (offline pairs, reference log-probs precomputed once by the Reference actor) and online DPO
(sample n completions per prompt, rank them with the Reward actor, best vs worst).

    from raypai.alignment.dpo import run_dpo
    from raypai.alignment.tasks import arithmetic as ar
    train, held_out = ar.split()
    run_dpo("sft/", "dpo/", ar.preference_pairs(train), ar.preference_pairs(held_out), DPOConfig())
    run_dpo("sft/", "odpo/", [], ar.preference_pairs(held_out), DPOConfig(online=True), problems=train,
            held_out=held_out)
"""

from __future__ import annotations

import random
from dataclasses import asdict

import ray

from raypai.alignment._loop import sample
from raypai.alignment._tensors import encode, sequence_logprob
from raypai.alignment.config import DPOConfig
from raypai.alignment.evaluate import accuracy_with
from raypai.alignment.losses import ChosenRejected, dpo_loss
from raypai.alignment.placement import Placement, RoleSpec
from raypai.alignment.roles import PolicyTrainer, Reference, Reward, Rollout
from raypai.alignment.sync import sync_weights
from raypai.alignment.tasks.arithmetic import Problem, exact_match_reward
from raypai.errors import ConfigError


def _pair_batches(tok, pairs):
    prompts = [p["prompt"] for p in pairs]
    return encode(tok, prompts, [p["chosen"] for p in pairs]), encode(tok, prompts, [p["rejected"] for p in pairs])


def _seq_lp(actor, batch):
    return sequence_logprob(ray.get(actor.logprobs.remote(batch)), batch["response_mask"])


def preference_metrics(policy, ref: ChosenRejected, chosen: dict, rejected: dict, beta: float) -> dict:
    """Implicit-reward accuracy and margin of the policy on fixed pairs (Rafailov et al. 2023 §5)."""
    out = dpo_loss(ChosenRejected(_seq_lp(policy, chosen), _seq_lp(policy, rejected)), ref, beta=beta)
    return {"preference_accuracy": out.accuracy, "margin": out.margin}


def run_dpo(model_dir: str, out_dir: str, pairs: list[dict], eval_pairs: list[dict], cfg: DPOConfig, *,
            run_name: str = "dpo", problems: list[Problem] | None = None, held_out: list[Problem] | None = None,
            reward_fns=None, logger=None, lineage: dict | None = None) -> dict:
    """Offline DPO on `pairs` ({prompt, chosen, rejected}) when `cfg.online` is False; online DPO
    on `problems` otherwise. Preference accuracy and margin are measured on `eval_pairs`; online
    runs also report held-out greedy exact-match accuracy on `held_out`."""
    from transformers import AutoTokenizer

    cfg = cfg.validate()
    if cfg.online and not problems:
        raise ConfigError(["online DPO needs `problems` to sample from (got none): pass e.g. "
                           "raypai.alignment.tasks.arithmetic.split()[0]"], what="online DPO inputs")
    tok = AutoTokenizer.from_pretrained(model_dir)
    specs = {"policy": RoleSpec(cpus=1), "reference": RoleSpec(cpus=0.5)}
    if cfg.online:
        specs.update(rollout=RoleSpec(cpus=0.5), reward=RoleSpec(cpus=0.25))
    place = Placement(run_name, specs)
    try:
        [policy] = place.place("policy", PolicyTrainer, model_dir, cfg.lr, cfg.zero_stage, cfg.seed)
        [reference] = place.place("reference", Reference, model_dir)
        ev_c, ev_r = _pair_batches(tok, eval_pairs)
        ev_ref = ChosenRejected(_seq_lp(reference, ev_c), _seq_lp(reference, ev_r))  # computed once
        before = preference_metrics(policy, ev_ref, ev_c, ev_r, cfg.beta)
        rng = random.Random(cfg.seed)
        if cfg.online:
            [rollout] = place.place("rollout", Rollout, model_dir, cfg.seed)
            [reward] = place.place("reward", Reward, reward_fns or [(exact_match_reward, 1.0)])
            held = held_out or []
            acc_before = accuracy_with(rollout, held, cfg.max_new_tokens) if held else None
        else:
            all_c, all_r = _pair_batches(tok, pairs)  # reference log-probs of every pair, computed once
            ref_all = ChosenRejected(_seq_lp(reference, all_c), _seq_lp(reference, all_r))
        for step in range(1, cfg.steps + 1):
            if cfg.online:
                s = sample([rollout], rng.sample(problems, min(cfg.batch_size, len(problems))), cfg.num_samples,
                           pad_id=tok.pad_token_id, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature)
                scores = ray.get(reward.score.remote(s.prompts, s.completions, s.rows))["total"]
                batch_pairs = best_vs_worst(s.prompts, s.completions, scores, cfg.num_samples)
                if not batch_pairs:  # every group tied: no preference to learn from this step
                    continue
                c, r = _pair_batches(tok, batch_pairs)
                ref = ChosenRejected(_seq_lp(reference, c), _seq_lp(reference, r))
            else:
                idx = [rng.randrange(len(pairs)) for _ in range(cfg.batch_size)]
                c, r = _pair_batches(tok, [pairs[i] for i in idx])
                ref = ChosenRejected(ref_all.chosen[idx], ref_all.rejected[idx])
            m = ray.get(policy.dpo_step.remote(c, r, ref.chosen, ref.rejected, cfg.beta, cfg.loss_type,
                                               cfg.label_smoothing))
            if cfg.online:
                m.update(pairs=len(batch_pairs), reward_mean=sum(scores) / len(scores), **sync_weights(policy, [rollout]))
            if logger is not None:
                logger.log_metrics({f"dpo/{k}": v for k, v in m.items()}, step=step)
        after = preference_metrics(policy, ev_ref, ev_c, ev_r, cfg.beta)
        metrics = {"preference_accuracy_before": before["preference_accuracy"],
                   "preference_accuracy_after": after["preference_accuracy"],
                   "margin_before": before["margin"], "margin_after": after["margin"]}
        if cfg.online and held:
            metrics.update(eval_accuracy_before=acc_before,
                           eval_accuracy_after=accuracy_with(rollout, held, cfg.max_new_tokens))
        ray.get(policy.export.remote(out_dir, {"algorithm": "online_dpo" if cfg.online else "dpo",
                                               "config": asdict(cfg), "metrics": metrics, "lineage": lineage or {}}))
    finally:
        place.shutdown()
    if logger is not None:
        logger.log_metrics(metrics)
    return metrics


def best_vs_worst(prompts: list[str], completions: list[str], scores: list[float], n: int) -> list[dict]:
    """Online DPO pairs (Guo et al. 2024, "Direct language model alignment from online AI feedback"):
    per group of n samples of one prompt, the best-scored completion is chosen and the worst rejected;
    groups whose scores all tie carry no preference and are skipped."""
    pairs = []
    for g in range(0, len(prompts), n):
        sc = scores[g:g + n]
        best, worst = max(range(n), key=sc.__getitem__), min(range(n), key=sc.__getitem__)
        if sc[best] > sc[worst]:
            pairs.append({"prompt": prompts[g], "chosen": completions[g + best], "rejected": completions[g + worst]})
    return pairs
