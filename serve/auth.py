"""API keys: `Authorization: Bearer <key>` on /v1/*, vLLM's convention.

`ApiKeys` holds the accepted keys (several may be given, comma-separated); `AuthMiddleware`
(plain ASGI, so streaming and disconnect detection are untouched) answers 401 in the OpenAI
error shape for a /v1/* request without a valid key and puts the caller's client id in the
request state (`request.state.client`). The OpenAPI schema and its pages (/openapi.json,
/docs, /redoc) need a key too, since they list every route and field; /health and /metrics
stay open. An empty key (`--api-key ""`, a blank between commas) is refused at start-up: it
would leave the server open while it looks guarded. The client id is
`key-` + the first 12 hex digits of sha256(key): traffic records carry it, never the key.
"""

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable

from specdistill.errors import UserError
from specdistill.serve.errors import error_body

PROTECTED = ("/v1/", "/openapi.json", "/docs", "/redoc")  # path prefixes that need a key


def client_id(key: str) -> str:
    """The id a key's requests are recorded under: `key-<sha256(key)[:12]>`."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def parse_keys(value: str | Iterable[str] | None, source: str = "--api-key") -> list[str]:
    """Keys from a comma-separated string or a list, stripped; None: no keys. A blank key
    (an empty value, or nothing between two commas) is a `UserError` naming `source`."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    keys = [k.strip() for k in items]
    if not keys or not all(keys):
        raise UserError(
            f"{source}: an empty API key (an empty value, or a blank between commas) would "
            "leave the server open; give non-empty keys, comma-separated"
        )
    return keys


class ApiKeys:
    def __init__(self, keys: Iterable[str]):
        self.keys = [(hashlib.sha256(k.encode()).digest(), client_id(k)) for k in keys]

    def __bool__(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> str | None:
        """The client id of a valid `Bearer <key>` header, else None. Every key is compared
        (in constant time, on digests) whatever matches, so timing tells nothing."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = hashlib.sha256(authorization[len("Bearer ") :].strip().encode()).digest()
        found = None
        for digest, cid in self.keys:
            if hmac.compare_digest(given, digest):
                found = cid
        return found


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, keys: ApiKeys, insecure: bool) -> None:
    """Refuse to listen beyond loopback without an API key unless told `insecure`."""
    if not keys and not insecure and not is_loopback(host):
        raise UserError(
            f"refusing to serve on {host} without an API key: anyone who reaches the port "
            "could use the model and write the traffic log; give --api-key (or "
            "SPECDISTILL_API_KEY), or --insecure to serve without one"
        )


class AuthMiddleware:
    """ASGI middleware: a /v1/* request needs a valid key when the server has keys."""

    def __init__(self, app, keys: ApiKeys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = None
        if self.keys and scope["path"].startswith(PROTECTED):
            header = None
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    header = value.decode("latin-1")
                    break
            client = self.keys.check(header)
            if client is None:
                await _reject(send)
                return
        scope.setdefault("state", {})["client"] = client
        await self.app(scope, receive, send)


async def _reject(send) -> None:
    message = "a valid API key is required: send the header 'Authorization: Bearer <key>'"
    body = error_body(401, message).model_dump_json().encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
