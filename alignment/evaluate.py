"""Held-out evaluation: exact-match accuracy on arithmetic (greedy) and perplexity on token shards."""

from __future__ import annotations

import math
from pathlib import Path

import ray
import torch

from raypai.alignment.tasks.arithmetic import Problem, exact_match_reward


def accuracy_with(rollout, problems: list[Problem], max_new_tokens: int = 6) -> float:
    """Greedy exact-match accuracy using a Rollout actor."""
    out = ray.get(rollout.generate.remote([p.prompt for p in problems], n=1, max_new_tokens=max_new_tokens,
                                          temperature=0.0))
    scores = exact_match_reward([p.prompt for p in problems], out["completions"], [p.answer for p in problems])
    return sum(scores) / len(scores)


def accuracy(model_dir: str | Path, problems: list[Problem], max_new_tokens: int = 6) -> float:
    """Greedy exact-match accuracy of a model folder, in this process."""
    from raypai.alignment.roles.rollout import Rollout

    r = Rollout(str(model_dir))
    out = r.generate([p.prompt for p in problems], n=1, max_new_tokens=max_new_tokens, temperature=0.0)
    scores = exact_match_reward([p.prompt for p in problems], out["completions"], [p.answer for p in problems])
    return sum(scores) / len(scores)


def perplexity(model_dir: str | Path, shards_dir: str | Path, max_blocks: int = 64) -> float:
    """exp(mean token NLL) on the held-out split of token shards."""
    from transformers import AutoModelForCausalLM

    from raypai.train.data import load_blocks

    _, tokens = load_blocks(shards_dir, "eval")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    x = torch.from_numpy(tokens[:max_blocks].astype("int64"))
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), 8):
            b = x[i:i + 8]
            total += model(input_ids=b, labels=b).loss.item() * len(b)
            n += len(b)
    return math.exp(total / n)
