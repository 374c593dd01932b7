"""Bearer-token auth against hashed tokens in the metadata store: 401 missing/unknown/revoked, 403 wrong scope."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

from fastapi import Request
from sqlalchemy.exc import SQLAlchemyError

from raypai.serving.errors import APIError

SCOPES = ("deploy", "infer")
DEFAULT_TOKEN_TTL_S = 60.0  # the router's token cache lifetime: a revocation takes effect within it
log = logging.getLogger("ray.serve")


class TokenCheck:
    """Checks `Authorization: Bearer <token>` for a scope. Lookups are cached for `ttl_s` seconds (by
    the token's hash), so the hot path of every inference request is not a database round trip; a
    revoked token stops working within `ttl_s` of the database answering.

    While the database does not answer, a token looked up before keeps its last answer (a known token
    is served through an outage, an unknown one gets 503), and the database is asked again only after
    a back-off (1 s doubling to `max_backoff_s`), so an outage costs each request no failed round trip."""

    def __init__(self, store, ttl_s: float = DEFAULT_TOKEN_TTL_S, max_backoff_s: float = 30.0):
        self.store, self.ttl_s, self.max_backoff_s = store, ttl_s, max_backoff_s
        self.cache: dict[str, tuple[float, object]] = {}
        self.failures, self.down_until = 0, 0.0  # consecutive failed lookups; no lookup before then

    def __call__(self, request: Request, scope: str) -> str:
        """For synchronous handlers (FastAPI runs them in its thread pool). A database error propagates
        (the deploy API answers it 503 naming the database, raypai.serving.errors)."""
        token = self.token_of(request.headers.get("authorization", ""), scope)
        return self._verdict(self._lookup(token), scope)

    async def check(self, request: Request, scope: str) -> str:
        return await self.check_header(request.headers.get("authorization", ""), scope)

    async def check_header(self, header: str, scope: str) -> str:
        """The token's name, from an `Authorization` header value. For async code: a cache miss queries
        the database in a worker thread, so the event loop (every other request of this replica) does
        not wait on it; an unreachable database falls back to the last answer (see the class)."""
        token = self.token_of(header, scope)
        hit = self._cached(token)
        if hit is not None:
            return self._verdict(hit[0], scope)
        stale = self.cache.get(_key(token))
        if time.monotonic() < self.down_until:  # the database failed lately: do not wait on it again yet
            return self._verdict(self._fallback(stale), scope)
        try:
            rec = await asyncio.to_thread(self._lookup, token)
        except SQLAlchemyError as exc:
            self.failures += 1
            self.down_until = time.monotonic() + min(2 ** (self.failures - 1), self.max_backoff_s)
            log.warning("token lookup failed (database unavailable, %d in a row): %s", self.failures, exc)
            return self._verdict(self._fallback(stale), scope)
        self.failures, self.down_until = 0, 0.0
        return self._verdict(rec, scope)

    @staticmethod
    def _fallback(stale):
        """The last answer for a token while the database is down; 503 for a token never seen."""
        if stale is None:
            raise APIError(
                503,
                "cannot check this token now: the metadata database is unavailable; retry shortly",
                code="auth_unavailable",
                headers={"retry-after": "5"},
            )
        return stale[1]

    @staticmethod
    def token_of(header: str, scope: str) -> str:
        """The bearer token in an `Authorization` header value; 401 when there is none."""
        if not header.lower().startswith("bearer ") or not header[7:].strip():
            raise APIError(
                401,
                "missing bearer token: send 'Authorization: Bearer <token>' "
                f"(create one with `raypai token create NAME --scope {scope}`)",
                code="missing_token",
            )
        return header[7:].strip()

    @staticmethod
    def _verdict(rec, scope: str) -> str:
        if rec is None or rec.revoked:
            raise APIError(401, "invalid or revoked token", code="invalid_token")
        if scope not in rec.scopes:
            raise APIError(
                403, f"token {rec.name!r} lacks the {scope!r} scope (it has {rec.scopes})", code="wrong_scope"
            )
        return rec.name

    def _cached(self, token: str) -> tuple[object] | None:
        """(record,) when a fresh lookup of `token` is cached (the record may be None: unknown token)."""
        hit = self.cache.get(_key(token))
        if hit is not None and time.monotonic() - hit[0] < self.ttl_s:
            return (hit[1],)
        return None

    def _lookup(self, token: str):
        hit = self._cached(token)
        if hit is not None:
            return hit[0]
        rec = self.store.lookup_token(token)
        if len(self.cache) > 10_000:  # unknown tokens are cached too: bound the memory a scanner can take
            known = {k: v for k, v in self.cache.items() if v[1] is not None}  # keep the real ones (outages)
            self.cache = known if len(known) <= 10_000 else {}
        self.cache[_key(token)] = (time.monotonic(), rec)
        return rec


def _key(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
