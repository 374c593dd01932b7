"""Reference: the frozen starting policy; log-probs only. Several ranks (`raypai.alignment.ranks`)
each hold the model and score their share of a batch's rows; the shares are all-gathered."""

from __future__ import annotations

import torch

from raypai.alignment._tensors import to_device, token_logprobs
from raypai.alignment.roles import _ranks
from raypai.alignment.roles._device import inference_dtype, release, role_device


class Reference:
    def __init__(
        self,
        model_dir: str,
        threads: int = 1,
        device: str = "cpu",
        dtype: str | None = None,
        *,
        rank: int = 0,
        rendezvous: _ranks.Rendezvous | None = None,
    ):
        """`device`: "cpu" or "cuda"; `dtype`: the weights' (default bf16 on CUDA, fp32 on the CPU);
        `rank` of `rendezvous.ranks` (None: one)."""
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.device = role_device(device, "reference")
        self.rank, self.ranks = rank, rendezvous.ranks if rendezvous else 1
        if self.ranks > 1:
            # the shares are all-gathered through host memory, so the group is gloo's on any device
            _ranks.join(rendezvous, rank, use_gpu=False, deepspeed=False)
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir).to(self.device, inference_dtype(self.device, dtype)).eval()
        )

    @torch.no_grad()
    def logprobs(self, batch: dict) -> torch.Tensor:
        """(B, T−1) log-probs of the response tokens (`response_mask`), 0 elsewhere: every caller
        masks them, so the head runs on those positions only and each shared prompt once. Float32, on the host."""
        b, weight = _ranks.share(to_device(batch, self.device), self.rank, self.ranks)
        lp = token_logprobs(self.model, b["input_ids"], b["attention_mask"], where=b["response_mask"]).cpu()
        release(self.device)
        return _ranks.gather(lp, weight, self.ranks)

    def pair_logprobs_on(self, scores: dict, sampled: dict, *outs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Summed response log-probs (chosen (P,), rejected (P,)) of online DPO's pairs of a
        generation as Ray hands it over (`_loop.ranked_pairs`: the rollout's `outs` and the Reward
        actor's `scores` go from them to here with no round trip through the driver); None when every
        group ties. Chosen and rejected rows run as one batch, so each shared prompt runs once."""
        from raypai.alignment._loop import pair_logprobs

        return pair_logprobs(self.logprobs, scores, sampled, *outs)

    def logprobs_on(self, sampled: dict, *outs: dict) -> torch.Tensor:
        """`logprobs` of a generation as Ray hands it over (`_loop.handed_over`)."""
        from raypai.alignment._loop import handed_over

        return self.logprobs(handed_over(sampled, outs))
