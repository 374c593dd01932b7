"""Arithmetic with an exact-answer reward: the verifiable demo task, as one dataset and one reward
among many (the formats are the ones any user dataset has; see raypai.alignment.data).

Prompts are "a+b=" (single digits by default, so a tiny model can learn them on a CPU); the
answer is checked by parsing the completion's leading integer.

    rows = arithmetic.prompt_rows(train)   # [{"prompt": [{"role": "user", "content": "3+4="}], "answer": 7}, ...]
    rewards = ["raypai.alignment.tasks.arithmetic:exact_match_reward"]
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from raypai.chat import text_of

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


def exact_match_reward(prompts: list, completions: list, answer: list[int], **_) -> list[float]:
    """1.0 when the completion starts with the right number, else 0.0 (either dataset format)."""
    return [1.0 if parse_answer(text_of(c)) == int(a) else 0.0 for c, a in zip(completions, answer)]


def _user(p: Problem, chat: bool):
    return [{"role": "user", "content": p.prompt}] if chat else p.prompt


def _assistant(text: str, chat: bool):
    return [{"role": "assistant", "content": text}] if chat else text


def sft_rows(items: list[Problem], chat: bool = True) -> list[dict]:
    """Conversational `messages` rows (chat=True) or standard prompt/completion rows."""
    if chat:
        return [{"messages": _user(p, True) + _assistant(str(p.answer), True)} for p in items]
    return [{"prompt": p.prompt, "completion": str(p.answer)} for p in items]


def prompt_rows(items: list[Problem], chat: bool = True) -> list[dict]:
    """Prompt-only rows; `answer` reaches the reward as a keyword list."""
    return [{"prompt": _user(p, chat), "answer": p.answer} for p in items]


def preference_rows(items: list[Problem], seed: int = 0, per_problem: int = 2, chat: bool = True) -> list[dict]:
    """Chosen = the right answer, rejected = a near miss (off by 1-3)."""
    rng = random.Random(seed)
    rows = []
    for p in items:
        for _ in range(per_problem):
            wrong = p.answer + rng.choice((-3, -2, -1, 1, 2, 3))
            wrong = max(0, wrong) if wrong != p.answer else wrong + 1
            if wrong == p.answer:
                wrong += 1
            rows.append(
                {
                    "prompt": _user(p, chat),
                    "chosen": _assistant(str(p.answer), chat),
                    "rejected": _assistant(str(wrong), chat),
                }
            )
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)
