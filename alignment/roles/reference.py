"""Reference: the frozen starting policy; log-probs only."""

from __future__ import annotations

import torch

from raypai.alignment._tensors import token_logprobs


class Reference:
    def __init__(self, model_dir: str, threads: int = 1):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    @torch.no_grad()
    def logprobs(self, batch: dict) -> torch.Tensor:
        """(B, T−1) log-probs of the response tokens (`response_mask`), 0 elsewhere: every caller
        masks them, so the head runs on those positions only and each shared prompt once."""
        return token_logprobs(self.model, batch["input_ids"], batch["attention_mask"], where=batch["response_mask"])
