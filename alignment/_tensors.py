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
        ids[i, :len(s)] = torch.tensor(s)
        att[i, :len(s)] = 1
        rm[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": att, "response_mask": rm[:, 1:]}


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(x_{t+1} | x_≤t) for every position: (B, T−1)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()  # (B, T−1, V)
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


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
