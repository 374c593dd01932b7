"""Reference: the frozen starting policy; log-probs only. Several ranks (`raypai.alignment.ranks`)
score their share of a batch's rows each; the shares are all-gathered. Each rank holds the whole
model, or with `zero3` only its partition of every weight (DeepSpeed ZeRO-3 inference: loaded under
`zero.Init`, each module's weights gathered for its forward and released after), for a reference
too large for one device."""

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
        zero3: bool = False,
    ):
        """`device`: "cpu" or "cuda"; `dtype`: the weights' (default bf16 on CUDA, fp32 on the CPU);
        `rank` of `rendezvous.ranks` (None: one); `zero3`: hold a partition of the weights only."""
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.device = role_device(device, "reference")
        self.rank, self.ranks = rank, rendezvous.ranks if rendezvous else 1
        self.zero3 = zero3
        wdtype = inference_dtype(self.device, dtype)
        if zero3:
            self.model = _zero3_model(model_dir, rendezvous, rank, self.device, wdtype)
            return
        if self.ranks > 1:
            # the shares are all-gathered through host memory, so the group is gloo's on any device
            _ranks.join(rendezvous, rank, use_gpu=False, deepspeed=False)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).to(self.device, wdtype).eval()

    def param_bytes(self) -> int:
        """Bytes of the weights this rank holds (with `zero3`, its partitions)."""
        return sum(
            (p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()) * p.element_size()
            for p in self.model.parameters()
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


def _zero3_model(model_dir: str, rv, rank: int, device: torch.device, dtype: torch.dtype):
    """The model as this rank's ZeRO-3 partitions in a DeepSpeed inference engine (no optimizer):
    built and loaded under `zero.Init` (transformers' DeepSpeed integration), so no rank ever holds
    the whole model; every rank must run every forward (`_ranks.share` gives an idle rank a row)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from raypai.alignment.roles._engine import engine_config
    from raypai.train._deepspeed import import_deepspeed

    _ranks.join(rv, rank, use_gpu=device.type == "cuda")
    conf = engine_config(3, ranks=rv.ranks if rv else 1, use_gpu=device.type == "cuda")
    if dtype == torch.bfloat16:
        conf["bf16"] = {"enabled": True}
    keep = HfDeepSpeedConfig(conf)  # while it lives, from_pretrained loads under zero.Init
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    finally:
        del keep
    engine, _, _, _ = import_deepspeed().initialize(model=model, config=conf, dist_init_required=False)
    return engine.module.eval()
