"""The ingress: the one HTTP endpoint of the application. It forwards every request, of any
dialect (native, OpenAI, Ollama; streaming or not), to a replica chosen by the request
router, and streams the replica's answer back unchanged. The replicas do all validation and
answer every error in their dialect's shape; the ingress only reads the body (at most
``max_body + 1`` bytes, so that a larger one still gets the replica's 413) and derives its
routing key, for requests that carry one of the server's API keys only (an unauthenticated
client gets the replica's 401 and leaves nothing in the router's prefix table).

A ``/v1/responses`` answer names the response its replica stored (`RESPONSE_ID_HEADER`); the
ingress remembers where (`ResponseHomes`) and pins a follow-up that names it as its
``previous_response_id`` (and ``GET``/``DELETE /v1/responses/{id}``) to that replica, as a
client's `REPLICA_HEADER` pins a request: no other replica holds the response.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from .affinity import RESPONSE_ID_HEADER, ResponseHomes, route
from .replica import REPLICA_HEADER, ProxyRequest


async def read_body(request: Request, limit: int) -> bytes:
    """The body, cut after ``limit + 1`` bytes (the replica refuses it as too large)."""
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            return bytes(buf[: limit + 1])
    return bytes(buf)


def key_digest(value: str | bytes) -> bytes:
    """The SHA-256 digest a key is compared by (the ingress holds digests, not keys)."""
    raw = value.encode("latin-1", errors="replace") if isinstance(value, str) else value
    return hashlib.sha256(raw).digest()


def authenticated(headers: Iterable[tuple[bytes, bytes]], key_digests: Sequence[bytes]) -> bool:
    """Whether the request carries one of the keys (their SHA-256 digests), as the server
    takes them: ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``. Every presented value is
    compared with every key in constant time. True when the server needs no key."""
    if not key_digests:
        return True
    presented = []
    for name, value in headers:
        name = name.lower()
        if name == b"authorization":
            v = value.strip()
            if len(v) > 6 and v[:6].lower() == b"bearer" and v[6:7].isspace():
                presented.append(v[6:].strip())
        elif name == b"x-api-key":
            presented.append(value.strip())
    ok = False
    for p in presented:
        d = key_digest(p)
        for k in key_digests:
            ok |= hmac.compare_digest(d, k)
    return ok


_RESPONSES = "/v1/responses/"


def request_route(
    method: str,
    path: str,
    headers: Iterable[tuple[bytes, bytes]],
    body: bytes,
    key_digests: Sequence[bytes],
) -> tuple[str | None, str | None]:
    """The routing key of a request (of POSTs), and the stored response it needs (a POST's
    ``previous_response_id``; the id of ``GET``/``DELETE /v1/responses/{id}``): of requests
    that carry a key (any when none is needed)."""
    if method not in ("POST", "GET", "DELETE") or not authenticated(headers, key_digests):
        return None, None
    if method != "POST":
        rest = path[len(_RESPONSES) :] if path.startswith(_RESPONSES) else ""
        return None, (rest if rest and "/" not in rest else None)
    return route(path, body)


def request_key(
    method: str,
    path: str,
    headers: Iterable[tuple[bytes, bytes]],
    body: bytes,
    key_digests: Sequence[bytes],
) -> str | None:
    """The routing key of a request: of POSTs that carry a key (any when none is needed)."""
    return request_route(method, path, headers, body, key_digests)[0]


def learn_home(homes: ResponseHomes, headers: Iterable[tuple[str, str]]) -> None:
    """Notes which replica stored the response an answer names (its `RESPONSE_ID_HEADER`)."""
    response_id = replica = None
    for name, value in headers:
        name = name.lower()
        if name == RESPONSE_ID_HEADER:
            response_id = value
        elif name == REPLICA_HEADER:
            replica = value
    if response_id and replica:
        homes.learn(response_id, replica)


class Ingress:
    """The HTTP ingress deployment class (`build_app` wraps it in ``serve.deployment``)."""

    def __init__(
        self, replicas: DeploymentHandle[Any], max_body: int, key_digests: Sequence[bytes] = ()
    ) -> None:
        self._replicas = replicas.options(stream=True, method_name="handle")
        self._max_body = max_body
        self._key_digests = list(key_digests)
        # Which replica stored which response (the router's pin for its follow-ups): the
        # ingress sees the answers, the router does not. Per ingress replica, as the router.
        self._homes = ResponseHomes()

    async def __call__(self, request: Request) -> Response:
        body = await read_body(request, self._max_body)
        # The path under the application's route prefix (Serve's root_path), as the client
        # sent it (not percent-decoded): the replica's path.
        raw = request.scope.get("raw_path") or request.scope.get("path", "/").encode()
        path = raw.decode("latin-1")
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        query = request.scope.get("query_string", b"").decode("latin-1")
        target = path + ("?" + query if query else "")
        key, response_id = request_route(
            request.method, path, request.headers.raw, body, self._key_digests
        )
        req = ProxyRequest(
            method=request.method,
            path=target,
            headers=[(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw],
            body=body,
            routing_key=key,
            replica=request.headers.get(REPLICA_HEADER) or self._homes.home(response_id),
        )
        stream: Any = self._replicas.remote(req)
        try:
            status, headers = await stream.__anext__()
        except BaseException:
            stream.cancel()
            raise
        learn_home(self._homes, headers)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                # The client left (or the answer ended): stop the replica's side too.
                stream.cancel()

        response = StreamingResponse(relay(), status_code=status)
        response.raw_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers
        ]
        return response
