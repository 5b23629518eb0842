"""llamarunner on Ray Serve: many replicas of the runner behind one endpoint, with requests
routed to the replica whose KV cache holds their prefix (``pip install "llamarunner[ray]"``).

>>> from ray import serve  # doctest: +SKIP
>>> from llamarunner.ray import build_app  # doctest: +SKIP
>>> serve.run(build_app("model.gguf", replicas=2, parallel=2, threads=4))  # doctest: +SKIP

See docs/scaling.md; the command is ``llamarunner cluster``.
"""

from __future__ import annotations

try:
    import ray as _ray  # noqa: F401
    from ray import serve as _serve  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("llamarunner.ray needs Ray Serve: pip install 'llamarunner[ray]'") from e

from .affinity import AffinityPolicy, PrefixTable, ResponseHomes, route, routing_key
from .app import INGRESS_DEPLOYMENT, REPLICA_DEPLOYMENT, app_builder, build_app
from .ingress import Ingress
from .replica import REPLICA_HEADER, LlamaReplica, ProxyRequest
from .router import PrefixAffinityRouter

__all__ = [
    "INGRESS_DEPLOYMENT",
    "REPLICA_DEPLOYMENT",
    "REPLICA_HEADER",
    "AffinityPolicy",
    "Ingress",
    "LlamaReplica",
    "PrefixAffinityRouter",
    "PrefixTable",
    "ProxyRequest",
    "ResponseHomes",
    "app_builder",
    "build_app",
    "route",
    "routing_key",
]
