"""Bearer-token auth against hashed tokens in the metadata store: 401 missing/unknown/revoked, 403 wrong scope."""

from __future__ import annotations

import asyncio
import hashlib
import time

from fastapi import Request

from raypai.serving.errors import APIError

SCOPES = ("deploy", "infer")


class TokenCheck:
    """Checks `Authorization: Bearer <token>` for a scope. Lookups are cached for `ttl_s` seconds (by
    the token's hash), so the hot path of every inference request is not a database round trip; a
    revoked token stops working within `ttl_s`."""

    def __init__(self, store, ttl_s: float = 5.0):
        self.store, self.ttl_s = store, ttl_s
        self.cache: dict[str, tuple[float, object]] = {}

    def __call__(self, request: Request, scope: str) -> str:
        """For synchronous handlers (FastAPI runs them in its thread pool)."""
        token = self.token_of(request.headers.get("authorization", ""), scope)
        return self._verdict(self._lookup(token), scope)

    async def check(self, request: Request, scope: str) -> str:
        return await self.check_header(request.headers.get("authorization", ""), scope)

    async def check_header(self, header: str, scope: str) -> str:
        """The token's name, from an `Authorization` header value. For async code: a cache miss queries
        the database in a worker thread, so the event loop (every other request of this replica) does
        not wait on it."""
        token = self.token_of(header, scope)
        hit = self._cached(token)
        rec = hit[0] if hit is not None else await asyncio.to_thread(self._lookup, token)
        return self._verdict(rec, scope)

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
        hit = self.cache.get(hashlib.sha256(token.encode()).hexdigest())
        if hit is not None and time.monotonic() - hit[0] < self.ttl_s:
            return (hit[1],)
        return None

    def _lookup(self, token: str):
        hit = self._cached(token)
        if hit is not None:
            return hit[0]
        key = hashlib.sha256(token.encode()).hexdigest()
        rec = self.store.lookup_token(token)
        if len(self.cache) > 10_000:  # unknown tokens are cached too: bound the memory a scanner can take
            self.cache.clear()
        self.cache[key] = (time.monotonic(), rec)
        return rec
