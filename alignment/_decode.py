"""Batched sampling for the rollout: one prefill, then one forward pass per token over a KV cache,
with finished rows leaving the batch (iteration-level scheduling as in the serving engine:
Yu et al., "Orca", OSDI 2022).

Why not HF `generate`: at rollout sizes its per-token bookkeeping (logits processors, stopping
criteria, cache-position and mask preparation) costs about as much as the model's own forward
pass on a small model, and it keeps finished rows in the batch until the longest one ends. This
loop keeps only what sampling needs, samples every row at once, and returns the log-probability of
each sampled token under the model (temperature 1) from the same logits, so an off-policy update
needs no second forward pass for its behaviour log-probs.

Sampling is from the model's full distribution with temperature and top-p only (no implicit
top-k: `generate` would apply generation_config's top_k=50, so the samples would not come from
the policy whose log-probs the update uses). Works with any transformers causal LM that takes
`position_ids` and a `DynamicCache` (Llama, Qwen2, Mistral, GPT-2, Phi-3, ...). Pure PyTorch.

On CUDA the Llama-family step keeps every row in the batch and is replayed as one CUDA graph per
token (`static`, `_lean.GraphedStep`): on a GPU a step at rollout sizes is bound by kernel
launches, not arithmetic, so one launch per token is the speed-up, and shrinking the batch is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from raypai.alignment._lean import GraphedStep, LeanDecoder, lean_decoder
from raypai.errors import ConfigError

GREEDY_BELOW = 1e-5  # temperatures under this decode greedily (logits / T would overflow)
# CPU decoding steps use one more thread per this many FLOPs of a step (2 × rows × parameters):
# below it a step's operations are too small to split, and every parallel region's fork/join costs
# more than the work it shares (benchmarks/history/asides.md). The rollout (`Rollout.generate`)
# runs its whole call on the threads this gives its batch, the prefill included; `decode` uses the
# caller's.
STEP_FLOPS_PER_THREAD = 1e8
CHECK_EVERY = 8  # the static loop asks the device whether every row has ended once per this many tokens
# a compiled step is specialised to its batch's shape (rows × cache width): prompts are left-padded
# to a multiple of this many tokens, so prompt lengths that differ by a few tokens share one compile
COMPILED_WIDTH_MULTIPLE = 16
_compiled_step = None  # torch.compile of LeanDecoder.static_step, made at its first use in this process


def compiled_static_step():
    """`LeanDecoder.static_step` through `torch.compile` (inductor, fixed shapes, whole step as one
    graph). One per process: its guards are on shapes and dtypes, so every later decoder of the same
    model shape and batch shape reuses the compiled code (and inductor's on-disk cache serves later
    processes)."""
    global _compiled_step
    if _compiled_step is None:
        _compiled_step = torch.compile(LeanDecoder.static_step, dynamic=False, fullgraph=True)
    return _compiled_step


@dataclass
class Decoded:
    tokens: list[list[int]]  # per row: the sampled tokens, the stop token included when one was hit
    logprobs: list[torch.Tensor] | None  # per row: (len(tokens),) log p(token) at temperature 1
    stopped: int  # rows that ended on a stop token (the rest ran to max_new_tokens)
    # the step that produced them: "model" (the model's own forward), "lean" (the lean forward, rows
    # leaving the batch), "static" (its fixed-shape step, eager), "compiled" (that step through
    # torch.compile) or "graphed" (that step replayed as a CUDA graph)
    path: str


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float, generator=None) -> torch.Tensor:
    """One token per row of `logits` (B, V): greedy below GREEDY_BELOW, else a sample from
    softmax(logits / T) restricted to the nucleus of mass `top_p` (Holtzman et al. 2020)."""
    if temperature < GREEDY_BELOW:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return _inverse_cdf(probs, generator)
    sorted_p, order = probs.sort(-1, descending=True)
    keep = sorted_p.cumsum(-1) - sorted_p < top_p  # the mass before this token is still under top_p
    keep[:, 0] = True  # the top token always survives
    return order.gather(-1, _inverse_cdf(sorted_p * keep, generator)[:, None]).squeeze(-1)


def _inverse_cdf(weights: torch.Tensor, generator=None) -> torch.Tensor:
    """One index per row of `weights` (B, V) ≥ 0, drawn with probability weight / row sum: a uniform
    draw per row placed in the row's cumulative sum (inverse transform sampling). One uniform number
    per row where `torch.multinomial` draws one per entry; an index of weight 0 is never chosen
    (its cumulative sum equals its predecessor's, and the search returns the first sum above the draw)."""
    cdf = weights.cumsum(-1)
    u = torch.rand((len(weights), 1), generator=generator, device=weights.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=weights.shape[-1] - 1)


def left_pad(prompts: list[list[int]], pad_id: int, device, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    width = -(-max(map(len, prompts)) // multiple) * multiple
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


class _ModelDecoder:
    """The model's own forward over a `DynamicCache`: for every architecture the lean forward does not cover."""

    def __init__(self, model):
        import inspect

        self.model = model
        # the KV cache argument: `cache` in newer transformers (which warn on the old name), `past_key_values` before
        self.kv = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def prefill(self, ids, mask, pos, max_new: int) -> torch.Tensor:
        from transformers import DynamicCache

        self.cache, self.mask = DynamicCache(), mask
        try:
            out = self.model(
                input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{self.kv: self.cache}
            )
        except TypeError as exc:  # a forward without position_ids or a cache argument
            raise ConfigError(
                [
                    f"raypai's rollout loop cannot drive {type(self.model).__name__} ({exc}); set "
                    "rollout_engine='hf' in the algorithm's config to sample with transformers' generate"
                ],
                what="rollout engine",
            ) from exc
        return out.logits[:, -1]

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(tok), 1))], dim=1)
        return self.model(
            input_ids=tok[:, None],
            attention_mask=self.mask,
            position_ids=pos[:, None],
            use_cache=True,
            **{self.kv: self.cache},
        ).logits[:, -1]

    def keep(self, rows: torch.Tensor) -> None:
        self.mask = self.mask[rows]
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]


@torch.no_grad()
def decode(
    model,
    prompts: list[list[int]],
    *,
    pad_id: int,
    stop_ids,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    logprobs: bool = False,
    lean: bool = True,
    static: bool | None = None,
    compiled: bool = False,
) -> Decoded:
    """Sample up to `max_new_tokens` after each prompt (token id lists of any lengths); a row ends
    at the first token in `stop_ids`. Random draws come from `generator` (default: torch's global
    generator, which the rollout checkpoints). `lean`: use raypai's lean forward for Llama-family
    models (`raypai.alignment._lean`); other models, or lean=False, run the model's own forward.
    `static` (lean forward only; default: on CUDA): keep every row in the batch and replay one
    captured CUDA graph per token (`_static_loop`) instead of shrinking the batch as rows finish;
    static=True on the CPU runs the same fixed-shape step without a graph (what the tests compare).
    `compiled` (CPU, lean forward): the fixed-shape step through `torch.compile` (`compiled_static_step`):
    on small models about half the time per token, after a compile of tens of seconds per batch shape."""
    device = next(model.parameters()).device
    B = len(prompts)
    # a prompt sampled several times (GRPO's group) is prefilled once and its cache rows repeated
    unique: dict = {}
    row_of = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
    dec = (lean_decoder(model) if lean else None) or _ModelDecoder(model)
    compiled = compiled and device.type == "cpu" and isinstance(dec, LeanDecoder)
    ids, mask = left_pad([list(p) for p in unique], pad_id, device, COMPILED_WIDTH_MULTIPLE if compiled else 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)  # real positions; padding reads position 0 and is masked
    logits = dec.prefill(ids, mask, pos, max_new_tokens)
    if len(unique) < B:
        rows = torch.tensor(row_of, device=device)
        dec.keep(rows)
        logits, pos = logits[rows], pos[rows]
    nxt_pos = pos[:, -1] + 1  # (b,) each live row's next position
    out_lp = torch.zeros((B, max_new_tokens), device=device) if logprobs else None
    if static is None:
        static = device.type == "cuda" or compiled
    static = static and getattr(dec, "static_ok", False)
    if static:
        dec.start_static(torch.zeros(B, dtype=torch.long, device=device), nxt_pos)
        if device.type == "cuda":
            run, path = GraphedStep(dec), "graphed"
        elif compiled:
            run, path = partial(compiled_static_step(), dec), "compiled"
        else:
            run, path = dec.static_step, "static"
        sampled = _static_loop(
            run, dec.tok_in, logits, B, max_new_tokens, stop_ids, temperature, top_p, generator, out_lp, device
        )
        return _decoded(sampled, out_lp, stop_ids, path)
    sampled, stopped = _sample_loop(
        dec, logits, nxt_pos, B, max_new_tokens, stop_ids, temperature, top_p, generator, out_lp, device
    )
    return _decoded(sampled, out_lp, stop_ids, "lean" if isinstance(dec, LeanDecoder) else "model", stopped)


def _decoded(
    sampled: torch.Tensor, out_lp: torch.Tensor | None, stop_ids, path: str, stopped: int | None = None
) -> Decoded:
    """Decoded from (B, max_new) sampled ids, −1 after each row's end."""
    tokens = []
    for row in sampled.cpu().tolist():
        n = row.index(-1) if -1 in row else len(row)
        tokens.append(row[:n])
    if stopped is None:
        stops = set(stop_ids)
        stopped = sum(1 for t in tokens if t and t[-1] in stops)
    lps = None if out_lp is None else [lp[: len(t)] for lp, t in zip(out_lp.cpu(), tokens)]
    return Decoded(tokens, lps, stopped, path)


def _static_loop(
    run,
    tok_in: torch.Tensor,
    logits: torch.Tensor,
    B: int,
    max_new_tokens: int,
    stop_ids,
    temperature: float,
    top_p: float,
    generator,
    out_lp,
    device,
) -> torch.Tensor:
    """Sample and record every row at every step (a row's tokens after its stop token are dropped),
    then `run()` the fixed-shape step on the sampled tokens written into `tok_in`. The host waits for
    the device once per CHECK_EVERY tokens, to stop early once every row has ended, instead of
    once per token."""
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    out_tokens = torch.full((B, max_new_tokens), -1, dtype=torch.long, device=device)
    ended = torch.zeros(B, dtype=torch.bool, device=device)
    for t in range(max_new_tokens):
        tok = sample_tokens(logits, temperature, top_p, generator).to(device)  # (B,)
        out_tokens[:, t] = tok.masked_fill(ended, -1)
        if out_lp is not None:
            out_lp[:, t] = torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None]).squeeze(-1)
        ended |= torch.isin(tok, stops)
        if t == max_new_tokens - 1 or (t % CHECK_EVERY == CHECK_EVERY - 1 and bool(ended.all())):
            break
        tok_in.copy_(tok)
        logits = run()
    return out_tokens


def _sample_loop(
    dec,
    logits,
    nxt_pos,
    B: int,
    max_new_tokens: int,
    stop_ids,
    temperature: float,
    top_p: float,
    generator,
    out_lp,
    device,
) -> tuple[torch.Tensor, int]:
    """Sample, record, drop finished rows, step: until every row stopped or max_new_tokens.
    Returns (B, max_new_tokens) sampled ids (−1 after a row's end) and the count of rows that stopped."""
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    live = torch.arange(B, device=device)  # original row of each row still in the batch
    out_tokens = torch.full((B, max_new_tokens), -1, dtype=torch.long, device=device)
    stopped = 0
    for t in range(max_new_tokens):
        tok = sample_tokens(logits, temperature, top_p, generator).to(device)  # (b,)
        out_tokens[live, t] = tok
        if out_lp is not None:
            out_lp[live, t] = torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None]).squeeze(-1)
        done = torch.isin(tok, stops)
        stopped += int(done.sum())
        if t == max_new_tokens - 1:
            break
        if done.any():  # finished rows leave the batch, with their cache rows
            keep = (~done).nonzero().squeeze(-1)
            if keep.numel() == 0:
                break
            live, tok, nxt_pos = live[keep], tok[keep], nxt_pos[keep]
            dec.keep(keep)
        logits = dec.step(tok, nxt_pos)
        nxt_pos = nxt_pos + 1
    return out_tokens, stopped
