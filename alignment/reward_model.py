"""Reward model: a scalar head on the SFT model trained with the Bradley–Terry loss.

    from raypai.alignment.reward_model import train_reward_model
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import ray
import torch

from raypai.alignment._tensors import END, chat_prompt
from raypai.alignment.config import RewardModelConfig
from raypai.alignment.losses import bradley_terry_loss


def _scores(model, tok, prompts, responses):
    texts = [chat_prompt(tok, p) + r + END for p, r in zip(prompts, responses)]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return model(**enc).logits[:, 0]


def _accuracy(model, tok, pairs) -> float:
    with torch.no_grad():
        c = _scores(model, tok, [p["prompt"] for p in pairs], [p["chosen"] for p in pairs])
        r = _scores(model, tok, [p["prompt"] for p in pairs], [p["rejected"] for p in pairs])
    return (c > r).float().mean().item()


def _train(model_dir: str, out_dir: str, pairs: list[dict], eval_pairs: list[dict], cfg: RewardModelConfig,
           logger) -> dict:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "right"
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    model.config.pad_token_id = tok.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    before = _accuracy(model.eval(), tok, eval_pairs)
    rng = random.Random(cfg.seed)
    model.train()
    for step in range(1, cfg.steps + 1):
        b = [rng.choice(pairs) for _ in range(cfg.batch_size)]
        c = _scores(model, tok, [p["prompt"] for p in b], [p["chosen"] for p in b])
        r = _scores(model, tok, [p["prompt"] for p in b], [p["rejected"] for p in b])
        loss, acc = bradley_terry_loss(c, r, cfg.margin)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if logger is not None and step % 10 == 0:
            logger.log_metrics({"rm/loss": loss.item(), "rm/train_accuracy": acc.item()}, step=step)
    after = _accuracy(model.eval(), tok, eval_pairs)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and "token" in f.name or f.name == "chat_template.jinja":
            shutil.copyfile(f, Path(out_dir) / f.name)
    return {"rm_eval_accuracy_before": before, "rm_eval_accuracy": after}


def train_reward_model(model_dir: str, out_dir: str, pairs: list[dict], eval_pairs: list[dict],
                       cfg: RewardModelConfig, *, run_name: str = "reward_model", logger=None) -> dict:
    cfg = cfg.validate()
    task = ray.remote(_train).options(name=f"{run_name}/reward-trainer", num_cpus=1)
    metrics = ray.get(task.remote(model_dir, out_dir, pairs, eval_pairs, cfg, logger))
    if logger is not None:
        logger.log_metrics(metrics)
    return metrics
