"""Generation pieces shared by the engine (continuous batching, engine.py) and the static-batch
reference `generate_batch` (HF `generate` over left-padded prompts: the benchmark's ceiling and the
tests' ground truth). No Ray here."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GenRequest:
    prompt_ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False  # the caller wants text deltas as tokens arrive


@dataclass
class GenResult:
    text: str
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str  # "stop" | "length"
    # the engine's decode-step count when the request finished (its clock: tracing, and how a test
    # tells that a request returned while a batch-mate still had steps to run); None outside the engine
    finished_at_step: int | None = None


GREEDY_BELOW = 1e-5  # temperatures under this decode greedily: logits / T would overflow to inf - inf = nan


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the earliest occurrence of any stop string, and whether one occurred
    (OpenAI semantics: the stop string itself is not returned)."""
    hits = [text.index(s) for s in stops if s and s in text]
    return (text[: min(hits)], True) if hits else (text, False)


def stream_safe_prefix(text: str, stops: list[str]) -> str:
    """The part of `text` that can be streamed now: everything except a trailing piece that could be
    the start of a stop string completed by later tokens ("ab" with stop "bc" → "a")."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, T_max): prompts right-aligned so that every row's next
    token is generated at the same position; padding is masked out (and position ids follow the mask
    inside `generate`)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids, mask


def _finish(tok, req: GenRequest, ids: list[int], stop_ids: set[int]) -> GenResult:
    reason = "length"
    for i, t in enumerate(ids):
        if t in stop_ids:
            ids, reason = ids[:i], "stop"
            break
    text, stopped = cut_at_stop(tok.decode(ids, skip_special_tokens=True), req.stop)
    return GenResult(text, len(ids), len(req.prompt_ids), "stop" if stopped else reason)


@torch.no_grad()
def generate_batch(model, tok, reqs: list[GenRequest], stop_ids: set[int]) -> list[GenResult]:
    """One `generate` call (KV cache) per group of requests sharing sampling settings; prompts of
    different lengths are left-padded with attention masks. Top-k is off (OpenAI semantics are
    temperature + top-p only; transformers would otherwise apply its default top_k=50)."""
    results: dict[int, GenResult] = {}
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(reqs):
        groups.setdefault((r.temperature, r.top_p), []).append(i)
    for (temp, top_p), idx in groups.items():
        ids, mask = left_pad([reqs[i].prompt_ids for i in idx], tok.pad_token_id)
        ids, mask = ids.to(model.device), mask.to(model.device)
        greedy = is_greedy(temp)
        sampling = {} if greedy else {"temperature": temp, "top_p": top_p, "top_k": 0}
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(reqs[i].max_tokens for i in idx),
            do_sample=not greedy,
            eos_token_id=sorted(stop_ids),
            pad_token_id=tok.pad_token_id,
            use_cache=True,
            **sampling,
        )
        for row, i in enumerate(idx):
            gen = out[row, ids.shape[1] :].tolist()[: reqs[i].max_tokens]  # (new tokens,) of this row
            results[i] = _finish(tok, reqs[i], gen, stop_ids | {tok.pad_token_id})
    return [results[i] for i in range(len(reqs))]


def nucleus_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Softmax(logits / T) restricted to the smallest set of tokens whose mass reaches `top_p`,
    renormalised (nucleus sampling, Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration")."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = torch.sort(probs, descending=True)
    keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p  # mass strictly before this token is < top_p
    keep[0] = True  # the top token always survives (a top_p below float32's range would otherwise keep none)
    out = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return out / out.sum()


def next_token(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None = None) -> int:
    """Greedy for (near-)zero temperature, else a nucleus sample from `logits` (vocab,)."""
    if is_greedy(temperature):
        return int(torch.argmax(logits))
    return int(torch.multinomial(nucleus_probs(logits, temperature, top_p), 1, generator=gen))
