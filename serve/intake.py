"""Reading a request's body within bounds of size, time and memory, before it is admitted.

A request takes an admission slot (serve/app.py `AppState.admit`) only once its whole body
is here, so clients that send headers and then trickle (or stall) their bodies hold no slot
and cannot starve the others. What they can hold instead is bounded three ways:

- size: the declared Content-Length, then the bytes as they arrive (a chunked body without
  Content-Length is cut off at the cap), 413 past `max_body_bytes`;
- time: a body not complete within `timeout_s` (`--body-timeout-s`) is a 408;
- memory: the bytes of every body being read at once stay within `budget_bytes` (by default
  as much as the admitted requests may hold); a chunk beyond it is a 503 with Retry-After.
"""

import asyncio

from starlette.requests import ClientDisconnect

from specdistill.serve.errors import APIError


class BodyReader:
    """Reads request bodies: at most `max_body_bytes` each, within `timeout_s` seconds, and
    at most `budget_bytes` held by all reads together. Used on the event loop only."""

    def __init__(self, max_body_bytes: int, timeout_s: float, budget_bytes: int):
        self.max_body_bytes, self.timeout_s = max_body_bytes, timeout_s
        self.budget_bytes = budget_bytes
        self.held = 0  # bytes held by the reads in progress

    async def read(self, request) -> bytes:
        """The request's body, or an `APIError` (400, 408, 413, 503)."""
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._read(request)
        except TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {self.timeout_s:g} seconds",
                headers={"Connection": "close"},
            ) from None

    async def _read(self, request) -> bytes:
        cap = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise APIError(400, "Content-Length is not a number")
            if int(declared) > cap:
                raise APIError(413, too_large(int(declared), cap))
        chunks: list[bytes] = []
        total = 0
        try:
            async for chunk in request.stream():
                total += len(chunk)
                if total > cap:
                    raise APIError(413, too_large(total, cap, at_least=True))
                self._charge(len(chunk))
                chunks.append(chunk)
            return b"".join(chunks)
        except ClientDisconnect:
            raise APIError(499, "the client left before sending its whole body") from None
        finally:
            self.held -= sum(len(c) for c in chunks)

    def _charge(self, n: int) -> None:
        if self.held + n > self.budget_bytes:
            raise APIError(
                503,
                "the server is reading too many request bodies at once; retry later",
                headers={"Retry-After": "1"},
            )
        self.held += n


def too_large(size: int, cap: int, at_least: bool = False) -> str:
    more = "at least " if at_least else ""
    return f"the request body has {more}{size} bytes, more than this server accepts ({cap})"
