"""A lean decoding forward for Llama-family models (Llama, Qwen2, Mistral): the rollout's hot loop.

At rollout sizes a transformers forward pass spends most of its time outside the matrix products
(module calls, mask construction, cache bookkeeping, output containers). This computes the same
function from the model's own weights with a preallocated KV cache and one boolean mask: RMSNorm,
rotary embeddings (the model's own rotary module, so every RoPE scaling it supports), grouped-query
attention through `scaled_dot_product_attention`, SwiGLU MLP. Anything else (other architectures,
sliding-window layers, tensor-parallel `pretraining_tp`) returns None from `lean_decoder` and the
rollout uses the model's own forward. Checked against transformers' greedy tokens and log-probs in
tests/alignment/test_decode.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LEAN_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def lean_decoder(model) -> LeanDecoder | None:
    """A LeanDecoder for `model`, or None where the lean forward would not compute the same function."""
    cfg = model.config
    if type(model).__name__ not in LEAN_ARCHITECTURES or getattr(cfg, "pretraining_tp", 1) > 1:
        return None
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        return None
    if getattr(cfg, "sliding_window", None) and type(model).__name__ == "MistralForCausalLM":
        return None
    return LeanDecoder(model)


class LeanDecoder:
    """`prefill(ids, mask, pos, max_new)` → last-position logits (B, V); then `step(tok, pos)` once per
    token; `keep(rows)` drops finished rows from the cache."""

    def __init__(self, model):
        inner = model.model
        cfg = model.config
        self.embed, self.norm, self.rotary, self.head = inner.embed_tokens, inner.norm, inner.rotary_emb, model.lm_head
        self.layers = list(inner.layers)
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # q/k/v and gate/up as one matrix product each (the weights as they are now: a decoder is
        # made per generation, after any weight load)
        self.qkv, self.gate_up = [], []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            self.qkv.append((torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                             None if biases[0] is None else torch.cat(biases)))
            self.gate_up.append((torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                                 None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias])))

    @staticmethod
    def _rms(norm, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        return norm.weight * h.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _layers(self, x: torch.Tensor, pos: torch.Tensor, at: slice, keys: int, mask: torch.Tensor) -> torch.Tensor:
        """Run every layer on x (B, T, hidden) whose tokens go to cache columns `at`; attention reads
        the first `keys` columns under `mask` (B, 1, T, keys)."""
        B, T, _ = x.shape
        cos, sin = self.rotary(x, pos)
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, head_dim)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = self._rms(layer.input_layernorm, x)
            qkv = F.linear(h, *self.qkv[i]).view(B, T, self.heads + 2 * self.kv_heads, self.head_dim).transpose(1, 2)
            q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
            self.k[i][:, :, at] = self._rope(k, cos, sin)
            self.v[i][:, :, at] = v
            o = F.scaled_dot_product_attention(self._rope(q, cos, sin), self.k[i][:, :, :keys], self.v[i][:, :, :keys],
                                               attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
            x = x + F.linear(o.transpose(1, 2).reshape(B, T, -1), a.o_proj.weight, a.o_proj.bias)
            m = layer.mlp
            h = self._rms(layer.post_attention_layernorm, x)
            gate, up = F.linear(h, *self.gate_up[i]).chunk(2, dim=-1)
            up = m.act_fn(gate) * up
            x = x + F.linear(up, m.down_proj.weight, m.down_proj.bias)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms(self.norm, x), self.head.weight, self.head.bias)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, max_new: int) -> torch.Tensor:
        B, P = ids.shape
        width = P + max_new
        x = self.embed(ids)
        self.k = [x.new_zeros((B, self.kv_heads, width, self.head_dim)) for _ in self.layers]
        self.v = [x.new_zeros((B, self.kv_heads, width, self.head_dim)) for _ in self.layers]
        self.valid = torch.zeros((B, width), dtype=torch.bool, device=ids.device)
        self.valid[:, :P] = mask.bool()
        causal = torch.ones((P, P), dtype=torch.bool, device=ids.device).tril()
        # a query attends to earlier real tokens; a padding query to itself only (a row with no key
        # at all would give NaN, and no real token ever attends to padding)
        attend = (causal & self.valid[:, None, None, :P]) | torch.eye(P, dtype=torch.bool, device=ids.device)
        self.t = P
        return self._logits(self._layers(x, pos, slice(0, P), P, attend)[:, -1])

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        t = self.t
        self.valid[:, t] = True
        x = self._layers(self.embed(tok[:, None]), pos[:, None], slice(t, t + 1), t + 1,
                         self.valid[:, None, None, :t + 1])
        self.t = t + 1
        return self._logits(x[:, -1])

    def keep(self, rows: torch.Tensor) -> None:
        self.k = [k[rows] for k in self.k]
        self.v = [v[rows] for v in self.v]
        self.valid = self.valid[rows]
