"""Arithmetic with an exact-answer reward: the verifiable demo task.

Prompts are "a+b=" (single digits by default, so a tiny model can learn them on a CPU); the
answer is checked by parsing the completion's leading integer.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

_LEADING_INT = re.compile(r"\s*(-?\d+)")


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: int


def problems(max_operand: int = 9) -> list[Problem]:
    return [Problem(f"{a}+{b}=", a + b) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def split(max_operand: int = 9, eval_fraction: float = 0.2, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems; the held-out ones never appear in SFT, RM, DPO or RL data."""
    all_p = problems(max_operand)
    random.Random(seed).shuffle(all_p)
    n_eval = max(1, int(len(all_p) * eval_fraction))
    return all_p[n_eval:], all_p[:n_eval]


def parse_answer(completion: str) -> int | None:
    m = _LEADING_INT.match(completion)
    return int(m.group(1)) if m else None


def exact_match_reward(prompts: list[str], completions: list[str], answer: list[int], **_) -> list[float]:
    """1.0 when the completion starts with the right number, else 0.0."""
    return [1.0 if parse_answer(c) == a else 0.0 for c, a in zip(completions, answer)]


def sft_rows(items: list[Problem]) -> list[dict]:
    return [{"prompt": p.prompt, "response": str(p.answer), "answer": p.answer} for p in items]


def preference_pairs(items: list[Problem], seed: int = 0, per_problem: int = 2) -> list[dict]:
    """Chosen = the right answer, rejected = a near miss (off by 1-3)."""
    rng = random.Random(seed)
    rows = []
    for p in items:
        for _ in range(per_problem):
            wrong = p.answer + rng.choice((-3, -2, -1, 1, 2, 3))
            rows.append({"prompt": p.prompt, "chosen": str(p.answer), "rejected": str(max(0, wrong) if wrong != p.answer else wrong + 1)})
    return rows
