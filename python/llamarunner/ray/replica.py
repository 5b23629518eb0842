"""The replica: one in-process llamarunner `Server` per Ray Serve replica, and the request
proxy to it.

The ingress hands each HTTP request over as a `ProxyRequest`; `LlamaReplica.handle` sends it
to the replica's own server on loopback and streams the answer back: first ``(status,
headers)``, then the body's bytes as the server writes them. Cancelling the call (the client
left) closes that connection, which the server takes as the client leaving: the request is
cancelled and its slot freed.

The replica's load for the router and the autoscaler is the server's own gauges (the same
as ``GET /metrics``): requests running, requests waiting, KV cache usage.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..config import ServerConfig
from ..server import Server

# Answer header naming the replica that served a request; a request carrying it is sent to
# that replica when it is still running (per-replica routes: /slots, /metrics, slot files).
REPLICA_HEADER = "x-llamarunner-replica"

# Not forwarded either way: connection-level headers (RFC 9110 7.6.1), Host (the replica's
# server is reached on loopback and checks that Host is a loopback one), and Expect (the
# ingress has read the body already).
HOP_BY_HOP = frozenset(
    {
        "expect",
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
        "content-length",
    }
)

# The gauges `/metrics` serves that the router and autoscaler read.
GAUGES = {
    "llamarunner:requests_running": "requests_running",
    "llamarunner:requests_waiting": "requests_waiting",
    "llamarunner:kv_cache_usage_perc": "kv_cache_usage_perc",
    "llamarunner:slots_total": "slots_total",
}


@dataclass
class ProxyRequest:
    """One HTTP request, as the ingress forwards it to a replica."""

    method: str
    path: str
    """Path and query string."""
    headers: list[tuple[str, str]]
    body: bytes
    routing_key: str | None = None
    """Text whose prefixes follow the prompt's (see `affinity.routing_key`); None: no prompt."""
    replica: str | None = field(default=None)
    """The replica this request must go to (the `REPLICA_HEADER` of the request), if any."""


def forwardable(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP]


def parse_gauges(text: str) -> dict[str, float]:
    """The `GAUGES` samples of a Prometheus text page, labels ignored: a router of many models
    has one sample per loaded model (its ``model_name``), summed, but for the KV cache usage,
    whose largest is taken (the fullest model's cache)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        short = GAUGES.get(name)
        if short is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if short == "kv_cache_usage_perc":
            out[short] = max(out.get(short, 0.0), value)
        else:
            out[short] = out.get(short, 0.0) + value
    return out


class LlamaReplica:
    """A Ray Serve replica serving one model with one llamarunner server, or many models
    with a router of them (``router``: `Server`'s many-models keywords) (the deployment
    class; `build_app` wraps it in ``serve.deployment``)."""

    def __init__(self, config: dict[str, Any], router: dict[str, Any] | None = None) -> None:
        # Always on loopback and a free port: only this replica's proxy talks to it.
        cfg = dataclasses.replace(ServerConfig(**config), host="127.0.0.1", port=0)
        self._server = Server(config=cfg, **(router or {})).start()
        self._server.wait_ready()
        self._key = self._server.config.first_api_key()
        self._http = httpx.AsyncClient(
            base_url=self._server.url,
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self.name = _replica_name()

    async def handle(self, req: ProxyRequest) -> AsyncIterator[Any]:
        """Streams the server's answer to ``req``: ``(status, headers)``, then body bytes."""
        if len(req.body) > self._server.config.max_body:
            status, headers, body = await self._refuse_oversize(req)
            yield (status, [*headers, (REPLICA_HEADER, self.name)])
            yield body
            return
        request = self._http.build_request(
            req.method, req.path, headers=forwardable(req.headers), content=req.body
        )
        response = await self._http.send(request, stream=True)
        try:
            headers = forwardable(list(response.headers.multi_items()))
            headers.append((REPLICA_HEADER, self.name))
            yield (response.status_code, headers)
            async for chunk in response.aiter_raw():
                yield chunk
        finally:
            # Closing a response that is not read to its end closes its connection: the
            # server cancels the request and frees its slot.
            await response.aclose()

    async def _refuse_oversize(self, req: ProxyRequest) -> tuple[int, list[tuple[str, str]], bytes]:
        """The server's 413 for a body over ``--max-body``, in the dialect of the path: the
        headers are sent with ``Expect: 100-continue`` and without the body, so the server
        answers at once (sending the body would end in a connection reset: it stops reading
        an oversize body)."""
        url = httpx.URL(self._server.url)
        reader, writer = await asyncio.open_connection(url.host, url.port)
        try:
            lines = [f"{req.method} {req.path} HTTP/1.1", f"Host: {url.host}:{url.port}"]
            lines += [f"{k}: {v}" for k, v in forwardable(req.headers)]
            lines += [f"Content-Length: {len(req.body)}", "Expect: 100-continue", "", ""]
            writer.write("\r\n".join(lines).encode("latin-1"))
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            status_line, *header_lines = head.decode("latin-1").split("\r\n")
            headers = [
                (k.strip(), v.strip()) for k, _, v in (h.partition(":") for h in header_lines if h)
            ]
            length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
            body = await asyncio.wait_for(reader.readexactly(length), 30)
            return int(status_line.split(" ")[1]), forwardable(headers), body
        finally:
            writer.close()

    async def load(self) -> dict[str, float]:
        """The server's gauges; from `/health` when metrics are off (then no queue depth)."""
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        if not self._server.config.no_metrics:
            try:
                r = await self._http.get("/metrics", headers=headers, timeout=5.0)
                if r.status_code == 200:
                    return parse_gauges(r.text)
            except httpx.HTTPError:
                pass
        h = self._server.health()
        return {"requests_running": float(h.slots_busy), "slots_total": float(h.slots_total)}

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve calls this every ``request_routing_stats_period_s``; the router reads
        the result as the replica's ``routing_stats``."""
        return await self.load()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metrics: the same gauges, for a custom policy."""
        return await self.load()

    async def check_health(self) -> None:
        """Raising makes Ray Serve replace this replica: the engine stopped or never loaded."""
        h = self._server.health()
        if h.status in ("error", "stopped"):
            raise RuntimeError(f"llamarunner server {h.status}: {h.error or ''}")

    def __del__(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.stop()


def _replica_name() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a Serve replica (unit tests)
        return "local"
