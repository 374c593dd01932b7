"""Rollout: batched sampling with a KV cache (HF `generate`), weights loaded from the trainer."""

from __future__ import annotations

import torch

from raypai.alignment._tensors import END, chat_prompt, pad, token_logprobs
from raypai.errors import ConfigError


class Rollout:
    def __init__(self, model_dir: str, seed: int = 0, threads: int = 1):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        torch.manual_seed(seed)  # HF sampling draws from the global generator; its state is checkpointed
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.end_id = self.tok.convert_tokens_to_ids(END)

    def load_weights(self, state: dict) -> int:
        self.model.load_state_dict(state)
        return sum(v.numel() * v.element_size() for v in state.values())

    @torch.no_grad()
    def generate(self, prompts: list[str], *, n: int = 1, max_new_tokens: int = 8, temperature: float = 1.0,
                 top_p: float = 1.0, stop: tuple[str, ...] = (), logprobs: bool = False) -> dict:
        """n samples per prompt, grouped prompt by prompt; temperature 0 is greedy. Generation stops
        at the chat end token, EOS or any token in `stop`; the stop token stays in the completion's
        ids (the policy learns to stop) but not in its text. Returns completion texts, token ids
        (prompt + completion), response masks and a right-padded training batch; with `logprobs`
        also the per-token log-probs of that batch under the weights that sampled it (B, T−1),
        which an off-policy update needs as its behaviour log-probs."""
        stops = [self.end_id, self.tok.eos_token_id, *self._stop_ids(stop)]
        texts = [chat_prompt(self.tok, p) for p in prompts for _ in range(n)]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        greedy = temperature == 0
        out = self.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=not greedy,
                                  temperature=None if greedy else temperature, top_p=None if greedy else top_p,
                                  eos_token_id=stops, pad_token_id=self.tok.pad_token_id, use_cache=True)
        P = enc["input_ids"].shape[1]  # left padding: every completion starts at column P
        seqs, masks, completions = [], [], []
        for i in range(len(texts)):
            prompt_ids = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
            comp = out[i, P:].tolist()
            cut = next((j for j, t in enumerate(comp) if t in stops), None)
            if cut is not None:
                comp = comp[: cut + 1]
            elif self.tok.pad_token_id in comp:
                comp = comp[: comp.index(self.tok.pad_token_id)]
            completions.append(self.tok.decode([t for t in comp if t not in stops], skip_special_tokens=True))
            seqs.append(prompt_ids + comp)
            masks.append([0] * len(prompt_ids) + [1] * len(comp))
        batch = pad(seqs, masks, self.tok.pad_token_id)
        out = {"completions": completions, "batch": batch, "seqs": seqs, "masks": masks}
        if logprobs:
            out["logprobs"] = token_logprobs(self.model, batch["input_ids"], batch["attention_mask"])
        return out

    def _stop_ids(self, stop: tuple[str, ...]) -> list[int]:
        ids = [self.tok.convert_tokens_to_ids(s) for s in stop]
        bad = [s for s, i in zip(stop, ids) if i is None or i == self.tok.unk_token_id]
        if bad:
            raise ConfigError([f"stop token {s!r} is not a single token of this tokenizer; use a special token "
                               "such as '<|end|>' or one vocabulary entry" for s in bad], what="rollout stop tokens")
        return ids

    def rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    @torch.no_grad()
    def logprobs(self, batch: dict) -> torch.Tensor:
        return token_logprobs(self.model, batch["input_ids"], batch["attention_mask"])
