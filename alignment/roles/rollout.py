"""Rollout: batched sampling with a KV cache, weights loaded from the trainer.
Prompts are strings (standard format) or message lists (the tokenizer's chat template); generation
stops at the tokenizer's stop tokens (EOS, generation_config EOS, the template's end-of-turn).

Three engines: `"raypai"` (default; `raypai.alignment._decode`: finished rows leave the batch and the
behaviour log-probs come from the sampling pass itself), `"hf"` (transformers' `generate`, for a
model the lean loop does not support) and `"vllm"` (`roles._vllm`: vLLM in this actor, the weights
pushed into it at each sync; the HF model then stays on the CPU as the weights' staging copy)."""

from __future__ import annotations

import torch

from raypai.alignment._decode import STEP_FLOPS_PER_THREAD, decode, left_pad
from raypai.alignment._tensors import cpu_threads, pad, to_device, token_logprobs
from raypai.alignment.config import ROLLOUT_ENGINES
from raypai.alignment.roles._device import inference_dtype, release, role_device
from raypai.chat import ChatFormat
from raypai.errors import ConfigError


class Rollout:
    def __init__(
        self,
        model_dir: str,
        seed: int = 0,
        threads: int = 1,
        engine: str = "raypai",
        device: str = "cpu",
        dtype: str | None = None,
        compiled: bool = False,
        gpu_share: float = 0.5,
        tensor_parallel: int = 1,
        gpu_bundles: tuple[int, ...] = (),
    ):
        """`device`: "cpu" or "cuda"; `dtype`: the weights' (default bf16 on CUDA, fp32 on the CPU).
        On CUDA the raypai engine replays its decoding step as a CUDA graph; `compiled`: on the CPU it
        runs the step through `torch.compile` (`_decode`). `gpu_share`: the GPU memory vLLM may hold
        (`engine="vllm"` on CUDA), of each of its `tensor_parallel` GPUs when it spans several (its
        workers in the placement-group bundles `gpu_bundles`: `Placement.tensor_parallel`)."""
        from transformers import AutoModelForCausalLM

        if engine not in ROLLOUT_ENGINES:
            raise ConfigError([f"rollout engine {engine!r} is not one of {', '.join(ROLLOUT_ENGINES)}"], what="rollout")
        self.engine, self.compiled = engine, compiled
        # a vLLM engine over several GPUs: this actor holds none (its Ray workers do), and keeps the HF copy on the CPU
        self.device = torch.device("cpu") if tensor_parallel > 1 else role_device(device, "rollout")
        torch.set_num_threads(threads)
        torch.manual_seed(seed)  # HF sampling draws from the global generator; its state is checkpointed
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        self.fmt = ChatFormat.from_pretrained(model_dir)
        self.tok = self.fmt.tok
        dtype = inference_dtype(torch.device(device), dtype)
        self.vllm = None
        if engine == "vllm":
            from raypai.alignment.roles._vllm import VllmEngine

            # vLLM holds the device; the HF model stays on the CPU as the weights' staging copy, in the
            # replica's dtype (so its shared-memory layout is the one a GPU trainer writes: bf16)
            self.model = AutoModelForCausalLM.from_pretrained(model_dir).to(dtype=dtype).eval()
            self.vllm = VllmEngine(
                model_dir,
                device=torch.device(device),
                dtype=dtype,
                gpu_share=gpu_share,
                tensor_parallel=tensor_parallel,
                gpu_bundles=tuple(gpu_bundles),
                max_model_len=self.model.config.max_position_embeddings,
            )
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir).to(self.device, dtype).eval()
        self.version = 0  # update count of the weights loaded (0 = the starting folder)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self._shared = None  # the trainer's shared-memory weights, mapped at the first same-node sync
        self._live = False  # parameters bound to the trainer's own (live shared parameters)

    def load_weights(self, state: dict, version: int | None = None) -> int:
        """Load the trainer's weights; `version` (its update count) is reported with every sample. A
        LoRA trainer hands over its adapters only ({"lora": factors, "spec": LoRASpec}, `Trainer.
        state_dict`): they are merged into this replica's own weights (fp32 weights take the change of the
        delta in place; lower precision is merged onto a copy of the targeted base weights kept at the
        first load: `lora.merge_into`), so decoding runs a plain model.
        Returns the bytes handed over."""
        if "parts" in state:  # a ZeRO-3 trainer's buckets (`Trainer.state_parts`), loaded one at a time
            return self._load_parts(state["parts"], version)
        if "lora" in state:
            from raypai.alignment.lora import merge_into

            self._lora_base = merge_into(self.model, state["lora"], state["spec"], getattr(self, "_lora_base", {}))
            sent = state["lora"]
            if self.vllm is not None:
                self.vllm.push(self.model.state_dict())
        else:
            self.model.load_state_dict(state)
            sent = state
            if self.vllm is not None:
                self.vllm.push(state)
        if version is not None:
            self.version = version
        return sum(v.numel() * v.element_size() for v in sent.values())

    def _load_parts(self, parts: list, version: int | None) -> int:
        import ray

        own, seen, sent = self.model.state_dict(), set(), 0
        with torch.no_grad():
            for ref in parts:
                bucket = ray.get(ref)
                for name, t in bucket.items():
                    own[name].copy_(t)
                    sent += t.numel() * t.element_size()
                seen |= bucket.keys()
                del bucket
        missing = sorted(set(own) - seen)
        if missing:
            raise RuntimeError(f"the trainer's buckets missed {len(missing)} weights of this replica: {missing[:5]}")
        if self.vllm is not None:
            self.vllm.push(own)
        if version is not None:
            self.version = version
        return sent

    def join_weight_group(self, host: str, port: int, rank: int, size: int, backend: str, buckets, timeout_s=60.0):
        """Join the trainer's weight group (`raypai.alignment.sync_group`) as `rank`, after checking its
        manifest against this replica's weights (a mismatch is refused, naming the tensor)."""
        from raypai.alignment import sync_group as G

        G.check_against(buckets, self.model.state_dict())
        self._wg_manifest = buckets
        self._wg_device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        self._wg = G.open_group(host, port, rank, size, backend, timeout_s)
        return True

    def pull_weights(self, version: int) -> int:
        """Receive the trainer's broadcast of `version` into this replica's weights; returns the bytes."""
        from raypai.alignment import sync_group as G

        size = G.receive(self._wg, self._wg_manifest, self.model.state_dict(), self._wg_device)
        if self.vllm is not None:
            self.vllm.push(self.model.state_dict())
        self.version = version
        return size

    def load_shared(self, written: tuple[str, int, bool]) -> int:
        """Take the weights the trainer made readable (`written` = (path, version, live), from its
        `write_shared`); refuses any other version. Copied into this replica's parameters, or, live,
        this replica's parameters are bound to the trainer's own pages once and every later sync is
        the version check. Returns the bytes of weights handed over."""
        from raypai.alignment.sync import HEADER, SharedWeights

        path, version, live = written
        if live and self.vllm is not None:
            raise RuntimeError(
                "a vLLM rollout keeps its own copy of the weights and cannot read the trainer's "
                "parameters in place: the trainer must not be made with live_weights for it"
            )
        if self._shared is None or self._shared.path != path:  # the first sync from this buffer: map it
            state = dict(self.model.named_parameters()) if live else self.model.state_dict()
            self._shared = SharedWeights(path, state, create=False)
            if live:
                self._shared.check(version)
                self._shared.bind(state, copy=False)
        self._live = live
        if live:  # bound: the version check is the whole sync
            self._shared.check(version)
            size = self._shared.total - HEADER
        else:
            size = self._shared.read_into(self.model.state_dict(), version)
            if self.vllm is not None:
                self.vllm.push(self.model.state_dict())
        self.version = version
        return size

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    @torch.no_grad()
    def generate(
        self,
        prompts: list,
        *,
        n: int = 1,
        max_new_tokens: int,  # no default here: the config's (`raypai.alignment.config.MAX_NEW_TOKENS`)
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: tuple[str, ...] = (),
        logprobs: bool = False,
    ) -> dict:
        """n samples per prompt, grouped prompt by prompt; temperature 0 is greedy. Generation stops
        at the tokenizer's stop tokens or any token in `stop`; the stop token stays in the completion's
        ids (the policy learns to stop) but not in its text. Returns completion texts, token ids
        (prompt + completion), response masks and a right-padded training batch; with `logprobs`
        also the per-token log-probs of that batch under the weights that sampled it (B, T−1),
        which an off-policy update needs as its behaviour log-probs."""
        if self._live:  # the trainer's pages: sample only with a whole update, and report which one
            self.version = self._shared.current()
        stops = list(dict.fromkeys([*self.fmt.stop_ids, *self._stop_ids(stop)]))
        prompt_ids = [ids for p in prompts for ids in [self.fmt.prompt_ids(p)] * n]  # the template once per prompt
        threads = torch.get_num_threads()
        if self.device.type == "cpu":
            # the whole call (prefill, decoding, padding, log-probs) on the threads its decoding step
            # is worth: below the grain a second thread costs more than it saves
            # (benchmarks/history/asides.md)
            torch.set_num_threads(cpu_threads(2 * len(prompt_ids) * self.n_params, STEP_FLOPS_PER_THREAD, threads))
        try:
            return self._generate(prompt_ids, stops, max_new_tokens, temperature, top_p, logprobs)
        finally:
            torch.set_num_threads(threads)

    def _generate(self, prompt_ids, stops, max_new_tokens, temperature, top_p, logprobs) -> dict:
        if self.engine == "raypai":
            d = decode(
                self.model,
                prompt_ids,
                pad_id=self.tok.pad_token_id,
                stop_ids=stops,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                logprobs=logprobs,
                compiled=self.compiled,
            )
            comps, sampled_lp, stopped = d.tokens, d.logprobs, d.stopped
        elif self.engine == "vllm":
            comps, sampled_lp, stopped = self.vllm.generate(
                prompt_ids, stops, max_new_tokens, temperature, top_p, logprobs
            )
        else:
            comps, stopped = self._hf_generate(prompt_ids, stops, max_new_tokens, temperature, top_p)
            sampled_lp = None
        seqs = [p + c for p, c in zip(prompt_ids, comps)]
        masks = [[0] * len(p) + [1] * len(c) for p, c in zip(prompt_ids, comps)]
        completions = [self.tok.decode([t for t in c if t not in stops], skip_special_tokens=True) for c in comps]
        batch = pad(seqs, masks, self.tok.pad_token_id)
        out = {
            "completions": completions,
            "batch": batch,
            "seqs": seqs,
            "masks": masks,
            "stopped_fraction": stopped / max(1, len(seqs)),
            "weights_version": self.version,
        }
        if logprobs and sampled_lp is not None:  # label position of completion token j: len(prompt) − 1 + j
            lp = torch.zeros(batch["response_mask"].shape)
            for i, (p, row) in enumerate(zip(prompt_ids, sampled_lp)):
                lp[i, len(p) - 1 : len(p) - 1 + len(row)] = row
            out["logprobs"] = lp
        elif logprobs:
            out["logprobs"] = self.logprobs(batch)
        release(self.device)  # the KV cache's blocks go back to the GPU, for the colocated trainer
        return out

    def _hf_generate(self, prompt_ids, stops, max_new_tokens, temperature, top_p) -> tuple[list[list[int]], int]:
        """transformers' `generate` over left-padded prompts; top-k off so the samples come from the
        model's distribution (temperature and top-p only)."""
        ids, att = left_pad(prompt_ids, self.tok.pad_token_id, self.model.device)
        enc = {"input_ids": ids, "attention_mask": att}
        greedy = temperature == 0
        out = self.model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else temperature,
            top_p=None if greedy else top_p,
            top_k=None if greedy else 0,
            eos_token_id=stops,
            pad_token_id=self.tok.pad_token_id,
            use_cache=True,
        )
        P = enc["input_ids"].shape[1]  # left padding: every completion starts at column P
        comps, stopped = [], 0
        for i in range(len(prompt_ids)):
            comp = out[i, P:].tolist()
            cut = next((j for j, t in enumerate(comp) if t in stops), None)
            if cut is not None:
                comp = comp[: cut + 1]
                stopped += 1
            comps.append(comp)
        return comps, stopped

    def _stop_ids(self, stop: tuple[str, ...]) -> list[int]:
        if not stop:
            return []
        vocab = self.tok.get_vocab()  # a dict of the whole vocabulary: only when there are extra stops
        bad = [s for s in stop if s not in vocab]
        if bad:
            raise ConfigError(
                [
                    f"stop token {s!r} is not a single token of this tokenizer; use one of its special "
                    f"tokens ({', '.join(self.tok.all_special_tokens[:8])}) or one vocabulary entry"
                    for s in bad
                ],
                what="rollout stop tokens",
            )
        return [vocab[s] for s in stop]

    def rng_state(self):
        """The generators sampling draws from: the CPU's, and on CUDA the device's as well."""
        return (
            torch.get_rng_state() if self.device.type == "cpu" else [torch.get_rng_state(), torch.cuda.get_rng_state()]
        )

    def set_rng_state(self, state) -> None:
        if isinstance(state, torch.Tensor):
            torch.set_rng_state(state)
        else:
            torch.set_rng_state(state[0])
            torch.cuda.set_rng_state(state[1])

    @torch.no_grad()
    def logprobs(self, batch: dict) -> torch.Tensor:
        """(B, T−1) log-probs of the response tokens under the loaded weights, 0 elsewhere (float32, on the host)."""
        b = to_device(batch, self.model.device)
        return token_logprobs(self.model, b["input_ids"], b["attention_mask"], where=b["response_mask"]).cpu()

    def logprobs_on(self, sampled: dict, *outs: dict) -> torch.Tensor:
        """`logprobs` of a generation as Ray hands it over (`_loop.handed_over`)."""
        from raypai.alignment._loop import handed_over

        return self.logprobs(handed_over(sampled, outs))
