"""Turning examples into padded tensors (through `raypai.chat.ChatFormat`), and per-token log-probabilities."""

from __future__ import annotations

import torch

from raypai.chat import ChatFormat, Truncation


def encode_sft(fmt: ChatFormat, examples, trunc: Truncation | None = None, name: str = "example") -> dict:
    """A training batch from SFT examples (prompt/completion or messages)."""
    seqs, masks = [], []
    for i, e in enumerate(examples):
        ids, m = fmt.encode_messages(e.messages) if e.messages is not None else fmt.encode(e.prompt, e.completion)
        ids, m = fmt.fit(ids, m, trunc, f"{name} {i}")
        seqs.append(ids)
        masks.append(m)
    return pad(seqs, masks, fmt.tok.pad_token_id)


def encode_pairs(fmt: ChatFormat, pairs, trunc: Truncation | None = None, name: str = "pair") -> tuple[dict, dict]:
    """(chosen batch, rejected batch) from preference examples."""
    out = []
    for side in ("chosen", "rejected"):
        seqs, masks = [], []
        for i, p in enumerate(pairs):
            ids, m = fmt.fit(*fmt.encode(p.prompt, getattr(p, side)), trunc, f"{name} {i} ({side})")
            seqs.append(ids)
            masks.append(m)
        out.append(pad(seqs, masks, fmt.tok.pad_token_id))
    return out[0], out[1]


def pad(seqs: list[list[int]], resp: list[list[int]], pad_id: int) -> dict:
    """Right-padded (B, T) input_ids/attention_mask and a response mask over the *label* positions
    (B, T−1): 1 where token t+1 belongs to the response (the loss counts only those)."""
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), T), dtype=torch.long)
    rm = torch.zeros((len(seqs), T), dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, resp)):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
        rm[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": att, "response_mask": rm[:, 1:]}


def select_rows(batch: dict, idx) -> dict:
    """Rows `idx` of a right-padded batch (`pad`'s layout), trimmed to their own longest sequence."""
    b = {k: v[idx] for k, v in batch.items()}
    L = int(b["attention_mask"].sum(1).max())
    return {
        "input_ids": b["input_ids"][:, :L],
        "attention_mask": b["attention_mask"][:, :L],
        "response_mask": b["response_mask"][:, : L - 1],
    }


def stack_right_padded(a: dict, b: dict) -> dict:
    """Two right-padded batches as one: rows of `a` then rows of `b`, padded to the longer length
    (padding: attention 0, response mask 0; the pad token id is irrelevant where attention is 0)."""
    T = max(a["input_ids"].shape[1], b["input_ids"].shape[1])

    def widen(x: torch.Tensor, width: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]))

    return {
        "input_ids": torch.cat([widen(a["input_ids"], T), widen(b["input_ids"], T)]),
        "attention_mask": torch.cat([widen(a["attention_mask"], T), widen(b["attention_mask"], T)]),
        "response_mask": torch.cat([widen(a["response_mask"], T - 1), widen(b["response_mask"], T - 1)]),
    }


def cpu_threads(flops: float, flops_per_thread: float, most: int) -> int:
    """Threads for a CPU step of `flops`: one per `flops_per_thread` of work, at least 1, at most
    `most`. Below the grain a parallel region's fork/join costs more than the split saves."""
    return max(1, min(most, int(flops // flops_per_thread)))


def to_device(batch: dict, device) -> dict:
    """The tensors of a batch on `device` (non-blocking from the host; a no-op where they already are)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def token_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, where: torch.Tensor | None = None, lean: bool = True
) -> torch.Tensor:
    """log p(x_{t+1} | x_≤t) for every position: (B, T−1). With `where` (B, T−1), only those positions
    are computed (the output head and the log-softmax over the vocabulary on them alone) and every
    other entry is 0. `lean`: Llama-family models run raypai's lean forward (`raypai.alignment._lean`),
    others their own, and rows that continue the same prompt (GRPO's groups, DPO's pairs) run that
    prompt once; all give the same values and gradients (tests/alignment/test_lean_train.py)."""
    from raypai.alignment._lean import (
        lean_hidden,
        lean_response_logprobs,
        lean_supported,
        right_padded,
        shared_prefixes,
    )

    B, T = input_ids.shape
    if lean and lean_supported(model) and where is not None and right_padded(attention_mask):
        groups = shared_prefixes(input_ids, attention_mask, where)  # rows continuing one prompt run it once
        if groups is not None:
            return lean_response_logprobs(model, input_ids, attention_mask, where, groups)
    if lean and lean_supported(model):
        L = T
        if right_padded(attention_mask):  # trailing all-padding columns: no label there is asked for
            L = int(attention_mask.sum(1).max())
            if where is not None and where[:, L - 1 :].any():
                L = T
            L = max(L, 2)
        h = lean_hidden(model, input_ids[:, :L], attention_mask[:, :L])[:, :-1]  # (B, L−1, hidden)
        if where is not None:
            where = where[:, : L - 1].bool()
            h = h[where]  # (N, hidden): the positions asked for
        logits = model.lm_head(h).float()  # (N, V) or (B, L−1, V)
    else:
        L = T
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()  # (B, T−1, V)
        if where is not None:
            where = where.bool()
            logits = logits[where]  # (N, V)
    labels = input_ids[:, 1:L] if where is None else input_ids[:, 1:L][where]
    # log-softmax at the label only: logit − logsumexp over the vocabulary
    lp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if where is not None:
        lp = logits.new_zeros((B, L - 1)).masked_scatter(where, lp)
    return lp if L == T else torch.nn.functional.pad(lp, (0, T - L))


def sequence_logprob(lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed log-prob of each response: (B,)."""
    return (lp * mask).sum(1)


def encode_all(fmt: ChatFormat, examples, trunc: Truncation | None, name: str) -> list[tuple[list[int], list[int]]]:
    """Every SFT example encoded once, up front (so a bad or over-long one fails before training)."""
    out = []
    for i, e in enumerate(examples):
        ids, m = fmt.encode_messages(e.messages) if e.messages is not None else fmt.encode(e.prompt, e.completion)
        out.append(fmt.fit(ids, m, trunc, f"{name} example {i}"))
    return out


def batch_of(encoded: list[tuple[list[int], list[int]]], idx: list[int], pad_id: int) -> dict:
    return pad([encoded[i][0] for i in idx], [encoded[i][1] for i in idx], pad_id)
