"""Supervised fine-tuning on prompt/response pairs; loss on response tokens only.

    from raypai.alignment.sft import run_sft
"""

from __future__ import annotations

import random
from dataclasses import asdict

import ray

from raypai.alignment._tensors import encode
from raypai.alignment.config import SFTConfig
from raypai.alignment.placement import Placement, RoleSpec
from raypai.alignment.roles import PolicyTrainer


def response_loss(policy, batch: dict) -> float:
    lp = ray.get(policy.logprobs.remote(batch))
    m = batch["response_mask"]
    return (-(lp * m).sum() / m.sum()).item()


def run_sft(model_dir: str, out_dir: str, rows: list[dict], eval_rows: list[dict], cfg: SFTConfig, *,
            run_name: str = "sft", logger=None, lineage: dict | None = None) -> dict:
    from transformers import AutoTokenizer

    cfg = cfg.validate()
    tok = AutoTokenizer.from_pretrained(model_dir)
    place = Placement(run_name, {"policy": RoleSpec(cpus=1)})
    try:
        [policy] = place.place("policy", PolicyTrainer, model_dir, cfg.lr, cfg.zero_stage, cfg.seed)
        eval_batch = encode(tok, [r["prompt"] for r in eval_rows], [r["response"] for r in eval_rows])
        before = response_loss(policy, eval_batch)
        rng = random.Random(cfg.seed)
        for step in range(1, cfg.steps + 1):
            picked = [rng.choice(rows) for _ in range(cfg.batch_size)]
            batch = encode(tok, [r["prompt"] for r in picked], [r["response"] for r in picked])
            m = ray.get(policy.sft_step.remote(batch))
            if logger is not None and (step % cfg.log_every == 0 or step == cfg.steps):
                logger.log_metrics({"sft/loss": m["loss"], "sft/grad_norm": m["grad_norm"]}, step=step)
        after = response_loss(policy, eval_batch)
        metrics = {"eval_response_loss_before": before, "eval_response_loss_after": after}
        ray.get(policy.export.remote(out_dir, {"algorithm": "sft", "config": asdict(cfg), "metrics": metrics,
                                               "lineage": lineage or {}}))
    finally:
        place.shutdown()
    if logger is not None:
        logger.log_metrics(metrics)
    return metrics
