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


def kv_cells(rows: int, longest: int) -> int:
    """KV cells a left-padded batch can reach: every row is as wide as the longest one, so `rows`
    sequences whose longest prompt + max_tokens is `longest` hold at most rows x longest positions
    (per layer and head) before the first of them finishes."""
    return rows * longest


def final_length(req: GenRequest) -> int:
    """Positions `req` can occupy in the cache: its prompt and every token it may generate."""
    return len(req.prompt_ids) + req.max_tokens


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
    group: int = 0  # which prefill brought it in: a failed step evicts the newest group first


class Engine:
    def __init__(self, model, tok, stop_ids: set[int], max_batch_size: int = 16, max_kv_cells: int | None = None):
        self.model, self.tok, self.stop_ids = model, tok, set(stop_ids)
        # the KV cache, masks and positions live on the model's device; the sampled tokens (`last`)
        # stay on the CPU, where sampling reads the logits and Python reads the tokens
        self.device = next(model.parameters()).device
        self.max_batch_size = max_batch_size
        self.max_kv_cells = max_kv_cells  # None: rows are the only limit
        self.groups = 0  # prefills run (each admitted group's number)
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

    def fits(self, reqs: list[GenRequest]) -> bool:
        """Whether the running batch and `reqs` together stay within `max_kv_cells` (admission by KV
        budget, not by rows: one near-context-length prompt widens every row of a left-padded cache).
        An idle engine takes any one request: it passed the context-window check, so it fits alone."""
        if self.max_kv_cells is None or (not self.seqs and len(reqs) <= 1):
            return True
        longest = max(final_length(r) for r in [s.req for s in self.seqs] + list(reqs))
        return kv_cells(len(self.seqs) + len(reqs), longest) <= self.max_kv_cells

    @torch.no_grad()
    def add(self, items: list[tuple[Hashable, GenRequest]]) -> list[Event]:
        """Prefill `items` as one left-padded batch, sample their first tokens, join the running batch.
        The prefill has a cache of its own, so a failure leaves the running batch untouched; a group
        that fails is prefilled again one request at a time, and only the requests that fail alone fail."""
        if not items:
            return []
        try:
            return self._prefill(items)
        except Exception as exc:  # noqa: BLE001 - one bad prompt (or OOM) must not fail its group-mates
            if len(items) == 1:
                return [Event(items[0][0], "", error=exc)]
            return [e for item in items for e in self.add([item])]

    def _prefill(self, items: list[tuple[Hashable, GenRequest]]) -> list[Event]:
        ids, mask = left_pad([r.prompt_ids for _, r in items], self.tok.pad_token_id)  # (B2, T2)
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(1) - 1).clamp(min=0)  # real positions; padding reads position 0, masked anyway
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        self.groups += 1
        new = [
            _Seq(k, r, gen=torch.Generator().manual_seed(r.seed) if r.seed is not None else None, group=self.groups)
            for k, r in items
        ]
        self._merge(new, cache, mask, pos[:, -1] + 1)
        return self._advance(out.logits[:, -1].float().cpu(), rows=range(len(self.seqs) - len(new), len(self.seqs)))

    @torch.no_grad()
    def step(self) -> list[Event]:
        """One decoding step for every running sequence. A failed forward pass fails the newest group
        (it ran before that group joined) and the step is retried without it, so the sequences that
        were running keep their place; only a batch that fails with no group left to blame fails whole."""
        events: list[Event] = []
        while self.seqs:
            width, pos = self.mask.shape[1], self.pos
            try:
                return events + self._step()
            except Exception as exc:  # noqa: BLE001 - fail the newest group, keep the rest
                self._restore(width)
                self.pos = pos
                newest = max(s.group for s in self.seqs)
                rows = [i for i, s in enumerate(self.seqs) if s.group == newest]
                events += [Event(self.seqs[i].key, "", error=exc) for i in rows]
                self._evict(rows)
        return events

    def _step(self) -> list[Event]:
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

    def cancel(self, keys: set) -> list[Hashable]:
        """Remove the rows of `keys` (their clients left) at once; returns the keys that had a row."""
        rows = [i for i, s in enumerate(self.seqs) if s.key in keys]
        gone = [self.seqs[i].key for i in rows]
        if rows:
            self._evict(rows)
        return gone

    def _restore(self, width: int) -> None:
        """Undo a failed step: the mask column it added and the positions some layers appended to the cache."""
        self.mask = self.mask[:, :width]
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.shape[2] > width:
                layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]

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
        """Drop every running sequence."""
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
