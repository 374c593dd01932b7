"""Supervised fine-tuning on the user's examples (`messages`, or `prompt`/`completion`); the loss
counts completion / assistant tokens only.

    from raypai.alignment import SFTConfig, run_sft
    from raypai.alignment.data import load, split
    train, held = split(load("chats.jsonl", "sft"), eval_fraction=0.1)
    run_sft("base_model/", "sft_model/", train, held, SFTConfig(steps=200))
"""

from __future__ import annotations

import random

import ray
import torch

from raypai.alignment._driver import Run, check_lora, check_plan
from raypai.alignment._tensors import batch_of, encode_all
from raypai.alignment.checkpoint import Every
from raypai.alignment.config import SFTConfig
from raypai.alignment.losses.objectives import SFT
from raypai.alignment.models import check_causal_lm, format_and_limit
from raypai.alignment.placement import RoleSpec
from raypai.errors import DataError


def response_loss(policy, batch: dict) -> float:
    """Mean NLL per completion token (nats) of the policy on a batch."""
    lp = ray.get(policy.logprobs.remote(batch))
    m = batch["response_mask"]
    return (-(lp * m).sum() / m.sum()).item()


def eval_loss(policy, encoded, pad_id: int, chunk: int = 32) -> float:
    """Token-weighted mean response NLL over every held-out example."""
    total, n = 0.0, 0.0
    for i in range(0, len(encoded), chunk):
        b = batch_of(encoded, list(range(i, min(i + chunk, len(encoded)))), pad_id)
        k = b["response_mask"].sum().item()
        total += response_loss(policy, b) * k
        n += k
    return total / n


def run_sft(
    model_dir: str,
    out_dir: str,
    train: list,
    held_out: list,
    cfg: SFTConfig,
    *,
    run_name: str = "sft",
    logger=None,
    lineage: dict | None = None,
    ptx_blocks=None,
    checkpoint_dir: str | None = None,
) -> dict:
    """Trains on `train` (SFTExample list), reports the held-out response NLL before/after and writes
    the model to `out_dir`. `ptx_blocks` ((N, T) int array of pretraining token blocks) with
    `cfg.ptx_coef` > 0 mixes their LM loss into every step. `checkpoint_dir`: a checkpoint every
    `cfg.checkpoint_every` steps; a re-run with it resumes at its last one (same data position)."""
    check_causal_lm(model_dir)
    check_lora(model_dir, cfg)
    check_plan("sft", model_dir, cfg)
    fmt, trunc = format_and_limit(model_dir, cfg)
    if not train or not held_out:
        raise DataError(f"SFT needs training and held-out examples (got {len(train)} and {len(held_out)})")
    enc_train = encode_all(fmt, train, trunc, "training")  # every example checked before any actor starts
    enc_eval = encode_all(fmt, held_out, trunc, "held-out")
    pad_id = fmt.tok.pad_token_id
    objective = SFT(ptx_coef=cfg.ptx_coef)
    spec = {"policy": RoleSpec(cpus=1, gpus=cfg.gpu_share, replicas=cfg.ranks)}
    with Run(run_name, spec, logger=logger, gpus=cfg.gpus, placement=cfg.placement) as run:
        # dropout: the model's own, as in any fine-tuning
        policy = run.place_policy(model_dir, cfg, device="cuda" if cfg.gpus else "cpu", dropout=True)
        rng = random.Random(cfg.seed)
        ckpt = Every(checkpoint_dir, cfg.checkpoint_every, cfg.steps, rng, policy)
        start, saved = ckpt.resume("sft")
        before = saved["before"] if start else eval_loss(policy, enc_eval, pad_id)
        ckpt.extra = {"before": before}
        for step in range(start + 1, cfg.steps + 1):
            batch = batch_of(enc_train, [rng.randrange(len(enc_train)) for _ in range(cfg.batch_size)], pad_id)
            ptx = None
            if ptx_blocks is not None and cfg.ptx_coef > 0:
                ptx = torch.as_tensor(
                    ptx_blocks[[rng.randrange(len(ptx_blocks)) for _ in range(cfg.batch_size)]], dtype=torch.long
                )
            m = ray.get(policy.update.remote(objective, objective.assemble(batch, ptx)))
            if logger is not None and (step % cfg.log_every == 0 or step == cfg.steps):
                logger.log_metrics({f"sft/{k}": v for k, v in m.items()}, step=step)
            ckpt.after([step])
        after = eval_loss(policy, enc_eval, pad_id)
        metrics = {
            "eval_response_loss_before": before,
            "eval_response_loss_after": after,
            "train_examples": len(train),
            "eval_examples": len(held_out),
            "truncated": trunc.truncated,
        }
        return run.finish(policy, out_dir, "sft", cfg, metrics, lineage)
