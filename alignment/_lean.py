"""Lean forwards for Llama-family models (Llama, Qwen2, Mistral, Phi-3): the rollout's decoding loop
and the trainer's log-probs.

At these sizes a transformers forward pass spends much of its time outside the matrix products
(module calls, mask construction, cache bookkeeping, output containers). This computes the same
function from the model's own weights: RMSNorm, rotary embeddings (the model's own rotary module, so
every RoPE scaling it supports), grouped-query attention through `scaled_dot_product_attention`,
SwiGLU MLP, with q/k/v and gate/up as one matrix product each. Two users:
- `LeanDecoder` (decoding, no autograd): a preallocated KV cache and one boolean mask;
- `lean_hidden` (training and scoring, autograd through the model's parameters): no cache, no mask
  at all for a right-padded batch (causal attention never reaches the padding after a row's end).
Anything else (other architectures, sliding-window layers, a partial rotary, tensor-parallel
`pretraining_tp`, attention or residual dropout while training) is refused by `lean_supported` and
the caller uses the model's own forward. Checked against transformers in
tests/alignment/test_decode.py (tokens, sampled log-probs), tests/alignment/test_lean_train.py
(log-probs and parameter gradients) and, for Phi-3's fused layout, tests/alignment/test_families.py.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from raypai.alignment._lean_proj import _lora_unready, _Proj, _w

# Phi-3 is Llama's function with q/k/v and gate/up stored fused (`qkv_proj`, `gate_up_proj`, in that
# order) and a residual dropout; `_fused` reads either layout
LEAN_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM")
# architectures whose attention is windowed whenever `sliding_window` is set (Qwen2 only with use_sliding_window)
WINDOWED_WHEN_SET = ("MistralForCausalLM", "Phi3ForCausalLM")


def lean_supported(model) -> bool:
    """True where the lean forward computes the model's own function (LoRA adapters included)."""
    cfg, name = model.config, type(model).__name__
    if name not in LEAN_ARCHITECTURES or getattr(cfg, "pretraining_tp", 1) > 1:
        return False
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return False
    if getattr(cfg, "sliding_window", None) and name in WINDOWED_WHEN_SET:
        return False
    # the lean forward rotates every dimension of a head; a partial rotary (Phi-3's partial_rotary_factor < 1)
    # leaves some unrotated
    inv_freq = getattr(model.model.rotary_emb, "inv_freq", None)
    if inv_freq is None or 2 * inv_freq.numel() != _Shape(cfg).head_dim:
        return False
    # HF applies attention (and Phi-3 residual) dropout in training mode; the lean forward has none
    if model.training and (getattr(cfg, "attention_dropout", 0.0) or getattr(cfg, "resid_pdrop", 0.0)):
        return False
    # activation checkpointing lives in the model's own layer loop, which the lean forward replaces
    if model.training and getattr(model, "is_gradient_checkpointing", False):
        return False
    # ZeRO-3 partitions every weight across ranks (DeepSpeed's `ds_id`): only the model's own forward,
    # whose hooks gather each module's parameters just in time, sees whole weights
    if hasattr(model.model.embed_tokens.weight, "ds_id"):
        return False
    unready = _lora_unready(model)
    if unready:
        # said once per process: e.g. SFT with lora_dropout > 0 trains through peft's own forward
        if not _WARNED:
            _WARNED.append(True)
            warnings.warn(
                f"raypai: the lean forward does not apply these LoRA layers (DoRA, an adapter bias, or LoRA "
                f"dropout in training: {unready[:3]}...); the model's own (slower) forward runs instead",
                stacklevel=2,
            )
        return False
    return True


_WARNED: list = []


def lean_decoder(model) -> LeanDecoder | None:
    """A LeanDecoder for `model`, or None where the lean forward would not compute the same function."""
    return LeanDecoder(model) if lean_supported(model) else None


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:  # the same function as one fused op
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    h = x.float()  # lower precisions: normalise in fp32 and cast back before the weight, as the models do
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotary(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary module's (B, T, head_dim) tables as `_qkv` takes them: (B, T, 1, head_dim), one
    head axis to broadcast over, and sin with rotate-half's sign folded in: rotate_half(x) =
    (−x₂, x₁) is x rolled by half a head times (−1, +1), so x·cos + rotate_half(x)·sin =
    x·cos + roll(x)·(−sin₁, sin₂), one roll instead of two slices, a negation and a concatenation."""
    half = sin.shape[-1] // 2
    return cos[:, :, None], torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)[:, :, None]


def _fused(layer, merged: bool = False) -> tuple[_Proj, _Proj]:
    """(qkv, gate_up) projections of a layer; a layer that stores them fused (Phi-3's `qkv_proj`,
    `gate_up_proj`) gives its own."""
    a, m = layer.self_attn, layer.mlp
    if hasattr(a, "qkv_proj"):
        return _Proj(a.qkv_proj, merged=merged), _Proj(m.gate_up_proj, merged=merged)
    return _Proj(a.q_proj, a.k_proj, a.v_proj, merged=merged), _Proj(m.gate_proj, m.up_proj, merged=merged)


def _act(mlp):
    """The MLP's gate activation (`act_fn` in Llama's MLP, `activation_fn` in Phi-3's)."""
    return mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn


class _Shape:
    def __init__(self, cfg):
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _qkv(layer, qkv, s: _Shape, x: torch.Tensor, cos, sin):
    """Rotated q (B, heads, T, d), rotated k and v (B, kv_heads, T, d) of one layer's attention;
    `cos`, `sin` from `_rotary`. The q and k heads are rotated together, in one pass."""
    B, T, _ = x.shape
    h = qkv(_rms(layer.input_layernorm, x)).view(B, T, s.heads + 2 * s.kv_heads, s.head_dim)
    qk = h[:, :, : s.heads + s.kv_heads]
    qk = (qk * cos + qk.roll(s.head_dim // 2, -1) * sin).transpose(1, 2)
    q, k = qk.split([s.heads, s.kv_heads], dim=1)
    return q, k, h[:, :, s.heads + s.kv_heads :].transpose(1, 2)


def _heads_last(o: torch.Tensor) -> torch.Tensor:
    """Attention output (B, heads, T, d) as (B, T, heads·d)."""
    B, _, T, _ = o.shape
    return o.transpose(1, 2).reshape(B, T, -1)


def _finish(layer, gate_up, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """Residual after the attention output o (…, heads·d) at x's positions (…, hidden), then the
    SwiGLU MLP's residual."""
    a, m = layer.self_attn, layer.mlp
    x = x + _Proj(a.o_proj)(o)
    gate, up = gate_up(_rms(layer.post_attention_layernorm, x)).chunk(2, dim=-1)
    return x + _Proj(m.down_proj)(_act(m)(gate) * up)


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Every row's ones come first: (B, T) non-increasing along T."""
    return bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())


def lean_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The final-norm hidden states (B, T, hidden) of a model `lean_supported` accepts, as its own
    forward computes them with no position_ids (positions 0..T−1, relative under RoPE); autograd
    reaches the model's parameters. Padding positions' outputs are not meaningful."""
    inner, s = model.model, _Shape(model.config)
    B, T = input_ids.shape
    x = inner.embed_tokens(input_ids)
    cos, sin = _rotary(*inner.rotary_emb(x, torch.arange(T, device=input_ids.device)[None]))
    mask = None  # right padding: causal attention alone never reaches a row's padding
    if not right_padded(attention_mask):  # a query attends to earlier real tokens; a padding query to itself
        causal = torch.ones((T, T), dtype=torch.bool, device=input_ids.device).tril()
        mask = (causal & attention_mask.bool()[:, None, None, :]) | torch.eye(
            T, dtype=torch.bool, device=input_ids.device
        )
    return _rms(inner.norm, _layer_stack(inner, s, x, cos, sin, mask)[0])


def _layer_stack(inner, s: _Shape, x: torch.Tensor, cos, sin, mask, prefix=None, keep=None):
    """Every layer on x (B, T, hidden). With `prefix` = (x_p (U, Lp, hidden), cos_p, sin_p, group (B,),
    the prefix each row continues), the rows of x continue prefixes shared by several rows: each layer runs the
    U prefixes once and x's queries attend to their row's prefix keys, then causally to x's own.
    With `keep` = (rows, columns) of x, the last layer finishes those positions only (its keys and
    values still come from every position) and x is returned as (N, hidden): the states the caller
    reads, without the output projection and MLP of the others. Returns (x, x_p)."""
    gqa = s.heads != s.kv_heads
    x_p = None
    if prefix is not None:
        x_p, cos_p, sin_p, group = prefix
    last = len(inner.layers) - 1
    for i, layer in enumerate(inner.layers):
        qkv, gate_up = _fused(layer)
        q, k, v = _qkv(layer, qkv, s, x, cos, sin)
        if x_p is not None:
            qp, kp, vp = _qkv(layer, qkv, s, x_p, cos_p, sin_p)
            # right-padded prefixes: causal attention never reaches a prefix's padding
            x_p_next = _finish(
                layer,
                gate_up,
                x_p,
                _heads_last(F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=gqa)),
            )
            k, v = torch.cat([kp[group], k], dim=2), torch.cat([vp[group], v], dim=2)  # (B, kv_heads, Lp + T, d)
            x_p = x_p_next
        o = _heads_last(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa))
        if keep is not None and i == last:
            x, o = x[keep], o[keep]
        x = _finish(layer, gate_up, x, o)
    return x, x_p


def shared_prefixes(input_ids: torch.Tensor, attention_mask: torch.Tensor, where: torch.Tensor):
    """Rows (right-padded) whose tokens before their first `where` label are the same prompt: GRPO's
    group of samples per prompt, DPO's chosen and rejected. Returns (prefix length of each row (B,),
    group of each row (B,), one row per group (U,)), or None when no two rows share a prefix or
    a row has no label asked for."""
    where = where.bool()
    if not bool(where.any(1).all()):
        return None
    plen = where.int().argmax(1) + 1  # (B,) tokens before the first response token
    last_label = attention_mask.sum(1) - 2  # (B,) the last label position whose token is real
    if bool((where & (torch.arange(where.shape[1], device=where.device) > last_label[:, None])).any()):
        return None  # a label on padding: not a response this split covers
    keys: dict = {}
    group = [keys.setdefault(tuple(row[:n]), len(keys)) for row, n in zip(input_ids.tolist(), plen.tolist())]
    if len(keys) == len(group):
        return None
    first = {}
    for b, g in enumerate(group):
        first.setdefault(g, b)
    dev = input_ids.device
    return plen, torch.tensor(group, device=dev), torch.tensor(list(first.values()), device=dev)


# Rows that share a prompt are laid out as one packed sequence (prompt, then each continuation) while
# that sequence is at most this long; past it, the prompts and the continuations are split for
# attention (`_split`).
# Packing halves the number of operations (one pass through each layer instead of two), which is
# what a step costs at short lengths; its attention is quadratic in the packed length, though, and
# at this length it stays a small part of the layer's matrix products (2·L·hidden against the
# layer's parameters per token: under a quarter from 0.79 M-parameter models up).
PACKED_MAX_LEN = 256


def lean_response_logprobs(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, where: torch.Tensor, groups
) -> torch.Tensor:
    """token_logprobs' values at the label positions `where` (B, T−1) of a right-padded batch, 0
    elsewhere, with each shared prompt run once (`groups` from `shared_prefixes`): the prompt's
    tokens pass through the layers once per group instead of once per row, and the gradient of
    every row that continues it flows back into that one pass (the idea of Prefix Grouper, Liu et
    al. 2025, "Efficient GRPO training through shared-prefix forward"). Same function, fewer
    products: at GRPO's 8 samples per prompt the prompts' share of the tokens drops eightfold."""
    plen, group, firsts = groups
    lengths = attention_mask.sum(1)  # (B,)
    slen = lengths - plen  # (B,) each row's continuation
    # packed, a continuation's last token is a label only (the state after it predicts nothing asked
    # for), so it is left out: each row contributes slen − 1 inputs, starting after the prompt and
    # the inputs of the group's earlier rows
    B = len(plen)
    inputs = slen - 1
    earlier = (group[:, None] == group[None, :]) & torch.ones((B, B), dtype=torch.bool, device=plen.device).tril(-1)
    off = plen + (earlier * inputs[None, :]).sum(1)
    if int((off + inputs).max()) <= PACKED_MAX_LEN:
        return _packed(model, input_ids, where, plen, slen, off, group, firsts)
    return _split(model, input_ids, where, plen, slen, group, firsts)


def _logprobs_at(
    model, h: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor, lab: torch.Tensor, shape: tuple[int, int]
) -> torch.Tensor:
    """log p(label) from final-norm hidden states h (N, hidden), placed at (rows, lab) of a zero (B, T−1)."""
    logits = model.lm_head(h).float()  # (N, V)
    lp = logits.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return lp.new_zeros(shape).index_put((rows, lab), lp)


def _packed(model, input_ids, where, plen, slen, off, group, firsts) -> torch.Tensor:
    """One sequence per group: [prompt, continuation 1, continuation 2, …] (each continuation without
    its last token, `off` where each starts), each continuation at its own row's positions (plen…)
    and attending to the prompt and causally to itself only (a packed sequence with a block mask, as
    in tree attention); one pass through the layers, whose last finishes only the positions that
    predict a label asked for."""
    inner, s = model.model, _Shape(model.config)
    B, T = input_ids.shape
    dev = input_ids.device
    inputs = slen - 1
    U, P = len(firsts), int((off + inputs).max())
    Lp, Li = int(plen.max()), int(inputs.max())
    ids = input_ids.new_zeros((U, P))
    pos = torch.zeros((U, P), dtype=torch.long, device=dev)
    seg = torch.full((U, P), -1, dtype=torch.long, device=dev)  # −1 padding, 0 the prompt, b + 1 row b's continuation
    cols = torch.arange(Lp, device=dev)
    in_prompt = cols[None] < plen[firsts][:, None]  # (U, Lp)
    ids[:, :Lp] = input_ids[firsts, :Lp]
    pos[:, :Lp] = cols
    seg[:, :Lp] = torch.where(in_prompt, 0, -1)
    k = torch.arange(max(Li, 1), device=dev)
    real = k[None] < inputs[:, None]  # (B, Li)
    at = plen[:, None] + k  # (B, Li) the inputs' positions in their own rows
    r, c = group[:, None].expand_as(real)[real], (off[:, None] + k)[real]
    ids[r, c] = input_ids.gather(1, at.clamp(max=T - 1))[real]
    pos[r, c] = at[real]
    seg[r, c] = torch.arange(1, B + 1, device=dev)[:, None].expand_as(real)[real]
    # key j is visible to query i: j ≤ i, j real, and j in the prompt or in i's own continuation; a
    # padding query attends to itself (a query with no key would give NaN)
    i = torch.arange(P, device=dev)
    sq, sk = seg[:, :, None], seg[:, None, :]
    mask = ((i[None, :] <= i[:, None]) & (sk >= 0) & ((sk == 0) | (sk == sq))) | torch.eye(
        P, dtype=torch.bool, device=dev
    )
    # label j of row b (its continuation's token j, at position plen + j) is predicted by the state
    # before it: the prompt's last for j = 0, else the row's input j − 1
    j = torch.arange(int(slen.max()), device=dev)
    lab = plen[:, None] + j - 1  # (B, Ls) label positions
    want = where.bool().gather(1, lab.clamp(max=T - 2)) & (j[None] < slen[:, None])
    rows, jj = want.nonzero(as_tuple=True)
    col = torch.where(jj == 0, plen[rows] - 1, off[rows] + jj - 1)
    x = inner.embed_tokens(ids)
    cos, sin = _rotary(*inner.rotary_emb(x, pos))
    h, _ = _layer_stack(inner, s, x, cos, sin, mask[:, None], keep=(group[rows], col))
    return _logprobs_at(model, _rms(inner.norm, h), input_ids[rows, plen[rows] + jj], rows, lab[rows, jj], (B, T - 1))


def _split(model, input_ids, where, plen, slen, group, firsts) -> torch.Tensor:
    """The prompts (U, Lp) and the continuations (B, Li) as one list of tokens for every per-token
    operation (norms, rotary, projections, MLP: one pass through each layer, as packed), split only
    for attention: the prompts causally among themselves, each continuation's queries over its
    prompt's keys and then causally over its own. Attention per row stays (Lp + Li)·Li pairs where
    packed spends (the whole group's length)² under a block mask, most of it masked out."""
    inner, s = model.model, _Shape(model.config)
    B, T = input_ids.shape
    dev = input_ids.device
    U, Lp = len(firsts), int(plen.max())
    Li = max(int((slen - 1).max()), 1)  # a continuation's last token is a label only, not an input
    n_p = U * Lp
    cols = torch.arange(Lp, device=dev)
    at = plen[:, None] + torch.arange(Li, device=dev)  # (B, Li) the inputs' positions in their own rows
    ids = torch.cat([input_ids[firsts, :Lp].reshape(-1), input_ids.gather(1, at.clamp(max=T - 1)).reshape(-1)])
    pos = torch.cat([cols.repeat(U), at.reshape(-1)])
    x = inner.embed_tokens(ids)  # (N, hidden)
    cos, sin = _rotary(*inner.rotary_emb(x[None], pos[None]))
    cos, sin = cos[0], sin[0]  # (N, 1, D)
    # a continuation query sees its prompt (not the padding past its length), then its own inputs causally
    pmask = (cols[None] < plen[:, None])[:, None, None, :].expand(B, 1, Li, Lp)
    causal = torch.ones((Li, Li), dtype=torch.bool, device=dev).tril().expand(B, 1, Li, Li)
    mask = torch.cat([pmask, causal], dim=-1)  # (B, 1, Li, Lp + Li)
    # label j of row b is predicted by the prompt's last state for j = 0, else by the row's input j − 1
    j = torch.arange(int(slen.max()), device=dev)
    lab = plen[:, None] + j - 1  # (B, Ls) label positions
    want = where.bool().gather(1, lab.clamp(max=T - 2)) & (j[None] < slen[:, None])
    rows, jj = want.nonzero(as_tuple=True)
    keep = torch.where(jj == 0, group[rows] * Lp + plen[rows] - 1, n_p + rows * Li + jj - 1)
    H, KV, D = s.heads, s.kv_heads, s.head_dim
    gqa = H != KV
    last = len(inner.layers) - 1

    def heads(t: torch.Tensor, n: int, L: int) -> torch.Tensor:  # (n·L, heads, D) -> (n, heads, L, D)
        return t.view(n, L, -1, D).transpose(1, 2)

    for i, layer in enumerate(inner.layers):
        qkv, gate_up = _fused(layer)
        h = qkv(_rms(layer.input_layernorm, x)).view(-1, H + 2 * KV, D)
        qk, v = h.split([H + KV, KV], dim=1)
        q, k = (qk * cos + qk.roll(D // 2, -1) * sin).split([H, KV], dim=1)
        (qp, qs), (kp, ks), (vp, vs) = (t.split([n_p, B * Li]) for t in (q, k, v))
        kp, vp = heads(kp, U, Lp), heads(vp, U, Lp)
        # right-padded prompts: causal attention never reaches a prompt's padding
        op = F.scaled_dot_product_attention(heads(qp, U, Lp), kp, vp, is_causal=True, enable_gqa=gqa)
        os_ = F.scaled_dot_product_attention(
            heads(qs, B, Li),
            torch.cat([kp[group], heads(ks, B, Li)], dim=2),
            torch.cat([vp[group], heads(vs, B, Li)], dim=2),
            attn_mask=mask,
            enable_gqa=gqa,
        )
        o = torch.cat([op.transpose(1, 2).reshape(n_p, H * D), os_.transpose(1, 2).reshape(B * Li, H * D)])
        if i == last:
            x, o = x[keep], o[keep]
        x = _finish(layer, gate_up, x, o)
    return _logprobs_at(model, _rms(inner.norm, x), input_ids[rows, plen[rows] + jj], rows, lab[rows, jj], (B, T - 1))


class LeanDecoder:
    """`prefill(ids, mask, pos, max_new)` → last-position logits (B, V); then `step(tok, pos)` once per
    token; `keep(rows)` keeps (or repeats) those rows of the cache.

    A decoding step is one token per row, so it is run on 2-D (rows, hidden) activations with as few
    operations as the function allows: the rotary table is computed once per generation for every
    position it can reach, q and k are rotated together, and attention for the single query is two
    batched products and a softmax over the cached keys (grouped-query heads read their shared key
    head through a view, no copy). At rollout sizes each step costs more in per-operation overhead
    and in reading the weights than in arithmetic, so fewer operations is what makes it faster."""

    def __init__(self, model):
        inner = model.model
        self.s = _Shape(model.config)
        self.embed, self.norm, self.rotary, self.head = inner.embed_tokens, inner.norm, inner.rotary_emb, model.lm_head
        self.layers = list(inner.layers)
        # the weights as they are now: a decoder is made per generation, after any weight load
        self.fused = [_fused(layer, merged=True) for layer in self.layers]

    def _layers(self, x: torch.Tensor, pos: torch.Tensor, at: slice, keys: int, mask: torch.Tensor) -> torch.Tensor:
        """Run every layer on x (B, T, hidden) whose tokens go to cache columns `at`; attention reads
        the first `keys` columns under `mask` (B, 1, T, keys)."""
        cos, sin = _rotary(*self._rotation(x, pos))
        for i, layer in enumerate(self.layers):
            qkv, gate_up = self.fused[i]
            q, k, v = _qkv(layer, qkv, self.s, x, cos, sin)
            self.k[i][:, :, at] = k
            self.v[i][:, :, at] = v
            o = F.scaled_dot_product_attention(
                q,
                self.k[i][:, :, :keys],
                self.v[i][:, :, :keys],
                attn_mask=mask,
                enable_gqa=self.s.heads != self.s.kv_heads,
            )
            x = _finish(layer, gate_up, x, _heads_last(o))
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_rms(self.norm, x), self.head.weight, self.head.bias)

    def _rotation(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (*pos.shape, head_dim) of the positions `pos`."""
        if self.cos is None:  # a length-dependent RoPE: computed as it goes, as the model's own forward does
            cos, sin = self.rotary(x, pos if pos.dim() == 2 else pos[:, None])
            return (cos, sin) if pos.dim() == 2 else (cos[:, 0], sin[:, 0])
        return self.cos[pos], self.sin[pos]

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, max_new: int) -> torch.Tensor:
        B, P = ids.shape
        width = P + max_new
        x = self.embed(ids)
        # the rotary embedding of every position this generation can reach, from the model's own
        # module (so any RoPE scaling it implements), looked up per step instead of recomputed
        self.cos = self.sin = None
        # dynamic-NTK and LongRoPE pick their frequencies from the length a forward reaches: per step
        if not any(kind in str(getattr(self.rotary, "rope_type", "")) for kind in ("dynamic", "longrope")):
            cos, sin = self.rotary(x, torch.arange(width, device=ids.device)[None])
            self.cos, self.sin = cos[0], sin[0]  # (width, head_dim)
        self.k = [x.new_zeros((B, self.s.kv_heads, width, self.s.head_dim)) for _ in self.layers]
        self.v = [x.new_zeros((B, self.s.kv_heads, width, self.s.head_dim)) for _ in self.layers]
        valid = torch.zeros((B, width), dtype=torch.bool, device=ids.device)
        valid[:, :P] = mask.bool()
        # additive attention bias of the decoding steps: 0 on a row's real keys, −inf elsewhere
        self.bias = torch.zeros((B, width), dtype=x.dtype, device=ids.device).masked_fill_(~valid, float("-inf"))
        causal = torch.ones((P, P), dtype=torch.bool, device=ids.device).tril()
        # a query attends to earlier real tokens; a padding query to itself only (a row with no key
        # at all would give NaN, and no real token ever attends to padding)
        attend = (causal & valid[:, None, None, :P]) | torch.eye(P, dtype=torch.bool, device=ids.device)
        self.t = P
        return self._logits(self._layers(x, pos, slice(0, P), P, attend)[:, -1])

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        s, t = self.s, self.t
        B, H, KV, D = len(tok), s.heads, s.kv_heads, s.head_dim
        G = H // KV
        self.bias[:, t] = 0.0
        bias = self.bias[:, None, None, : t + 1]  # (B, 1, 1, t+1)
        x = self.embed(tok)  # (B, hidden)
        cos, sin = self._rotation(x, pos)
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, D)
        for i, layer in enumerate(self.layers):
            qkv, gate_up = self.fused[i]
            h = qkv(_rms(layer.input_layernorm, x)).view(B, H + 2 * KV, D)
            qk = _rope(h[:, : H + KV], cos, sin)  # q and k heads rotated together
            self.k[i][:, :, t] = qk[:, H:]
            self.v[i][:, :, t] = h[:, H + KV :]
            keys, values = self.k[i][:, :, : t + 1], self.v[i][:, :, : t + 1]  # (B, KV, t+1, D)
            # the G query heads of a key head attend together: (B, KV, G, D) @ (B, KV, D, t+1)
            scores = torch.matmul(qk[:, :H].reshape(B, KV, G, D), keys.transpose(-1, -2)).mul_(D**-0.5).add_(bias)
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
            o = torch.matmul(weights, values).reshape(B, H * D)
            a, m = layer.self_attn, layer.mlp
            x = x + F.linear(o, _w(a.o_proj), a.o_proj.bias)
            g, u = gate_up(_rms(layer.post_attention_layernorm, x)).chunk(2, dim=-1)
            x = x + F.linear(_act(m)(g) * u, _w(m.down_proj), m.down_proj.bias)
        self.t = t + 1
        return self._logits(x)

    def keep(self, rows: torch.Tensor) -> None:
        self.k = [k[rows] for k in self.k]
        self.v = [v[rows] for v in self.v]
        self.bias = self.bias[rows]

    @property
    def static_ok(self) -> bool:
        """The fixed-shape step below covers this model (a RoPE table computed at prefill)."""
        return self.cos is not None

    def start_static(self, tok: torch.Tensor, pos: torch.Tensor) -> None:
        """Inputs of `static_step` as buffers it reads in place: the rows' next tokens, their
        positions and the cache column to write (after prefill and any `keep`)."""
        self.tok_in, self.pos_in = tok.clone(), pos.clone()
        self.t_in = torch.tensor([self.t], device=tok.device)

    def static_step(self) -> torch.Tensor:
        """`step` with shapes that never change: every row stays in the batch (finished ones are
        ignored by the caller), the token and its cache column come from `tok_in`/`t_in` (device
        tensors, advanced in place), and attention reads the cache's full width under the bias
        (−inf on every column not yet written). No host synchronisation and no allocation whose
        size depends on the step, so the whole step can be captured once as a CUDA graph and
        replayed per token (`torch.cuda.CUDAGraph`): one launch instead of hundreds of kernels,
        which is what bounds a decoding step on a GPU at rollout sizes."""
        s, t = self.s, self.t_in
        B, H, KV, D = len(self.tok_in), s.heads, s.kv_heads, s.head_dim
        G = H // KV
        self.bias.index_fill_(1, t, 0.0)
        bias = self.bias[:, None, None, :]  # (B, 1, 1, width)
        x = self.embed(self.tok_in)
        cos, sin = self.cos[self.pos_in][:, None], self.sin[self.pos_in][:, None]  # (B, 1, D)
        for i, layer in enumerate(self.layers):
            qkv, gate_up = self.fused[i]
            h = qkv(_rms(layer.input_layernorm, x)).view(B, H + 2 * KV, D)
            qk = _rope(h[:, : H + KV], cos, sin)
            self.k[i].index_copy_(2, t, qk[:, H:, None])
            self.v[i].index_copy_(2, t, h[:, H + KV :, None])
            scores = torch.matmul(qk[:, :H].reshape(B, KV, G, D), self.k[i].transpose(-1, -2)).mul_(D**-0.5)
            weights = torch.softmax(scores.add_(bias), dim=-1, dtype=torch.float32).to(self.v[i].dtype)
            o = torch.matmul(weights, self.v[i]).reshape(B, H * D)
            a, m = layer.self_attn, layer.mlp
            x = x + F.linear(o, _w(a.o_proj), a.o_proj.bias)
            g, u = gate_up(_rms(layer.post_attention_layernorm, x)).chunk(2, dim=-1)
            x = x + F.linear(_act(m)(g) * u, _w(m.down_proj), m.down_proj.bias)
        t.add_(1)
        self.pos_in.add_(1)
        return self._logits(x)


class GraphedStep:
    """`static_step` of a LeanDecoder on CUDA, captured as one CUDA graph at its first call (after
    one eager run on a side stream, which warms up the kernels and allocator as capture requires)
    and replayed for every later token. The returned logits are the graph's own output buffer:
    read them before the next call."""

    def __init__(self, dec: LeanDecoder):
        self.dec, self.graph, self.out = dec, None, None

    def __call__(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
            return self.out
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self.dec.static_step()  # a real step (the cache advances), not a throw-away run
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # records the kernels without running them
            self.out = self.dec.static_step()
        return logits
