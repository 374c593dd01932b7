"""OpenAI-format errors: {"error": {"message", "type", "param", "code"}}, never a bare 500 for bad input."""

from __future__ import annotations

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from raypai.errors import RaypaiError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    422: "invalid_request_error",
    503: "service_unavailable",
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
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail), code, getattr(exc, "param", None)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _internal(_req: Request, exc: Exception):
        return JSONResponse(
            error_body(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error"), status_code=500
        )
