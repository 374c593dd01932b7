"""Reward: any Python callables `reward(prompts, completions, **row) -> list[float]`, a trained
reward model folder, or several of them with weights."""

from __future__ import annotations

import torch

from raypai.alignment._tensors import END, chat_prompt


class Reward:
    def __init__(self, functions: list[tuple[object, float]] | None = None, model_dir: str | None = None,
                 model_weight: float = 1.0, threads: int = 1):
        torch.set_num_threads(threads)
        self.functions = list(functions or [])
        self.model = self.tok = None
        self.model_weight = model_weight
        if model_dir:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(model_dir)
            self.tok.padding_side = "right"
            self.model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()

    @torch.no_grad()
    def model_scores(self, prompts: list[str], completions: list[str]) -> list[float]:
        texts = [chat_prompt(self.tok, p) + c + END for p, c in zip(prompts, completions)]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return self.model(**enc).logits[:, 0].tolist()

    def score(self, prompts: list[str], completions: list[str], rows: dict | None = None) -> dict:
        """{'total': [...], <component>: [...]} — the weighted sum and each part."""
        rows = rows or {}
        parts = {}
        total = [0.0] * len(prompts)
        for fn, w in self.functions:
            vals = fn(prompts, completions, **rows)
            parts[getattr(fn, "__name__", "fn")] = vals
            total = [t + w * v for t, v in zip(total, vals)]
        if self.model is not None:
            vals = self.model_scores(prompts, completions)
            parts["reward_model"] = vals
            total = [t + self.model_weight * v for t, v in zip(total, vals)]
        return {"total": total, **parts}
