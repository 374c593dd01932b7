"""Turning prompts and responses into padded tensors, and per-token log-probabilities."""

from __future__ import annotations

import torch

END = "<|end|>"


def chat_prompt(tokenizer, prompt: str) -> str:
    """The user turn plus the assistant header, from the tokenizer's chat template."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def encode(tokenizer, prompts: list[str], responses: list[str]) -> dict:
    """Right-padded (B, T) input_ids/attention_mask and a response mask over the *label* positions
    (B, T−1): 1 where token t+1 belongs to the response (the loss counts only those)."""
    seqs, masks = [], []
    for p, r in zip(prompts, responses):
        p_ids = tokenizer(chat_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]
        r_ids = tokenizer(r + END, add_special_tokens=False)["input_ids"]
        seqs.append(p_ids + r_ids)
        masks.append([0] * len(p_ids) + [1] * len(r_ids))
    return pad(seqs, masks, tokenizer.pad_token_id)


def pad(seqs: list[list[int]], resp: list[list[int]], pad_id: int) -> dict:
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), T), dtype=torch.long)
    rm = torch.zeros((len(seqs), T), dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, resp)):
        ids[i, :len(s)] = torch.tensor(s)
        att[i, :len(s)] = 1
        rm[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return {"input_ids": ids, "attention_mask": att, "response_mask": rm[:, 1:]}


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """log p(x_{t+1} | x_≤t) for every position: (B, T−1)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()  # (B, T−1, V)
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def sequence_logprob(lp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed log-prob of each response: (B,)."""
    return (lp * mask).sum(1)
