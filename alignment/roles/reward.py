"""Reward: Python callables `fn(prompts, completions, **columns) -> list[float]` (TRL's convention),
a trained reward model folder, or several of them with weights. Every function's output is checked
(one finite float per completion) and a bad one is named with the sample that broke it."""

from __future__ import annotations

import sys

from raypai.alignment.rewards import RewardError, check_output, name_of
from raypai.chat import ChatFormat


def as_completion(prompt, text: str):
    """A completion in its prompt's format: conversational prompts get an assistant message."""
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


def share_bounds(n: int, rank: int, ranks: int) -> tuple[int, int]:
    """Rows [lo, hi) of `n` that rank `rank` of `ranks` scores: contiguous near-equal slices, the
    first `n % ranks` one row longer (as `torch.tensor_split`, which `roles._ranks.share` uses)."""
    q, r = divmod(n, ranks)
    lo = rank * q + min(rank, r)
    return lo, lo + q + (rank < r)


class RewardModelScorer:
    """A scalar-head model (AutoModelForSequenceClassification) scoring prompt + completion."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForSequenceClassification

        self.fmt = ChatFormat.from_pretrained(model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
        self.model.config.pad_token_id = self.fmt.tok.pad_token_id

    def forward(self, prompts, completions):
        from raypai.alignment._tensors import pad

        seqs, masks = zip(
            *(
                self.fmt.encode(p, as_completion(p, c) if isinstance(c, str) else c)
                for p, c in zip(prompts, completions)
            )
        )
        b = pad(list(seqs), list(masks), self.fmt.tok.pad_token_id)
        return self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, 0]

    def scores(self, prompts, completions) -> list[float]:
        import torch

        with torch.no_grad():
            return self.forward(prompts, completions).tolist()


class Reward:
    """Scores completions: rule functions and a reward model, weighted. As several ranks
    (`rank` of `rendezvous.ranks`, `raypai.alignment.ranks`; config `reward_ranks`) each scores a
    contiguous share of the rows, every rank holding the reward model, and the shares are put back
    together in row order on every rank."""

    def __init__(
        self,
        functions: list[tuple[object, float]] | None = None,
        model_dir: str | None = None,
        model_weight: float = 1.0,
        threads: int = 1,
        *,
        rank: int = 0,
        rendezvous=None,
    ):
        self.threads = threads
        self.functions = list(functions or [])
        self.model_weight = model_weight
        self.rank, self.ranks = rank, rendezvous.ranks if rendezvous else 1
        if self.ranks > 1:
            from raypai.alignment.roles import _ranks

            _ranks.join(rendezvous, rank, use_gpu=False, deepspeed=False)  # the shares meet in host memory
        self.model = RewardModelScorer(model_dir) if model_dir else None
        self._limit_threads()

    def _limit_threads(self) -> None:
        """torch's thread count, where torch is loaded (a reward model, or functions that use it).
        Plain Python reward functions leave it unloaded: the process starts without it."""
        torch = sys.modules.get("torch")
        if torch is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)

    def score_outputs(self, prompts: list, rows: dict, order: list | None, *outs: dict) -> dict:
        """`score` of the rollout replicas' outputs (`Rollout.generate`, handed over by Ray as they
        come in), their completions taken in the samples' order (`_loop.Pending.rows`)."""
        from raypai.alignment._order import gather_completions

        return self.score(prompts, gather_completions(list(outs), order), rows)

    def score(self, prompts: list, completions: list[str], rows: dict | None = None) -> dict:
        """{'total': [...], <function name>: [...]} — the weighted sum and each part."""
        self._limit_threads()
        rows = rows or {}
        if self.ranks == 1:
            return self._score(prompts, completions, rows)
        import torch.distributed as dist

        lo, hi = share_bounds(len(prompts), self.rank, self.ranks)
        mine, error = None, None
        if hi > lo:
            try:
                mine = self._score(prompts[lo:hi], completions[lo:hi], {k: v[lo:hi] for k, v in rows.items()})
            except Exception as exc:  # noqa: BLE001 - raised on every rank below, not on this one alone (the others would wait)
                error = exc
        parts: list = [None] * self.ranks
        dist.all_gather_object(parts, (mine, error))
        for _, err in parts:
            if err is not None:
                raise err
        done = [p for p, _ in parts if p is not None]
        return {k: [v for p in done for v in p[k]] for k in done[0]}

    def _score(self, prompts: list, completions: list[str], rows: dict) -> dict:
        comps = [as_completion(p, c) for p, c in zip(prompts, completions)]
        parts = {}
        total = [0.0] * len(prompts)
        for fn, w in self.functions:
            try:
                out = fn(prompts, comps, **rows)
            except Exception as exc:  # the user's function: name it, say what it was given
                shape = (
                    "lists of messages ([{'role': 'assistant', 'content': ...}]; the text is completion[0]['content'])"
                    if comps and not isinstance(comps[0], str)
                    else "strings"
                )
                raise RewardError(
                    f"reward {name_of(fn)} raised {type(exc).__name__}: {exc}. It was called as fn(prompts, "
                    f"completions, **columns) with {len(comps)} completions as {shape} and the dataset's extra "
                    f"columns {sorted(rows) or 'none'} as keyword lists (TRL's reward-function convention)"
                ) from exc
            vals = check_output(fn, out, prompts, completions)
            parts[name_of(fn)] = vals
            total = [t + w * v for t, v in zip(total, vals)]
        if self.model is not None:
            vals = self.model.scores(prompts, completions)
            parts["reward_model"] = vals
            total = [t + self.model_weight * v for t, v in zip(total, vals)]
        return {"total": total, **parts}
