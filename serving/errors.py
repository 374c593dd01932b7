"""OpenAI-format errors: {"error": {"message", "type", "param", "code"}}, never a bare 500 for bad input.
A 500 says nothing of its cause (a traceback can name a host, a path, a database URL): the details go
to the server's log under the id the answer gives."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError

from raypai.errors import RaypaiError
from raypai.serving.metrics import rejected

log = logging.getLogger("ray.serve")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    422: "invalid_request_error",
    500: "api_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(HTTPException, RaypaiError):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(status, message, headers=headers)
        self.code, self.param = code, param


class PromptError(RaypaiError, ValueError):
    """A prompt this model cannot take; raised by the model server, answered 400 by the router.
    (Class attributes, not instance state, so they survive Ray's pickling of the exception.)"""

    code, param = "invalid_prompt", "prompt"


class ContextLengthExceeded(PromptError):
    code, param = "context_length_exceeded", "max_tokens"


class NoChatTemplate(PromptError):
    code, param = "no_chat_template", "messages"


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error"), "param": param, "code": code}}


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError):
        rejected("invalid_request")
        errs = exc.errors()
        first = errs[0] if errs else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        msgs = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errs[:5]
        )
        return JSONResponse(error_body(400, f"invalid request: {msgs}", "invalid_request", param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(_req: Request, exc: HTTPException):
        code = getattr(exc, "code", None)
        rejected(code or str(exc.status_code))
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail), code, getattr(exc, "param", None)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(DBAPIError)
    async def _database(_req: Request, exc: DBAPIError):
        # connection refused, fail-over, locked: the caller can only wait; the URL stays in the log
        ref = uuid.uuid4().hex[:12]
        rejected("database_unavailable")
        log.warning("metadata database error [%s]: %s", ref, exc)
        return JSONResponse(
            error_body(
                503,
                f"the metadata database is unavailable; retry shortly (reference {ref} in the server's log)",
                "database_unavailable",
            ),
            status_code=503,
            headers={"retry-after": "5"},
        )

    @app.exception_handler(Exception)
    async def _internal(_req: Request, exc: Exception):
        ref = uuid.uuid4().hex[:12]
        rejected("internal_error")
        log.error("internal error [%s]", ref, exc_info=exc)
        return JSONResponse(internal_error_body(ref), status_code=500)


def internal_error_body(ref: str) -> dict:
    return error_body(500, f"internal error (reference {ref} in the server's log)", "internal_error")
