"""Reward model: a scalar head (AutoModelForSequenceClassification) on any causal-LM backbone,
trained on preference pairs with the Bradley–Terry loss.

    from raypai.alignment import RewardModelConfig, train_reward_model
    from raypai.alignment.data import load, split
    train, held = split(load("prefs.jsonl", "preference"))
    train_reward_model("sft_model/", "rm/", train, held, RewardModelConfig())
"""

from __future__ import annotations

import random

import ray
import torch

from raypai.alignment._tensors import encode_pairs
from raypai.alignment.config import RewardModelConfig
from raypai.alignment.losses import bradley_terry_loss
from raypai.alignment.models import check_causal_lm, format_and_limit


def _scores(model, batch):
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]


def _accuracy(model, fmt, pairs, trunc) -> float:
    with torch.no_grad():
        c, r = encode_pairs(fmt, pairs, trunc)
        return (_scores(model, c) > _scores(model, r)).float().mean().item()


def _train(model_dir: str, out_dir: str, pairs: list, eval_pairs: list, cfg: RewardModelConfig, logger) -> dict:
    from transformers import AutoModelForSequenceClassification

    from raypai.chat import copy_tokenizer_files

    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    fmt, trunc = format_and_limit(model_dir, cfg)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    model.config.pad_token_id = fmt.tok.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    before = _accuracy(model.eval(), fmt, eval_pairs, trunc)
    rng = random.Random(cfg.seed)
    model.train()
    for step in range(1, cfg.steps + 1):
        c, r = encode_pairs(fmt, [rng.choice(pairs) for _ in range(cfg.batch_size)], trunc)
        loss, acc = bradley_terry_loss(_scores(model, c), _scores(model, r), cfg.margin)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if logger is not None and step % 10 == 0:
            logger.log_metrics({"rm/loss": loss.item(), "rm/train_accuracy": acc.item()}, step=step)
    after = _accuracy(model.eval(), fmt, eval_pairs, trunc)
    model.save_pretrained(out_dir, safe_serialization=True)
    copy_tokenizer_files(model_dir, out_dir)
    return {"rm_eval_accuracy_before": before, "rm_eval_accuracy": after}


def train_reward_model(
    model_dir: str,
    out_dir: str,
    pairs: list,
    eval_pairs: list,
    cfg: RewardModelConfig,
    *,
    run_name: str = "reward_model",
    logger=None,
) -> dict:
    """`pairs`/`eval_pairs`: PreferenceExample lists. Returns held-out pair accuracy before/after."""
    cfg = cfg.validate()
    check_causal_lm(model_dir, "reward model backbone")
    fmt, trunc = format_and_limit(model_dir, cfg)
    encode_pairs(fmt, pairs, trunc, "training pair")  # bad or over-long pairs fail here, before the actor starts
    encode_pairs(fmt, eval_pairs, trunc, "held-out pair")
    task = ray.remote(_train).options(name=f"{run_name}/reward-trainer", num_cpus=1)
    metrics = ray.get(task.remote(model_dir, out_dir, pairs, eval_pairs, cfg, logger))
    if logger is not None:
        logger.log_metrics(metrics)
    return metrics
