"""OpenAI-shaped errors for every status the server answers with.

Every error body is `{"error": {"message", "type", "param", "code"}}` (`code`: the HTTP
status). `install(app)` registers handlers so that FastAPI's and Starlette's own errors
(unknown path 404, wrong method 405, request validation 422) take that shape too, and a
catch-all turns any unexpected exception into a 500 of the same shape: the traceback goes to
the log, never to the client.
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdistill.serve.responses import ErrorBody, ErrorDetail, body

log = logging.getLogger("specdistill.serve")

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    499: "invalid_request_error",
    503: "server_overloaded",
}


class APIError(Exception):
    """An error answered to the client: status, one-line message, the field it concerns."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None) -> ErrorBody:
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ErrorBody(error=ErrorDetail(message=message, type=kind, param=param, code=status))


def error_response(
    status: int, message: str, param: str | None = None, headers: dict | None = None
) -> Response:
    return body(error_body(status, message, param), status, headers)


def install(app: FastAPI) -> None:
    """Register the handlers that give every error the OpenAI shape."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        elif e.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(e.detail)
        return error_response(e.status_code, message, None, getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return error_response(422, f"{param}: {first.get('msg', 'invalid request')}", param)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.error("%s %s: internal error", request.method, request.url.path, exc_info=e)
        return error_response(500, f"internal server error ({type(e).__name__})")
