"""The OpenAI-compatible router: a FastAPI ingress on the Serve HTTP proxy. Routes by `model`
(= deployment name) to the model-server application of its stable or canary version.

It serves through a metadata-database outage: the routing table is refreshed in the background (every
`routes_refresh_s`, backing off up to `max_backoff_s` while the database fails) and the last good one
is kept; tokens looked up before keep their last answer (raypai.serving.auth)."""

import asyncio
import json
import logging
import os
import random
import time
import uuid
from dataclasses import dataclass, fields

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, RayServeException
from sqlalchemy.exc import SQLAlchemyError

from raypai.deployment import DeploymentSpec
from raypai.errors import ConfigError
from raypai.serving import auth
from raypai.serving.canary import CanaryPolicy, Windows, judge
from raypai.serving.errors import APIError, PromptError, error_body, install, internal_error_body
from raypai.serving.generation import GenRequest, GenResult
from raypai.serving.limits import InFlight, Limits, RequestGuard, check_fields
from raypai.serving.metrics import rejected
from raypai.serving.schemas import ChatRequest, CompletionRequest

log = logging.getLogger("ray.serve")
FAULTS_ENV = "RAYPAI_SERVING_FAULTS"  # tests only: raypai._faults JSON of DatabaseFault


@dataclass(frozen=True)
class Freshness:
    """How long the router trusts what it read from the metadata database; `from_env` reads
    RAYPAI_SERVE_<FIELD> (the process that starts Serve, as raypai.serving.limits.Limits)."""

    token_ttl_s: float = auth.DEFAULT_TOKEN_TTL_S  # a revoked token stops working within this
    routes_refresh_s: float = 1.0  # a deploy API change reaches the router within this
    max_backoff_s: float = 30.0  # longest wait between retries while the database fails

    @classmethod
    def from_env(cls, env) -> "Freshness":
        values, problems = {}, []
        for f in fields(cls):
            key = f"RAYPAI_SERVE_{f.name.upper()}"
            raw = env.get(key)
            if raw is None or raw == "":
                continue
            try:
                values[f.name] = float(raw)
                if not values[f.name] > 0:
                    raise ValueError
            except ValueError:
                problems.append(f"{key}={raw!r}: must be a number of seconds > 0 (default {f.default})")
        if problems:
            raise ConfigError(problems, what="serving freshness settings")
        return cls(**values)


@dataclass(frozen=True)
class DatabaseFault:
    """A fault-injected outage (tests): while the file `down_while_exists` names exists, every SQL
    statement of the router's store fails as an unreachable server's would."""

    down_while_exists: str = ""


def _inject_faults(store) -> None:
    from raypai._faults import from_env

    fault = from_env(DatabaseFault, FAULTS_ENV)
    if not fault.down_while_exists:
        return
    from sqlalchemy import event
    from sqlalchemy.exc import OperationalError

    def refuse(conn, cursor, statement, params, context, executemany):
        if os.path.exists(fault.down_while_exists):
            cause = ConnectionRefusedError("connection to server at db.internal:5432 refused (fault injected)")
            raise OperationalError(statement, params, cause)

    event.listen(store.engine, "before_cursor_execute", refuse)


def _replica():
    """The Router instance serving this request (Serve's replica context holds it)."""
    return serve.get_replica_context().servable_object


app = FastAPI(title="raypai OpenAI-compatible API", version="1")
install(app)
app.add_middleware(RequestGuard, owner=_replica)  # token and size from the headers, before the body is read
VERSION_HEADER = "x-raypai-model-version"


async def _awaited(response):
    """A DeploymentResponse as a coroutine (asyncio.wait_for wants one)."""
    return await response


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


async def _chain(first, rest, deadline: float, timeout_s: float):
    """`first`, then the rest of a replica's stream until `deadline` (monotonic). When the stream ends
    early (the client left: Serve cancels this; the deadline) the replica's call is cancelled, which
    takes its row out of the engine."""
    done = False
    try:
        yield first
        while True:
            try:
                item = await asyncio.wait_for(rest.__anext__(), max(deadline - time.monotonic(), 0.001))
            except StopAsyncIteration:
                done = True
                return
            except TimeoutError:
                raise APIError(504, _timeout_message(timeout_s), code="timeout") from None
            yield item
    finally:
        if not done:
            rest.cancel()


def _timeout_message(timeout_s: float) -> str:
    return (
        f"the model did not finish within {timeout_s:g} s (the deployment's request_timeout_s); "
        "ask for fewer max_tokens, or retry"
    )


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
    try:
        async for item in gen:
            if isinstance(item, GenResult):
                yield event({"delta": {}} if chat else {"text": ""}, item.finish_reason, usage=usage(item))
            else:
                yield event({"delta": {"content": item}} if chat else {"text": item})
    except APIError as exc:  # headers are sent: the error is the stream's last event (OpenAI's shape)
        rejected(exc.code or str(exc.status_code))
        yield f"data: {json.dumps(error_body(exc.status_code, str(exc.detail), exc.code))}\n\n"
    except Exception as exc:  # noqa: BLE001 - a replica's failure mid-stream: generic text, details logged
        ref = uuid.uuid4().hex[:12]
        rejected("internal_error")
        log.error("stream failed [%s]", ref, exc_info=exc)
        yield f"data: {json.dumps(internal_error_body(ref))}\n\n"
    yield "data: [DONE]\n\n"


@serve.deployment(
    ray_actor_options={"num_cpus": 0.25},
    max_ongoing_requests=256,
    # past this many requests waiting for a router replica, Serve's proxy answers 503 + Retry-After
    max_queued_requests=512,
    backpressure_config={"status_code": 503, "retry_after_s": 1},
)
@serve.ingress(app)
class Router:
    def __init__(self, database_url: str, limits: Limits = Limits(), freshness: Freshness = Freshness()):
        from raypai.store import MetadataStore

        self.limits, self.freshness = limits, freshness
        self.in_flight = InFlight()  # requests in flight per token (RequestGuard counts them)

        self.store = MetadataStore(database_url, migrate_schema=False)
        _inject_faults(self.store)
        self.rng = random.Random()
        self.table: dict[str, DeploymentSpec] | None = None  # the last good routing table
        self.refreshing = asyncio.Lock()
        self.refresher: asyncio.Task | None = None
        self.wake = asyncio.Event()  # set: re-read the table now (a canary was rolled back here)
        self.auth = auth.TokenCheck(self.store, ttl_s=freshness.token_ttl_s, max_backoff_s=freshness.max_backoff_s)
        self.windows = Windows()  # answered requests per (deployment, version): the canary verdicts' input
        self.judged: dict[str, tuple[float, tuple]] = {}  # deployment -> (when, what was last recorded)
        self.judging: set[asyncio.Task] = set()

    async def _routes(self) -> dict[str, DeploymentSpec]:
        """The routing table: the last one read from the store. A background task re-reads it every
        `routes_refresh_s` (desired state changes through the deploy API) and keeps the last good one
        while the database fails; only before the first good read does a request wait on the database
        (503 while it fails). Reads run in a worker thread: a slow database must not stall the event
        loop that every request of this replica shares."""
        if self.refresher is None:
            self.refresher = asyncio.ensure_future(self._refresh_forever())
        if self.table is None:
            try:
                await self._refresh()
            except Exception:  # noqa: BLE001 - logged by _refresh; the caller may retry
                raise APIError(
                    503,
                    "the routing table is not available yet (the metadata database is unavailable); retry shortly",
                    code="routes_unavailable",
                    headers={"retry-after": "5"},
                ) from None
        return self.table

    async def _refresh(self) -> None:
        async with self.refreshing:  # one read at a time
            try:
                deployments = await asyncio.to_thread(self.store.list_deployments)
            except Exception as exc:
                log.warning("routing table refresh failed (keeping the last good table): %s", exc)
                raise
            self.table = {d.name: d.spec for d in deployments if d.state != "deleted"}

    async def _refresh_forever(self) -> None:
        failures = 0
        while True:
            delay = self.freshness.routes_refresh_s
            if failures:  # back off while the database fails: 2, 4, 8... refresh periods, at most max_backoff_s
                delay = min(delay * 2**failures, self.freshness.max_backoff_s)
            try:
                await asyncio.wait_for(self.wake.wait(), delay)
            except TimeoutError:
                pass
            self.wake.clear()
            try:
                await self._refresh()
                failures = 0
            except Exception:  # noqa: BLE001 - logged; the last good table stays
                failures += 1

    async def _resolve(self, name: str, fresh: bool = False):
        routes = await self._routes()
        spec = routes.get(name)
        if spec is None:
            known = ", ".join(sorted(routes)) or "none"
            raise APIError(
                404, f"model {name!r} does not exist (deployed models: {known})", code="model_not_found", param="model"
            )
        version = pick_version(spec, self.rng)
        try:
            handle = serve.get_app_handle(app_name(name, version))
        except RayServeException:
            # deleted since the table was read (a rollback or promotion removes the old version's
            # application right after writing the new table): read the table again, once
            if fresh:
                raise APIError(
                    503,
                    f"model {name!r} is changing version; retry shortly",
                    code="replica_unavailable",
                    headers={"retry-after": "1"},
                ) from None
            try:
                await self._refresh()
            except Exception:  # noqa: BLE001 - logged by _refresh
                pass
            return await self._resolve(name, fresh=True)
        return handle, f"{spec.model}/{version}", version, spec

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
        costs one retry on another replica of the same version, then a 503 with Retry-After; a version
        whose queue is full (the spec's max_queued_requests) answers 503 + Retry-After at once."""
        handle, served, version, spec = await self._resolve(body.model)
        t0, ok, cancelled = time.perf_counter(), False, False
        try:
            for attempt in (1, 2):
                try:
                    response = await self._respond(handle, served, body, chat, spec.request_timeout_s)
                    ok = True
                    return response
                except BackPressureError:
                    raise APIError(
                        503,
                        f"model {served} is at capacity ({spec.max_queued_requests} requests already wait: the "
                        "deployment's max_queued_requests); retry shortly",
                        code="overloaded",
                        headers={"retry-after": "1"},
                    ) from None
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
        except asyncio.CancelledError:
            cancelled = True  # the client left: neither a success nor the version's error
            raise
        finally:
            if not cancelled:
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
        stats = {"stable": stable, "canary": canary, "policy": policy.to_dict()}
        try:
            if decision == "worse" and policy.auto_rollback:
                done = await asyncio.to_thread(self.store.rollback_canary, name, spec.canary_version, reason)
                if done:
                    action = "rolled_back"
                    self.wake.set()  # re-read the routing table now
            await asyncio.to_thread(
                self.store.record_canary_check, name, spec.version, spec.canary_version, decision, reason, stats, action
            )
        except SQLAlchemyError as exc:  # the database is down: judge (and record) again after the next answer
            self.judged[name] = (self.judged[name][0], None)
            log.warning("canary verdict for %s not recorded (database unavailable): %s", name, exc)

    async def _respond(self, handle, served: str, body, chat: bool, timeout_s: float):
        """One call to a model-server replica, which tokenizes, checks the context window and generates.
        The call is cancelled when this request is (the client disconnected) or after `timeout_s`
        (the spec's request_timeout_s: 504), so the replica drops its engine row at once."""
        req = GenRequest([], body.max_tokens, body.temperature, body.top_p, body.stops(), body.seed, body.stream)
        text = {"messages": [m.model_dump() for m in body.messages]} if chat else {"prompt": body.prompt}
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        headers = {VERSION_HEADER: served}
        deadline = time.monotonic() + timeout_s
        call = None
        try:
            if body.stream:
                call = gen = handle.options(stream=True).stream.remote(req, **text)
                first = await asyncio.wait_for(gen.__anext__(), timeout_s)  # a bad prompt fails before any header
                call = None  # from here the stream's own wrapper cancels it
                return StreamingResponse(
                    _sse(_chain(first, gen, deadline, timeout_s), rid, body.model, served, chat),
                    media_type="text/event-stream",
                    headers=headers,
                )
            call = handle.generate.remote(req, **text)
            res: GenResult = await asyncio.wait_for(_awaited(call), timeout_s)
            call = None
        except PromptError as exc:
            cause = getattr(exc, "cause", None) or exc  # Ray wraps it; the original carries the message
            raise APIError(400, str(cause), code=cause.code, param=cause.param) from None
        except TimeoutError:
            raise APIError(504, _timeout_message(timeout_s), code="timeout") from None
        finally:
            if call is not None:  # cancelled (the client left), timed out or failed: free the replica's row
                call.cancel()
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
