"""The model server: a Ray Serve deployment serving one registered model version. A thin shell:

- `Engine` (engine.py) decodes every running request in one batch over a shared KV cache, lets new
  groups join at the next token step and lets each sequence leave the moment it finishes
  (continuous batching);
- the engine runs in its own thread, so the replica's event loop keeps accepting requests while the
  model runs; requests that arrive together (within `batch_wait_timeout_s` of an idle engine) are
  prefilled together;
- every request, streaming or not, gets its own result as soon as its own sequence is done: no
  request waits for its batch-mates (no head-of-line blocking, as `@serve.batch`'s list-in/list-out
  handler would impose);
- a request whose caller goes away (the client disconnected, the router's timeout) is cancelled by
  Serve; its row leaves the engine at the next token step;
- waiting requests join by KV budget (`Engine.fits`), and tokenization and chat rendering run in a
  worker thread, off the event loop every request of the replica shares.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time

from ray import serve

from raypai.chat import ChatFormat, context_length
from raypai.deployment import DEFAULT_BATCH_WAIT_S, DEFAULT_MAX_BATCH_SIZE, DEFAULTS
from raypai.serving.engine import Engine, Event, should_admit
from raypai.serving.errors import ContextLengthExceeded, NoChatTemplate
from raypai.serving.generation import GenRequest, GenResult
from raypai.serving.metrics import ReplicaMetrics, deployment_of

log = logging.getLogger("ray.serve")


@serve.deployment(
    ray_actor_options={"num_cpus": DEFAULTS["cpus"]},
    health_check_period_s=5,
    max_ongoing_requests=DEFAULTS["max_ongoing_requests"],
)
class ModelServer:
    def __init__(
        self,
        model: str,
        version: int,
        tracking_uri: str,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        batch_wait_timeout_s: float = DEFAULT_BATCH_WAIT_S,
        threads: int = 1,
        max_kv_cells: int = DEFAULTS["max_kv_cells"],
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from raypai.tracking import Tracker

        torch.set_num_threads(threads)
        path = Tracker(tracking_uri).download_model(model, version)  # registry only, never a caller's path
        self.model_name, self.version = model, version
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path).eval()
        # a replica given GPUs (DeploymentSpec.gpus; Ray sets CUDA_VISIBLE_DEVICES) serves from the
        # first of them, in the model's saved dtype; a CPU replica sees no CUDA device
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device)
        self.context_window = context_length(self.model.config)
        # stop tokens from the tokenizer, generation_config and the chat template's end-of-turn (raypai.chat)
        self.chat = ChatFormat.from_pretrained(path, tokenizer=self.tok)
        self.engine = Engine(
            self.model, self.tok, set(self.chat.stop_ids), max_batch_size=max_batch_size, max_kv_cells=max_kv_cells
        )
        self.batch_wait_s = float(batch_wait_timeout_s)
        # at most Serve's max_ongoing_requests per replica are in here (the deployment spec bounds it)
        self.inbox: queue.Queue = queue.Queue()  # (key, GenRequest) waiting for the engine thread
        self.cancels: queue.Queue = queue.Queue()  # keys whose callers went away (engine thread drains it)
        # one thread: a fast tokenizer used from two threads at once can fail ("Already borrowed")
        self.tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raypai-tokenize")
        self.waiting = 0  # requests the engine thread holds but has not admitted (read by info())
        self.cancelled, self.last_cancel_at = 0, None  # requests dropped after their callers left; when (epoch s)
        self.listeners: dict[int, asyncio.Queue] = {}  # request key -> its events (event-loop side only)
        self.keys = itertools.count()
        # serving metrics (raypai.serving.metrics): when each request arrived and got its first token
        self.metrics = ReplicaMetrics(deployment_of(_app_name(), model), version)
        self.arrived: dict[int, float] = {}
        self.first_at: dict[int, float] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    def info(self) -> dict:
        return {
            "model": self.model_name,
            "version": self.version,
            "context_window": self.context_window,
            "has_chat_template": bool(self.tok.chat_template),
            "decode_steps": self.engine.steps,
            "decode_tokens": self.engine.tokens,
            "active_rows": self.engine.active,  # sequences in the engine's batch now
            "waiting": self.waiting + self.inbox.qsize(),  # submitted, not yet admitted
            "listeners": len(self.listeners),  # requests this replica is answering
            "cancelled": self.cancelled,
            "last_cancel_at": self.last_cancel_at,
        }

    def _prepare(self, req: GenRequest, prompt: str | None, messages: list[dict] | None) -> GenRequest:
        """Tokenize the prompt (or render the chat with the tokenizer's template) and check it fits."""
        if messages is not None and not self.chat.conversational:
            raise NoChatTemplate(f"model {self.model_name}/{self.version} has no chat template; use /v1/completions")
        # the same encoding as training (raypai.chat): template + assistant header, or the plain prompt
        # (with the tokenizer's BOS where it adds one; an empty prompt starts from the document boundary)
        ids = self.chat.prompt_ids(messages if messages is not None else (prompt or ""))
        if len(ids) + req.max_tokens > self.context_window:
            raise ContextLengthExceeded(
                f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the context window of "
                f"{self.context_window} tokens; shorten the prompt or lower max_tokens"
            )
        return dataclasses.replace(req, prompt_ids=ids)

    async def generate(self, req: GenRequest, prompt: str | None = None, messages: list[dict] | None = None):
        """One completion: `req` carries the sampling settings, `prompt` or `messages` the text.
        Returns when this request's sequence finishes, whatever its batch-mates still have to do."""
        prepared = await self._prepared(req, prompt, messages)
        key, q = self._submit(prepared)
        try:
            return await self._result(q)
        finally:
            self._forget(key)  # cancelled (the caller left): its row leaves the engine

    async def stream(self, req: GenRequest, prompt: str | None = None, messages: list[dict] | None = None):
        """Text deltas as tokens are decoded, then the GenResult."""
        prepared = await self._prepared(req, prompt, messages)
        key, q = self._submit(dataclasses.replace(prepared, stream=True))
        try:
            while True:
                event = await q.get()
                if isinstance(event, Exception):
                    raise event
                if event.delta:
                    yield event.delta
                if event.result is not None:
                    yield event.result
                    return
        finally:
            self._forget(key)  # the client disconnected mid-stream: Serve cancels this generator

    async def _prepared(self, req: GenRequest, prompt: str | None, messages: list[dict] | None) -> GenRequest:
        """`_prepare` in the tokenizing thread: a chat template is Jinja and a long prompt many BPE
        merges, which would otherwise hold the event loop every request of the replica shares."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizing, self._prepare, req, prompt, messages)

    def check_health(self) -> None:
        """Serve calls this every few seconds; raising makes Serve replace the replica."""
        if self.thread is not None and not self.thread.is_alive():
            raise RuntimeError("the generation thread has stopped")

    # ---- the engine thread ---------------------------------------------------------------------
    # The engine runs in one long-lived thread that admits requests from `inbox` between token steps
    # and posts events back to the event loop; the loop wakes only when a request has news (a
    # delta to stream, a result), not once per token.

    def _submit(self, req: GenRequest) -> tuple[int, asyncio.Queue]:
        key = next(self.keys)
        self.listeners[key] = q = asyncio.Queue()
        if self.thread is None:
            self.loop = asyncio.get_running_loop()
            self.thread = threading.Thread(target=self._engine_loop, name="raypai-engine", daemon=True)
            self.thread.start()
        self.arrived[key] = time.perf_counter()
        self.inbox.put((key, req))
        return key, q

    def _forget(self, key: int) -> None:
        """After a request ends: a key still listened to was not finished (cancelled, or its caller
        stopped reading), so the engine thread drops it, from the waiting list or the running batch."""
        if self.listeners.pop(key, None) is not None:
            self.cancels.put(key)

    async def _result(self, q: asyncio.Queue) -> GenResult:
        while True:
            event = await q.get()
            if isinstance(event, Exception):
                raise event
            if event.result is not None:
                return event.result

    def _engine_loop(self) -> None:
        waiting: collections.deque = collections.deque()  # (key, GenRequest) in arrival order
        waited = 0  # decode steps since the oldest waiting request arrived
        while True:
            if not self.engine.active and not waiting and self.inbox.empty():
                waiting.append(self.inbox.get())  # idle: sleep until a request comes
                if self.batch_wait_s > 0:
                    time.sleep(self.batch_wait_s)  # requests arriving together are prefilled together
            while not self.inbox.empty():
                waiting.append(self.inbox.get_nowait())
            self._drop_cancelled(waiting)
            items = []
            if should_admit(len(waiting), self.engine.free_slots, self.engine.active, waited):
                # in arrival order while the batch stays within its KV budget: a long request waits
                # for room rather than widening every row past what the device holds
                while waiting and len(items) < self.engine.free_slots:
                    if not self.engine.fits([r for _, r in items] + [waiting[0][1]]):
                        break
                    items.append(waiting.popleft())
            self.waiting = len(waiting)
            try:  # the engine fails a bad group or row alone; anything escaping it is a bug: fail all
                events = self.engine.add(items) if items else self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail its requests, not the replica
                log.exception("engine error: every running request fails")
                keys = [k for k, _ in items] + [s.key for s in self.engine.seqs]
                self.engine.reset()
                events = [Event(k, "", error=exc) for k in dict.fromkeys(keys)]
            waited = 0 if items or not waiting else waited + 1
            self._measure(items, events)
            self.metrics.load(len(waiting) + self.inbox.qsize(), self.engine.active)
            if events:
                self.loop.call_soon_threadsafe(self._dispatch, events)

    def _measure(self, admitted: list, events: list[Event]) -> None:
        """Time to first token of the requests just prefilled, and the decode rate of those finished."""
        now = time.perf_counter()
        failed = {e.key for e in events if e.error is not None}
        for key, _ in admitted:
            if key not in failed and key in self.arrived:
                self.first_at[key] = now
                self.metrics.first_token(now - self.arrived[key])
        for e in events:
            if e.result is not None:
                first = self.first_at.pop(e.key, now)
                self.metrics.finished(e.result.completion_tokens, now - first)
            if e.result is not None or e.error is not None:
                self.arrived.pop(e.key, None)
                self.first_at.pop(e.key, None)

    def _drop_cancelled(self, waiting: collections.deque) -> None:
        """Remove the requests whose callers went away: from the waiting list and from the batch."""
        keys = set()
        while not self.cancels.empty():
            keys.add(self.cancels.get_nowait())
        if keys:
            kept = [item for item in waiting if item[0] not in keys]
            waiting.clear()
            waiting.extend(kept)
            self.engine.cancel(keys)
            for key in keys:
                self.arrived.pop(key, None)
                self.first_at.pop(key, None)
            self.cancelled += len(keys)
            self.last_cancel_at = time.time()

    def _dispatch(self, events: list[Event]) -> None:
        for e in events:
            q = self.listeners.get(e.key)
            if q is None:
                continue
            q.put_nowait(e.error or e)
            if e.result is not None or e.error is not None:
                del self.listeners[e.key]


def _app_name() -> str | None:
    """The Serve app this replica belongs to (None outside Serve)."""
    try:
        return serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - built outside a Serve replica
        return None
