"""Held-out evaluation that fits the user's task, and the promotion decision.

Metrics (each compares a candidate model folder with a baseline on held-out data):
- `held_out_reward`: mean of the configured rewards on greedy completions of held-out prompts
  (with the arithmetic exact-match reward this is the demo's exact-match accuracy);
- `response_nll`: mean NLL per completion token on held-out SFT examples (lower is better);
- `rm_win_rate`: how often a reward model scores the candidate's completion above the baseline's
  (ties count ½); > 0.5 is an improvement;
- `perplexity`: exp(mean token NLL) on held-out pretraining blocks (lower is better).
"""

from __future__ import annotations

import math
from pathlib import Path

import ray
import torch

METRICS = {"held_out_reward": "higher", "response_nll": "lower", "rm_win_rate": "higher", "perplexity": "lower"}


def greedy_completions_with(rollout, prompts: list, max_new_tokens: int) -> list[str]:
    out = ray.get(
        rollout.generate.remote([p.prompt for p in prompts], n=1, max_new_tokens=max_new_tokens, temperature=0.0)
    )
    return out["completions"]


def reward_with(rollout, reward, prompts: list, max_new_tokens: int) -> float:
    """Held-out reward through running actors: greedy completions scored by the Reward actor."""
    from raypai.alignment._loop import score

    comps = greedy_completions_with(rollout, prompts, max_new_tokens)
    rows = {k: [p.extras[k] for p in prompts] for k in (prompts[0].extras if prompts else {})}
    total = score(reward, [p.prompt for p in prompts], comps, rows)["total"]
    return sum(total) / len(total)


# ---- in-process evaluation of model folders (the `evaluate` step) -----------------------------
def greedy_completions(model_dir: str | Path, prompts: list, max_new_tokens: int) -> list[str]:
    from raypai.alignment.roles.rollout import Rollout

    r = Rollout(str(model_dir))
    return r.generate([p.prompt for p in prompts], n=1, max_new_tokens=max_new_tokens, temperature=0.0)["completions"]


def held_out_reward(model_dir, prompts: list, rewards: list, max_new_tokens: int) -> float:
    from raypai.alignment.roles.reward import Reward

    comps = greedy_completions(model_dir, prompts, max_new_tokens)
    rows = {k: [p.extras[k] for p in prompts] for k in (prompts[0].extras if prompts else {})}
    total = Reward(rewards).score([p.prompt for p in prompts], comps, rows)["total"]
    return sum(total) / len(total)


def response_nll(model_dir, examples: list) -> float:
    from transformers import AutoModelForCausalLM

    from raypai.alignment._tensors import batch_of, encode_all, token_logprobs
    from raypai.chat import ChatFormat

    fmt = ChatFormat.from_pretrained(model_dir)
    enc = encode_all(fmt, examples, None, "held-out")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    total, n = 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(enc), 32):
            b = batch_of(enc, list(range(i, min(i + 32, len(enc)))), fmt.tok.pad_token_id)
            lp = token_logprobs(model, b["input_ids"], b["attention_mask"])
            total += -(lp * b["response_mask"]).sum().item()
            n += b["response_mask"].sum().item()
    return total / n


def rm_win_rate(candidate_dir, baseline_dir, reward_model_dir, prompts: list, max_new_tokens: int) -> float:
    from raypai.alignment.roles.reward import RewardModelScorer

    rm = RewardModelScorer(str(reward_model_dir))
    p = [e.prompt for e in prompts]
    cand = rm.scores(p, greedy_completions(candidate_dir, prompts, max_new_tokens))
    base = rm.scores(p, greedy_completions(baseline_dir, prompts, max_new_tokens))
    return sum(1.0 if c > b else 0.5 if c == b else 0.0 for c, b in zip(cand, base)) / len(cand)


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
            b = x[i : i + 8]
            total += model(input_ids=b, labels=b).loss.item() * len(b)
            n += len(b)
    return math.exp(total / n)


def decide(metric: str, candidate: float, baseline: float | None, min_delta: float = 0.0) -> bool:
    """Whether the candidate improves on the baseline by more than min_delta in the metric's direction
    (rm_win_rate compares against ½, the no-difference rate)."""
    if metric == "rm_win_rate":
        return candidate > 0.5 + min_delta
    if METRICS[metric] == "higher":
        return candidate > baseline + min_delta
    return candidate < baseline - min_delta
