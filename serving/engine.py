"""Continuous batching over one shared KV cache (iteration-level scheduling: Yu et al., "Orca", OSDI 2022).

Requests join the running batch at the next token step instead of waiting for the whole batch to
finish, and leave it as soon as they are done. Without this, closed-loop clients settle into
half-full batches that take turns (each group waits for the other), which wastes half the batch.

    engine = Engine(model, tok, stop_ids={tok.eos_token_id})
    events = engine.add([("a", GenRequest(ids, max_tokens=8, temperature=0))])   # prefill, first token
    while engine.active:
        events += engine.step()                                                  # one token per sequence

Layout: the running batch keeps one left-padded cache, per layer keys/values (B, heads, T, head_dim),
with `mask` (B, T) marking real positions. A new group is prefilled on its own (left-padded, masked)
and concatenated along the batch dimension after left-padding the shorter of the two caches with
masked zeros. Position ids are per row (`pos`), so padding never shifts a sequence's rotary
positions. Pure PyTorch + transformers; no Ray, no threads: the model server drives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from raypai.serving.generation import GenRequest, GenResult, cut_at_stop, left_pad, next_token, stream_safe_prefix


def should_admit(
    waiting: int, free_slots: int, active: int, waited_steps: int, *, min_group: int = 4, max_wait_steps: int = 8
) -> bool:
    """Whether to prefill the waiting requests now. A prefill is a forward pass of its own, about as
    slow as a decode step on a small model, so admitting each arrival at once (closed-loop clients
    arrive one by one as others finish) would nearly double the passes per token. Admit a group:
    at once when idle, when `min_group` wait (or enough to fill the batch), or when the oldest has
    waited `max_wait_steps` decode steps."""
    if waiting == 0 or free_slots == 0:
        return False
    return active == 0 or waiting >= min(min_group, free_slots) or waited_steps >= max_wait_steps


@dataclass
class Event:
    """What happened to one request in one call: new streamable text, and the result once finished."""

    key: Hashable
    delta: str
    result: GenResult | None = None
    error: Exception | None = None  # this request failed (the others in the batch go on)


@dataclass
class _Seq:
    key: Hashable
    req: GenRequest
    produced: list[int] = field(default_factory=list)
    emitted: str = ""
    gen: torch.Generator | None = None


class Engine:
    def __init__(self, model, tok, stop_ids: set[int], max_batch_size: int = 16):
        self.model, self.tok, self.stop_ids = model, tok, set(stop_ids)
        # the KV cache, masks and positions live on the model's device; the sampled tokens (`last`)
        # stay on the CPU, where sampling reads the logits and Python reads the tokens
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.steps = self.tokens = 0  # decode steps run, tokens they produced (tokens/steps = mean batch)
        self.seqs: list[_Seq] = []  # row i of the cache belongs to seqs[i]
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor  # (B, T) 1 where the cache holds a real token
        self.pos: torch.Tensor  # (B,) position id of each row's next input token
        self.last: torch.Tensor  # (B,) each row's next input token
        self.reset()

    @property
    def active(self) -> int:
        return len(self.seqs)

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - len(self.seqs)

    @torch.no_grad()
    def add(self, items: list[tuple[Hashable, GenRequest]]) -> list[Event]:
        """Prefill `items` as one left-padded batch, sample their first tokens, join the running batch."""
        if not items:
            return []
        ids, mask = left_pad([r.prompt_ids for _, r in items], self.tok.pad_token_id)  # (B2, T2)
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(1) - 1).clamp(min=0)  # real positions; padding reads position 0, masked anyway
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        new = [_Seq(k, r, gen=torch.Generator().manual_seed(r.seed) if r.seed is not None else None) for k, r in items]
        self._merge(new, cache, mask, pos[:, -1] + 1)
        return self._advance(out.logits[:, -1].float().cpu(), rows=range(len(self.seqs) - len(new), len(self.seqs)))

    @torch.no_grad()
    def step(self) -> list[Event]:
        """One decoding step for every running sequence."""
        if not self.seqs:
            return []
        self.mask = torch.cat(
            [self.mask, torch.ones((len(self.seqs), 1), dtype=torch.long, device=self.device)], dim=1
        )  # (B, T+1)
        out = self.model(
            input_ids=self.last[:, None].to(self.device),
            attention_mask=self.mask,
            position_ids=self.pos[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.pos = self.pos + 1
        self.steps, self.tokens = self.steps + 1, self.tokens + len(self.seqs)
        return self._advance(out.logits[:, -1].float().cpu(), rows=range(len(self.seqs)))

    # ---- internals ---------------------------------------------------------------------------

    def _advance(self, logits: torch.Tensor, rows: range) -> list[Event]:
        """Pick each row's next token from `logits` (len(rows), vocab), record it, retire finished rows."""
        events, done = [], []
        for j, i in enumerate(rows):
            s = self.seqs[i]
            r = s.req
            try:
                nxt = next_token(logits[j], r.temperature, r.top_p, s.gen)
            except (RuntimeError, ValueError) as exc:  # one request's bad sampling must not sink the batch
                events.append(Event(s.key, "", error=exc))
                done.append(i)
                continue
            self.last[i] = nxt
            reason = "stop" if nxt in self.stop_ids else None  # a stop token is not part of the text
            if reason is None:
                s.produced.append(nxt)
                if len(s.produced) >= r.max_tokens:
                    reason = "length"
            text = ""
            if reason or r.stop or r.stream:  # decode only for stop strings, streaming, or the end
                text, hit = cut_at_stop(self.tok.decode(s.produced, skip_special_tokens=True), r.stop)
                reason = "stop" if hit else reason
            delta = ""
            if reason or r.stream:
                ready = text if reason else stream_safe_prefix(text, r.stop)  # hold back a possible stop start
                if len(ready) > len(s.emitted):
                    delta, s.emitted = ready[len(s.emitted) :], ready
            result = GenResult(s.emitted, len(s.produced), len(r.prompt_ids), reason, self.steps) if reason else None
            if delta or result:
                events.append(Event(s.key, delta, result))
            if reason:
                done.append(i)
        if done:
            self._evict(done)
        return events

    def _merge(self, new: list[_Seq], cache: DynamicCache, mask: torch.Tensor, pos: torch.Tensor) -> None:
        if self.cache is None or not self.seqs:
            self.seqs, self.cache, self.mask, self.pos = new, cache, mask, pos
            self.last = torch.zeros(len(new), dtype=torch.long)
            return
        t_old, t_new = self.mask.shape[1], mask.shape[1]
        width = max(t_old, t_new)
        for old_layer, new_layer in zip(self.cache.layers, cache.layers):
            for name in ("keys", "values"):  # (B, heads, T, head_dim): left-pad the time axis with zeros
                a = F.pad(getattr(old_layer, name), (0, 0, width - t_old, 0))
                b = F.pad(getattr(new_layer, name), (0, 0, width - t_new, 0))
                setattr(old_layer, name, torch.cat([a, b], dim=0))
        self.mask = torch.cat([F.pad(self.mask, (width - t_old, 0)), F.pad(mask, (width - t_new, 0))], dim=0)
        self.pos = torch.cat([self.pos, pos])
        self.last = torch.cat([self.last, torch.zeros(len(new), dtype=torch.long)])
        self.seqs = self.seqs + new

    def reset(self) -> None:
        """Drop every running sequence (after a failed forward pass)."""
        self.seqs, self.cache = [], None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self.last = torch.zeros(0, dtype=torch.long)

    def _evict(self, rows: list[int]) -> None:
        gone = set(rows)
        keep = [i for i in range(len(self.seqs)) if i not in gone]
        if not keep:
            self.reset()
            return
        idx = torch.tensor(keep, device=self.device)
        self.seqs = [self.seqs[i] for i in keep]
        self.mask, self.pos, self.last = self.mask[idx], self.pos[idx], self.last[torch.tensor(keep)]
        # Columns no remaining row attends to (padding left behind by longer, finished rows) go too.
        first = int(self.mask.any(0).float().argmax())
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[idx, :, first:], layer.values[idx, :, first:]
