"""DPO on offline preference pairs: the reference log-probs of every pair are computed once by the
Reference actor and held, with the pairs, by the policy's Trainer; each step names its rows.

    from raypai.alignment import DPOConfig, run_dpo
    from raypai.alignment.data import load, split
    train, held = split(load("prefs.jsonl", "preference"))            # prompt / chosen / rejected
    run_dpo("sft/", "dpo/", train, held, DPOConfig())

Online DPO (pairs ranked from the policy's own samples) is `raypai.alignment.online_dpo`.
"""

from __future__ import annotations

import random
from collections import deque

import ray

from raypai.alignment._driver import Run, check_lora, check_plan
from raypai.alignment._tensors import encode_pairs, sequence_logprob
from raypai.alignment.checkpoint import Every
from raypai.alignment.config import DPOConfig
from raypai.alignment.losses import ChosenRejected, dpo_loss
from raypai.alignment.losses.objectives import DPO
from raypai.alignment.models import check_causal_lm, format_and_limit
from raypai.alignment.placement import RoleSpec
from raypai.errors import ConfigError


def seq_logprobs(actor, batch, chunk: int = 64):
    """Summed response log-probs (B,), computed `chunk` rows at a time (a dataset's pairs need not fit one pass)."""
    import torch

    B = batch["input_ids"].shape[0]
    parts = [{k: v[i : i + chunk] for k, v in batch.items()} for i in range(0, B, chunk)]
    lps = ray.get([actor.logprobs.remote(p) for p in parts])
    return torch.cat([sequence_logprob(lp, p["response_mask"]) for lp, p in zip(lps, parts)])


def preference_metrics(policy, ref: ChosenRejected, chosen: dict, rejected: dict, beta: float) -> dict:
    """Implicit-reward accuracy and margin of the policy on fixed pairs (Rafailov et al. 2023 §5)."""
    out = dpo_loss(ChosenRejected(seq_logprobs(policy, chosen), seq_logprobs(policy, rejected)), ref, beta=beta)
    return {"preference_accuracy": out.accuracy, "margin": out.margin}


def dpo_objective(cfg: DPOConfig) -> DPO:
    return DPO(beta=cfg.beta, loss_type=cfg.loss_type, label_smoothing=cfg.label_smoothing)


def preference_summary(before: dict, after: dict) -> dict:
    return {
        "preference_accuracy_before": before["preference_accuracy"],
        "preference_accuracy_after": after["preference_accuracy"],
        "margin_before": before["margin"],
        "margin_after": after["margin"],
    }


# Steps per call to the policy actor, and calls queued on it at once (the batches do not depend on
# the updates): a call's own cost in Ray (≈ 2 ms) is paid once for several small steps, and the
# metrics of a call's steps reach the logger together.
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
    checkpoint_dir: str | None = None,
) -> dict:
    """Offline DPO on `pairs` (PreferenceExample); preference accuracy and margin are measured on
    `eval_pairs`; `checkpoint_dir`: checkpoints as it goes (`cfg.checkpoint_every`), and a re-run
    resumes from it. With `cfg.online` this runs online DPO (`raypai.alignment.online_dpo.run_online_dpo`
    on `prompts`, `held_out` and `rewards`)."""
    if cfg.online:
        from raypai.alignment.online_dpo import run_online_dpo

        return run_online_dpo(
            model_dir,
            out_dir,
            prompts or [],
            held_out or [],
            cfg,
            eval_pairs=eval_pairs,
            rewards=rewards,
            run_name=run_name,
            logger=logger,
            lineage=lineage,
            checkpoint_dir=checkpoint_dir,
        )
    check_causal_lm(model_dir)
    check_lora(model_dir, cfg)
    check_plan("dpo", model_dir, cfg)
    fmt, trunc = format_and_limit(model_dir, cfg)
    if not pairs:
        raise ConfigError(["DPO needs preference pairs (got none)"], what="DPO inputs")
    if not eval_pairs:
        raise ConfigError(
            ["DPO needs held-out preference pairs to measure preference accuracy (got none)"], what="DPO inputs"
        )
    ev_c, ev_r = encode_pairs(fmt, eval_pairs, trunc, "held-out pair")  # bad pairs fail before any actor starts
    all_c, all_r = encode_pairs(fmt, pairs, trunc, "training pair")
    g = cfg.gpu_share  # of each GPU: the trainer half of it, the reference the rest
    specs = {"policy": RoleSpec(cpus=1, gpus=g / 2, replicas=cfg.ranks)}
    if not cfg.lora():  # with LoRA the reference is the policy's own base: no actor
        specs["reference"] = RoleSpec(cpus=0.5, gpus=g / 2, replicas=cfg.reference_ranks)
    device = "cuda" if g else "cpu"
    threads = max(1, round(sum(r.cpus for r in specs.values())))
    objective = dpo_objective(cfg)
    # the roles take turns (reference log-probs first, then the updates): one shared bundle, and each
    # role works with all of its CPUs
    with Run(run_name, specs, colocate=(tuple(specs),), logger=logger, gpus=cfg.gpus, placement=cfg.placement) as run:
        policy = run.place_policy(model_dir, cfg, threads=threads, device=device)
        reference = run.place_reference(model_dir, cfg, policy, threads=threads, device=device)
        ev_ref = ChosenRejected(seq_logprobs(reference, ev_c), seq_logprobs(reference, ev_r))  # computed once
        rng = random.Random(cfg.seed)
        ckpt = Every(checkpoint_dir, cfg.checkpoint_every, cfg.steps, rng, policy)
        start, saved = ckpt.resume("dpo")
        before = saved["before"] if start else preference_metrics(policy, ev_ref, ev_c, ev_r, cfg.beta)
        ckpt.extra = {"before": before}
        # reference log-probs of every pair, computed once, held by the trainer with the pairs: a step
        # then names its rows instead of shipping its tensors through Ray
        held = (all_c, all_r, seq_logprobs(reference, all_c), seq_logprobs(reference, all_r))
        ray.get(policy.hold.remote("pairs", held))
        del all_c, all_r, held  # the trainer's copy is the one used: a large dataset is not held twice
        # the first step alone (its metrics come at once), then STEPS_PER_CALL steps a call with
        # CALLS_IN_FLIGHT calls queued on the policy actor: the driver's round trip and Ray's per-call
        # work leave the critical path
        steps = list(range(start + 1, cfg.steps + 1))
        calls = [steps[:1]] + [steps[i : i + STEPS_PER_CALL] for i in range(1, len(steps), STEPS_PER_CALL)]
        in_flight: deque = deque()
        for call in calls:
            rows = [[rng.randrange(len(pairs)) for _ in range(cfg.batch_size)] for _ in call]
            in_flight.append((call, policy.updates.remote(objective, rows)))
            due = ckpt.due(call)  # a checkpoint after this call: every queued call finishes first
            while len(in_flight) >= CALLS_IN_FLIGHT or (in_flight and (call is calls[-1] or due)):
                done, ref_m = in_flight.popleft()
                for step, m in zip(done, ray.get(ref_m)):
                    if logger is not None:
                        logger.log_metrics(
                            {f"dpo/{k}": m[k] for k in ("loss", "accuracy", "margin", "grad_norm")}, step=step
                        )
            ckpt.after(call)
        after = preference_metrics(policy, ev_ref, ev_c, ev_r, cfg.beta)
        metrics = {**preference_summary(before, after), "truncated": trunc.truncated}
        return run.finish(policy, out_dir, "dpo", cfg, metrics, lineage)
