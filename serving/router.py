"""The OpenAI-compatible router: a FastAPI ingress on the Serve HTTP proxy. Routes by `model`
(= deployment name) to the model-server application of its stable or canary version."""

import asyncio
import json
import random
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError

from raypai.deployment import DeploymentSpec
from raypai.serving import auth
from raypai.serving.canary import CanaryPolicy, Windows, judge
from raypai.serving.errors import APIError, PromptError, install
from raypai.serving.generation import GenRequest, GenResult
from raypai.serving.limits import InFlight, Limits, RequestGuard, check_fields
from raypai.serving.schemas import ChatRequest, CompletionRequest


def _replica():
    """The Router instance serving this request (Serve's replica context holds it)."""
    return serve.get_replica_context().servable_object


app = FastAPI(title="raypai OpenAI-compatible API", version="1")
install(app)
app.add_middleware(RequestGuard, owner=_replica)  # token and size from the headers, before the body is read
VERSION_HEADER = "x-raypai-model-version"


def app_name(deployment: str, version: int) -> str:
    return f"raypai-{deployment}-v{version}"


def pick_version(spec: DeploymentSpec, rng: random.Random) -> int:
    """Weighted canary split: canary_percent of requests go to the canary version."""
    if spec.canary_version is not None and rng.random() * 100 < spec.canary_percent:
        return spec.canary_version
    return spec.version


def usage(res: GenResult) -> dict:
    return {
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens,
        "total_tokens": res.prompt_tokens + res.completion_tokens,
    }


async def _chain(first, rest):
    yield first
    async for item in rest:
        yield item


async def _sse(gen, rid: str, model: str, served: str, chat: bool):
    """OpenAI streaming: one `data: {chunk}` event per text delta, a last chunk with finish_reason and
    usage, then `data: [DONE]`."""
    base = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": served,
    }

    def event(piece: dict, finish_reason=None, **extra) -> str:
        chunk = {**base, "choices": [{"index": 0, **piece, "finish_reason": finish_reason}], **extra}
        return f"data: {json.dumps(chunk)}\n\n"

    if chat:
        yield event({"delta": {"role": "assistant"}})
    async for item in gen:
        if isinstance(item, GenResult):
            yield event({"delta": {}} if chat else {"text": ""}, item.finish_reason, usage=usage(item))
        else:
            yield event({"delta": {"content": item}} if chat else {"text": item})
    yield "data: [DONE]\n\n"


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=256)
@serve.ingress(app)
class Router:
    def __init__(self, database_url: str, limits: Limits = Limits()):
        from raypai.store import MetadataStore

        self.limits = limits
        self.in_flight = InFlight()  # requests in flight per token (RequestGuard counts them)

        self.store = MetadataStore(database_url, migrate_schema=False)
        self.rng = random.Random()
        self.table: dict[str, dict] = {}
        self.loaded_at = 0.0
        self.refreshing = asyncio.Lock()
        self.auth = auth.TokenCheck(self.store, ttl_s=5.0)
        self.windows = Windows()  # answered requests per (deployment, version): the canary verdicts' input
        self.judged: dict[str, tuple[float, tuple]] = {}  # deployment -> (when, what was last recorded)
        self.judging: set[asyncio.Task] = set()

    async def _routes(self) -> dict[str, DeploymentSpec]:
        """The routing table, re-read from the store at most once a second (desired state changes
        through the deploy API). The read runs in a worker thread: a slow database must not stall
        the event loop that every request of this replica shares."""
        if time.time() - self.loaded_at > 1.0:
            async with self.refreshing:  # one read at a time; the others wait for its table
                if time.time() - self.loaded_at > 1.0:
                    deployments = await asyncio.to_thread(self.store.list_deployments)
                    self.table = {d.name: d.spec for d in deployments if d.state != "deleted"}
                    self.loaded_at = time.time()
        return self.table

    async def _resolve(self, name: str):
        routes = await self._routes()
        spec = routes.get(name)
        if spec is None:
            known = ", ".join(sorted(routes)) or "none"
            raise APIError(
                404, f"model {name!r} does not exist (deployed models: {known})", code="model_not_found", param="model"
            )
        version = pick_version(spec, self.rng)
        return serve.get_app_handle(app_name(name, version)), f"{spec.model}/{version}", version

    @app.get("/v1/models")
    async def models(self, request: Request):
        await self.auth.check(request, "infer")
        data = [
            {
                "id": n,
                "object": "model",
                "owned_by": "raypai",
                "created": 0,
                "raypai_model": s.model,
                "raypai_version": s.version,
                "raypai_canary_version": s.canary_version,
                "raypai_canary_percent": s.canary_percent,
            }
            for n, s in sorted((await self._routes()).items())
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        await self.auth.check(request, "infer")
        check_fields(body, self.limits)
        return await self._serve(body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(self, body: ChatRequest, request: Request):
        await self.auth.check(request, "infer")
        check_fields(body, self.limits)
        return await self._serve(body, chat=True)

    async def _serve(self, body, chat: bool):
        """Pick a version, then answer. A replica that dies under a request (crash, node loss, kill)
        costs one retry on another replica of the same version, then a 503 with Retry-After."""
        handle, served, version = await self._resolve(body.model)
        t0, ok = time.perf_counter(), False
        try:
            for attempt in (1, 2):
                try:
                    response = await self._respond(handle, served, body, chat)
                    ok = True
                    return response
                except RayActorError as exc:
                    if attempt == 2:
                        raise APIError(
                            503,
                            f"model {served} is restarting ({type(exc).__name__}); retry shortly",
                            code="replica_unavailable",
                            headers={"retry-after": "1"},
                        ) from None
        except APIError as exc:
            ok = exc.status_code < 500  # a client's bad request is not the version's fault
            raise
        finally:
            self.windows.observe(body.model, version, ok, time.perf_counter() - t0)
            self._judge_soon(body.model)

    # ---- canary verdicts (raypai.serving.canary) -------------------------------------------------

    def _judge_soon(self, name: str) -> None:
        """Judge `name`'s canary after this answer, at most once a second, off the request's path."""
        spec = self.table.get(name)
        if (
            spec is None
            or spec.canary_version is None
            or time.monotonic() - self.judged.get(name, (0.0, None))[0] < 1.0
        ):
            return
        self.judged[name] = (time.monotonic(), self.judged.get(name, (0.0, None))[1])
        task = asyncio.ensure_future(self._judge(name, spec))
        self.judging.add(task)
        task.add_done_callback(self.judging.discard)

    async def _judge(self, name: str, spec: DeploymentSpec) -> None:
        policy = CanaryPolicy.from_spec(spec.canary_policy)
        stable = self.windows.summary(name, spec.version, policy.window_s)
        canary = self.windows.summary(name, spec.canary_version, policy.window_s)
        decision, reason = judge(policy, stable, canary)
        seen = (decision, stable["requests"], stable["errors"], canary["requests"], canary["errors"])
        if seen == self.judged[name][1]:
            return  # nothing new to record
        self.judged[name] = (self.judged[name][0], seen)
        action = "none"
        if decision == "worse" and policy.auto_rollback:
            done = await asyncio.to_thread(self.store.rollback_canary, name, spec.canary_version, reason)
            if done:
                action, self.loaded_at = "rolled_back", 0.0  # the next request re-reads the routing table
        stats = {"stable": stable, "canary": canary, "policy": policy.to_dict()}
        await asyncio.to_thread(
            self.store.record_canary_check, name, spec.version, spec.canary_version, decision, reason, stats, action
        )

    async def _respond(self, handle, served: str, body, chat: bool):
        """One call to a model-server replica, which tokenizes, checks the context window and generates."""
        req = GenRequest([], body.max_tokens, body.temperature, body.top_p, body.stops(), body.seed, body.stream)
        text = {"messages": [m.model_dump() for m in body.messages]} if chat else {"prompt": body.prompt}
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        headers = {VERSION_HEADER: served}
        try:
            if body.stream:
                gen = handle.options(stream=True).stream.remote(req, **text)
                first = await gen.__anext__()  # a bad prompt fails here, before any header is sent
                return StreamingResponse(
                    _sse(_chain(first, gen), rid, body.model, served, chat),
                    media_type="text/event-stream",
                    headers=headers,
                )
            res: GenResult = await handle.generate.remote(req, **text)
        except PromptError as exc:
            cause = getattr(exc, "cause", None) or exc  # Ray wraps it; the original carries the message
            raise APIError(400, str(cause), code=cause.code, param=cause.param) from None
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": res.text}, "finish_reason": res.finish_reason}
            if chat
            else {"index": 0, "text": res.text, "finish_reason": res.finish_reason, "logprobs": None}
        )
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": body.model,
                "system_fingerprint": served,
                "raypai_model_version": served,
                "choices": [choice],
                "usage": usage(res),
            },
            headers=headers,
        )
