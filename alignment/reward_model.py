"""Reward model: a scalar head (AutoModelForSequenceClassification) on any causal-LM backbone,
trained on preference pairs with the Bradley–Terry loss by a `Trainer` role (DeepSpeed, GPU or CPU).

    from raypai.alignment import RewardModelConfig, train_reward_model
    from raypai.alignment.data import load, split
    train, held = split(load("prefs.jsonl", "preference"))
    train_reward_model("sft_model/", "rm/", train, held, RewardModelConfig())
"""

from __future__ import annotations

import random

import ray

from raypai.alignment._driver import Run, check_lora, check_plan
from raypai.alignment._tensors import encode_pairs, select_rows
from raypai.alignment.checkpoint import Every
from raypai.alignment.config import RewardModelConfig
from raypai.alignment.losses.objectives import BradleyTerry
from raypai.alignment.models import check_causal_lm, format_and_limit
from raypai.alignment.placement import RoleSpec

# Steps per call to the trainer: a call's own cost in Ray is paid once for several small steps.
STEPS_PER_CALL = 10


def pair_accuracy(trainer, chosen: dict, rejected: dict, chunk: int = 64) -> float:
    """Share of pairs whose chosen completion the model scores above the rejected one."""
    wins, n = 0, len(chosen["input_ids"])
    for i in range(0, n, chunk):
        rows = list(range(i, min(i + chunk, n)))
        c, r = ray.get([trainer.scores.remote(select_rows(b, rows)) for b in (chosen, rejected)])
        wins += int((c > r).sum())
    return wins / n


def train_reward_model(
    model_dir: str,
    out_dir: str,
    pairs: list,
    eval_pairs: list,
    cfg: RewardModelConfig,
    *,
    run_name: str = "reward_model",
    logger=None,
    lineage: dict | None = None,
    checkpoint_dir: str | None = None,
) -> dict:
    """`pairs`/`eval_pairs`: PreferenceExample lists. Returns held-out pair accuracy before/after; the
    reward model is written to `out_dir` as an HF folder (with the backbone's tokenizer).
    `checkpoint_dir`: checkpoints as it goes (`cfg.checkpoint_every`); a re-run resumes from it."""
    check_causal_lm(model_dir, "reward model backbone")
    check_lora(model_dir, cfg)
    check_plan("reward_model", model_dir, cfg)
    fmt, trunc = format_and_limit(model_dir, cfg)
    train_c, train_r = encode_pairs(fmt, pairs, trunc, "training pair")  # bad or over-long pairs fail here
    eval_c, eval_r = encode_pairs(fmt, eval_pairs, trunc, "held-out pair")
    objective = BradleyTerry(margin=cfg.margin)
    gpus = cfg.gpu_share
    spec = {"reward-trainer": RoleSpec(cpus=1, gpus=gpus, replicas=cfg.ranks)}
    with Run(run_name, spec, logger=logger, gpus=cfg.gpus, placement=cfg.placement) as run:
        rm = run.place_trained(
            "reward-trainer", model_dir, cfg.lr_of(cfg.lr), cfg, head="score", device="cuda" if gpus else "cpu"
        )
        rng = random.Random(cfg.seed)
        ckpt = Every(checkpoint_dir, cfg.checkpoint_every, cfg.steps, rng, rm)
        start, saved = ckpt.resume("reward_model")
        before = saved["before"] if start else pair_accuracy(rm, eval_c, eval_r)
        ckpt.extra = {"before": before}
        ray.get(rm.hold.remote("pairs", (train_c, train_r)))  # steps name their rows
        steps = list(range(start + 1, cfg.steps + 1))
        for i in range(0, len(steps), STEPS_PER_CALL):
            call = steps[i : i + STEPS_PER_CALL]
            rows = [[rng.randrange(len(pairs)) for _ in range(cfg.batch_size)] for _ in call]
            for step, m in zip(call, ray.get(rm.updates.remote(objective, rows))):
                if logger is not None and step % 10 == 0:
                    logger.log_metrics({"rm/loss": m["loss"], "rm/train_accuracy": m["train_accuracy"]}, step=step)
            ckpt.after(call)
        metrics = {"rm_eval_accuracy_before": before, "rm_eval_accuracy": pair_accuracy(rm, eval_c, eval_r)}
        return run.finish(rm, out_dir, "reward_model", cfg, metrics, lineage)
