"""What a client may send to the OpenAI-compatible router, checked as early as Serve allows.

Ray Serve 2.60 streams a request's body eagerly: the HTTP proxy reads it from the socket into an
unbounded queue while the request lives, and the replica pulls that queue in a background task
whether or not the app calls `receive()`. Neither stops until the app answers. Two guards:

- RequestGuard, in the router replica (always on): a missing or invalid token, a too-large
  `Content-Length`, or a key past its concurrency, is answered from the headers alone, before the
  FastAPI app (which parses the JSON) runs: the body stops flowing milliseconds after it starts. A
  body without `Content-Length` (chunked) is counted as the app reads it and refused past the cap,
  but what the proxy and the replica pulled meanwhile is already in their memory.
- ProxyGuard, in Serve's HTTP proxy, the first process that receives a request (on when the Ray nodes
  start with RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=raypai.serving.limits.proxy_middlewares,
  Serve's only proxy hook since `http_options.middlewares` was removed): a missing token or a
  too-large `Content-Length` never leaves the proxy, and a chunked body is cut at the cap before it
  enters the proxy's queue. It has no database: an invalid token is the router's to refuse.

The per-field limits are checked after parsing (the body is already bounded by then).

Settings (environment of the process that starts Serve, e.g. `raypai server`; the proxy reads
RAYPAI_SERVE_MAX_BODY_BYTES from its node's environment):
    RAYPAI_SERVE_MAX_BODY_BYTES=4194304 RAYPAI_SERVE_MAX_CONCURRENT_PER_KEY=64 raypai server
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from starlette.datastructures import Headers

from raypai.errors import ConfigError
from raypai.serving.auth import TokenCheck
from raypai.serving.errors import APIError, error_body
from raypai.serving.metrics import rejected


@dataclass(frozen=True)
class Limits:
    """One table of the router's limits and their defaults; `from_env` reads RAYPAI_SERVE_<FIELD>."""

    max_body_bytes: int = 4 * 2**20  # 4 MiB: ~1M characters of prompt, far above any context we serve
    max_prompt_chars: int = 100_000  # a completion's prompt, or all of a chat's message contents together
    max_stop: int = 4  # OpenAI's own limit on stop sequences
    max_stop_chars: int = 64
    max_user_chars: int = 256
    max_concurrent_per_key: int = 64  # requests in flight per token; the next gets 429 + Retry-After

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Limits:
        values, problems = {}, []
        for f in fields(cls):
            key = env_name(f.name)
            raw = env.get(key)
            if raw is None or raw == "":
                continue
            try:
                values[f.name] = int(raw)
                if values[f.name] < 1:
                    raise ValueError
            except ValueError:
                problems.append(f"{key}={raw!r}: must be a whole number >= 1 (default {f.default})")
        if problems:
            raise ConfigError(problems, what="serving limits")
        return cls(**values)


def env_name(field: str) -> str:
    return f"RAYPAI_SERVE_{field.upper()}"


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"request body is larger than the limit of {limit} bytes ({env_name('max_body_bytes')})",
        code="request_too_large",
    )


def check_fields(body, limits: Limits) -> None:
    """400 naming the limit for the first field past it. `body`: a parsed CompletionRequest or ChatRequest."""
    prompt_chars = len(body.prompt) if hasattr(body, "prompt") else sum(len(m.content) for m in body.messages)
    if prompt_chars > limits.max_prompt_chars:
        param = "prompt" if hasattr(body, "prompt") else "messages"
        raise _field_error(param, f"has {prompt_chars} characters", "max_prompt_chars", limits)
    stops = [] if body.stop is None else [body.stop] if isinstance(body.stop, str) else body.stop
    if len(stops) > limits.max_stop:
        raise _field_error("stop", f"has {len(stops)} sequences", "max_stop", limits)
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_chars:
        raise _field_error("stop", f"has a sequence of {longest} characters", "max_stop_chars", limits)
    if body.user is not None and len(body.user) > limits.max_user_chars:
        raise _field_error("user", f"has {len(body.user)} characters", "max_user_chars", limits)


def _field_error(param: str, got: str, limit: str, limits: Limits) -> APIError:
    value = getattr(limits, limit)
    return APIError(
        400, f"{param} {got}: the limit is {value} ({env_name(limit)})", code=f"{param}_too_long", param=param
    )


class InFlight:
    """Requests in flight per API key (the token's name)."""

    def __init__(self):
        self.count: dict[str, int] = {}

    def enter(self, key: str, limit: int) -> None:
        if self.count.get(key, 0) >= limit:
            raise APIError(
                429,
                f"token {key!r} already has {limit} requests in flight, the limit "
                f"({env_name('max_concurrent_per_key')}); retry when one finishes",
                code="too_many_concurrent_requests",
                headers={"retry-after": "1"},
            )
        self.count[key] = self.count.get(key, 0) + 1

    def leave(self, key: str) -> None:
        self.count[key] -= 1
        if not self.count[key]:
            del self.count[key]


class RequestGuard:
    """Pure ASGI middleware in front of the router's FastAPI app, for every `/v1/` request: the token
    (401/403), `Content-Length` against the cap (413) and the key's concurrency (429) are checked from
    the headers before anything calls `receive()`; then the body is counted as it is read (413 past the
    cap). `owner()` returns the object holding `auth` (a TokenCheck), `limits` and `in_flight`: the
    Router replica, resolved per request because the FastAPI app is built before the replica is."""

    def __init__(self, app, owner: Callable[[], object]):
        self.app, self.owner = app, owner

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        owner = self.owner()
        limits: Limits = owner.limits
        headers = Headers(scope=scope)
        try:
            _check_headers(headers, limits.max_body_bytes)  # a lookup only for a token worth one
            key = await owner.auth.check_header(headers.get("authorization", ""), "infer")
            owner.in_flight.enter(key, limits.max_concurrent_per_key)
        except APIError as exc:
            return await _answer(send, exc)
        try:
            await self.app(scope, _counted(receive, limits.max_body_bytes), send)
        finally:
            owner.in_flight.leave(key)


class ProxyGuard:
    """Pure ASGI middleware around Serve's HTTP proxy app, for every `/v1/` request: a missing token
    (401) or a `Content-Length` over the cap (413) is answered from the headers; a body past the cap
    is cut there: the proxy is told the client left (so it stops reading, cancels the replica's call
    and sends nothing), and the 413 is sent here unless the router already answered."""

    def __init__(self, app, max_body_bytes: int):
        self.app, self.cap = app, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        try:
            _check_headers(Headers(scope=scope), self.cap)
        except APIError as exc:
            return await _answer(send, exc)
        seen, over, started = 0, False, False

        async def counted():
            nonlocal seen, over
            message = {"type": "http.disconnect"} if over else await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.cap:
                    over, message = True, {"type": "http.disconnect"}
            return message

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted, tracked)
        if over and not started:
            await _answer(send, too_large(self.cap))


def proxy_middlewares() -> list:
    """Serve's proxy callback: RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=raypai.serving.limits.proxy_middlewares
    in the environment of every Ray node (`ray start`, the KubeRay pod spec) before Serve starts."""
    from starlette.middleware import Middleware

    return [Middleware(ProxyGuard, max_body_bytes=Limits.from_env(os.environ).max_body_bytes)]


def _check_headers(headers: Headers, cap: int) -> None:
    """A missing bearer token (401), then a declared size over `cap` (413), from the headers alone."""
    TokenCheck.token_of(headers.get("authorization", ""), "infer")
    size = headers.get("content-length")
    if size is not None and (not size.isdigit() or int(size) > cap):
        raise too_large(cap)


def _counted(receive, cap: int):
    """`receive` that raises 413 once the body passes `cap` bytes (FastAPI re-raises an HTTPException
    from reading the body, and the app's handler answers it)."""
    seen = 0

    async def counted():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > cap:
                raise too_large(cap)
        return message

    return counted


async def _answer(send, exc: APIError) -> None:
    rejected(exc.code or str(exc.status_code))
    body = json.dumps(error_body(exc.status_code, exc.detail, exc.code, exc.param)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (exc.headers or {}).items()]
    # the unread body is not wanted: closing lets the server stop reading the client's upload
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
