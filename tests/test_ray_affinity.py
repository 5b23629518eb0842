"""The pure parts of `llamarunner.ray`: routing keys, the prefix table, the affinity policy,
the replica's gauge parsing, and the `cluster` command's flags (no Ray cluster started)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

try:
    import ray
except ImportError:
    if os.environ.get("LLAMARUNNER_TESTS_REQUIRE_RAY", "") not in ("", "0"):
        raise
    pytest.skip("Ray Serve is not installed (pip install '.[ray]')", allow_module_level=True)

from llamarunner.arguments import SERVE_ACTIONS, SOURCE_FLAGS
from llamarunner.cli import build_parser
from llamarunner.ray.affinity import (
    MAX_KEY_CHARS,
    AffinityPolicy,
    InFlight,
    PrefixTable,
    choose,
    common_prefix_len,
    routing_key,
)
from llamarunner.ray.replica import forwardable, parse_gauges


def key(path: str, body: object) -> str | None:
    return routing_key(path, json.dumps(body).encode())


def test_a_conversations_next_turn_extends_its_key() -> None:
    turn1 = [{"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    for path in ("/completion", "/v1/chat/completions", "/api/chat"):
        k1, k2 = key(path, {"messages": turn1}), key(path, {"messages": turn2})
        assert k1 and k2 and k2.startswith(k1) and k2 != k1


def test_keys_of_prompts_tokens_parts_and_embeddings() -> None:
    assert key("/completion", {"prompt": "abc"}) == "abc"
    # A token prefix is a key prefix.
    short, long = key("/completion", {"prompt": [1, 2]}), key("/completion", {"prompt": [1, 2, 3]})
    assert short and long and long.startswith(short)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    assert key("/v1/chat/completions", parts) == key(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}
    )
    assert key("/api/generate", {"system": "be brief", "prompt": "q"}) == (
        "system\x1fbe brief\x1eq"
    )
    assert key("/v1/embeddings", {"input": "text"}) == "text"
    assert key("/embedding", {"content": "text"}) == "text"


def test_the_model_named_leads_the_key() -> None:
    # Replicas that serve many models: one model's cached prefix is no use to another's.
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    a = key("/v1/chat/completions", {"model": "a", **chat})
    b = key("/v1/chat/completions", {"model": "b", **chat})
    assert a == "model\x1fa\x1euser\x1fhi\x1e" and b == "model\x1fb\x1euser\x1fhi\x1e"
    more = {"model": "a", "messages": [*chat["messages"], {"role": "assistant", "content": "yo"}]}
    assert (key("/v1/chat/completions", more) or "").startswith(a)
    # A model and no prompt is no key; a name that is not a string is left out.
    assert key("/api/generate", {"model": "a"}) is None
    assert key("/api/generate", {"model": "a", "prompt": ""}) is None
    assert key("/completion", {"model": 5, "prompt": "abc"}) == "abc"


@pytest.mark.parametrize(
    "body", [b"", b"not json", b"[1, 2]", b'"s"', b"{}", b'{"prompt": null}', b"\xff\xfe"]
)
def test_bodies_without_a_prompt_have_no_key(body: bytes) -> None:
    assert routing_key("/completion", body) is None


def test_hostile_values_do_not_raise() -> None:
    weird = {"messages": [None, 5, {"role": {"x": 1}, "content": {"content": [1, "a", None]}}]}
    assert isinstance(routing_key("/api/chat", json.dumps(weird).encode()), (str, type(None)))
    deep: object = "x"
    for _ in range(20):
        deep = [deep]
    assert key("/completion", {"prompt": deep}) == "x"
    for _ in range(30):  # past 32 levels: no key (no prompt is shaped so)
        deep = [deep]
    assert key("/completion", {"prompt": deep}) is None


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


# No deadline: these run right after test_ray's cluster goes down, on a loaded machine.
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["/completion", "/v1/chat/completions", "/api/generate", "/v1/embeddings"]),
    st.dictionaries(
        st.sampled_from(["model", "prompt", "messages", "system", "input", "content"]),
        JSON | st.text(min_size=300, max_size=400),
    ),
)
def test_generated_bodies_give_a_bounded_key_led_by_a_string_model(
    path: str, body: dict[str, object]
) -> None:
    k = routing_key(path, json.dumps(body).encode())
    assert k is None or (0 < len(k) <= MAX_KEY_CHARS)
    model = body.get("model")
    if k is not None and isinstance(model, str) and model:
        assert k.startswith("model\x1f" + model[:256] + "\x1e")


def test_deep_or_huge_bodies_give_a_bounded_key_or_none() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    assert routing_key("/completion", b'{"prompt": ' + deep + b"}") is None
    huge = key("/completion", {"prompt": "a" * 1_000_000})
    assert huge == "a" * MAX_KEY_CHARS
    many = key("/completion", {"prompt": list(range(1_000_000))})
    assert many is not None and len(many) == MAX_KEY_CHARS


def test_common_prefix_len() -> None:
    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(12)))
        b = "".join(rng.choice("ab") for _ in range(rng.randrange(12)))
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        assert common_prefix_len(a, b) == n


def test_the_table_keeps_one_key_per_conversation_and_a_bounded_lru() -> None:
    t = PrefixTable(max_per_replica=3)
    t.insert("A", "conv1 t1")
    t.insert("A", "conv1 t1 t2")  # replaces its prefix
    assert t.size("A") == 1
    assert t.best_match("conv1 t1 t2 t3", ["A", "B"]) == ("A", len("conv1 t1 t2"), True)
    for k in ("x", "y", "z"):
        t.insert("A", k)
    assert t.size("A") == 3
    assert t.best_match("conv1 t1 t2 t3", ["A"]) == (None, 0, False)  # evicted (LRU)
    t.remove("A")
    assert t.replicas() == []


def test_policy_follows_the_prefix_unless_its_replica_is_much_busier() -> None:
    t = PrefixTable()
    policy = AffinityPolicy(max_queue_imbalance=2)
    t.insert("A", "system prompt. question one")
    k = "system prompt. question one, answer, question two"
    assert choose(k, ["A", "B"], {"A": 2, "B": 0}, t, policy)[0] == ["A"]
    # More than 2 beyond the least loaded: power of two choices (of two: the idler one).
    assert choose(k, ["A", "B"], {"A": 3, "B": 0}, t, policy)[0] == ["B"]
    # A key that shares too little: not affinity; the replica with fewer prefixes wins.
    assert choose("sys and more", ["A", "B"], {}, t, AffinityPolicy(min_match_ratio=0.5))[0] == [
        "B"
    ]
    # A large shared part (a system prompt) is affinity.
    assert choose("system prompt. other", ["A", "B"], {}, t, policy)[0] == ["A"]
    # Every candidate is ranked; a missing replica is never returned.
    ranks = choose(k, ["B"], {}, t, policy)
    assert ranks == [["B"]]
    assert choose(k, [], {}, t, policy) == []


def test_keyless_requests_spread_over_idle_replicas() -> None:
    t = PrefixTable()
    rng = random.Random(1)
    firsts = {choose(None, ["A", "B"], {}, t, AffinityPolicy(), rng)[0][0] for _ in range(50)}
    assert firsts == {"A", "B"}


def test_in_flight_counts_a_request_until_it_completes() -> None:
    f = InFlight(ttl_s=10)
    f.chosen("r1", "A", now=0)
    assert (f.count("A", 0), f.count("B", 0)) == (1, 0)
    f.routed("r1", "A", now=0.1)  # the acceptance of the same choice: still one
    assert f.count("A", 0.1) == 1
    f.completed("r1", "A")
    assert f.count("A", 0.2) == 0


def test_in_flight_a_completion_before_the_routing_callback_leaves_nothing() -> None:
    # Ray registers the done-callback before it awaits the replica's acceptance: a fast
    # request (GET /health) completes first. Counting it again would make its replica look
    # busy for good, and every keyless request would go to the other one.
    f = InFlight(ttl_s=10)
    f.chosen("r1", "A", now=0)
    f.completed("r1", "A")
    f.routed("r1", "A", now=0.1)
    assert f.count("A", 0.1) == 0


def test_in_flight_follows_a_refused_request_to_its_next_replica() -> None:
    f = InFlight(ttl_s=10)
    f.chosen("r1", "A", now=0)
    f.routed("r1", "B", now=0.1)  # Ray sent it to the next rank
    assert (f.count("A", 0.1), f.count("B", 0.1)) == (0, 1)
    f.completed("r1", "B")
    # Refused by A (its cancelled try completes), then chosen again for B.
    f.chosen("r2", "A", now=1)
    f.completed("r2", "A")
    f.chosen("r2", "B", now=1.1)
    f.routed("r2", "B", now=1.2)
    assert (f.count("A", 1.2), f.count("B", 1.2)) == (0, 1)
    # A late callback of the refused try does not drop the retry's count.
    f.completed("r2", "A")
    assert f.count("B", 1.3) == 1


def test_in_flight_counts_expire_and_dead_replicas_are_forgotten() -> None:
    f = InFlight(ttl_s=10)
    f.chosen("never-sent", "A", now=0)
    f.chosen("r2", "A", now=5)
    assert f.count("A", 9) == 2
    assert f.count("A", 10) == 1  # the first one's completion never came
    assert f.count("A", 15) == 0
    f.chosen("r3", "A", now=20)
    f.chosen("r4", "B", now=20)
    f.retain({"B"})
    assert (f.count("A", 20), f.count("B", 20)) == (0, 1)
    f.forget("B")
    assert f.count("B", 20) == 0


# No deadline: these run right after test_ray's cluster goes down, on a loaded machine.
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["chosen", "routed", "completed"]),
            st.integers(0, 5),
            st.sampled_from("AB"),
        ),
        max_size=60,
    )
)
def test_in_flight_counts_stay_within_the_requests_and_end_at_zero(
    events: list[tuple[str, int, str]],
) -> None:
    f = InFlight(ttl_s=1e9)
    where: dict[str, str] = {}
    for n, (op, rid, name) in enumerate(events):
        if op == "completed":
            f.completed(f"r{rid}", name)
        else:
            getattr(f, op)(f"r{rid}", name, float(n))
        counts = [f.count(r, float(n)) for r in "AB"]
        assert all(c >= 0 for c in counts) and sum(counts) <= 6
        if op != "completed":
            where[f"r{rid}"] = name
    for rid, name in where.items():
        f.completed(rid, name)
    assert f.count("A", 0) == f.count("B", 0) == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_match_ratio": -0.1},
        {"min_match_ratio": 1.5},
        {"max_queue_imbalance": -1},
        {"max_prefixes_per_replica": 0},
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AffinityPolicy(**kwargs)  # type: ignore[arg-type]


def test_gauges_and_forwarded_headers() -> None:
    page = "\n".join(
        [
            "# HELP llamarunner:requests_running x",
            'llamarunner:requests_running{model_name="m"} 3',
            'llamarunner:requests_waiting{model_name="m"} 7',
            'llamarunner:kv_cache_usage_perc{model_name="m"} 0.25',
            'llamarunner:prompt_tokens_total{model_name="m"} 99',
            "llamarunner:slots_total garbage",
        ]
    )
    assert parse_gauges(page) == {
        "requests_running": 3.0,
        "requests_waiting": 7.0,
        "kv_cache_usage_perc": 0.25,
    }
    headers = [("Host", "x"), ("Connection", "close"), ("Authorization", "Bearer k"), ("TE", "t")]
    headers.append(("Expect", "100-continue"))
    assert forwardable(headers) == [("Authorization", "Bearer k")]


def test_cluster_takes_every_serve_flag() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    choices = sub.choices  # type: ignore[attr-defined]
    # Every setting of serve's; not its flags that do something else (--list-devices), nor
    # those of where a model comes from (-hf, --offline: each replica resolves a model name
    # on its own node, from its own caches).
    serve_flags = {
        o
        for a in choices["serve"]._actions
        if a.dest not in (*SERVE_ACTIONS, *SOURCE_FLAGS)
        for o in a.option_strings
    }
    cluster_flags = {o for a in choices["cluster"]._actions for o in a.option_strings}
    assert serve_flags <= cluster_flags  # the many-model flags too: each replica's router's
    assert {"--replicas", "--address", "--min-replicas", "--max-replicas"} <= cluster_flags
    args = parser.parse_args(
        ["cluster", "m.gguf", "--replicas", "3", "--parallel", "2", "--ctx-size", "1024"]
    )
    assert (args.model, args.replicas, args.parallel, args.ctx_size) == (["m.gguf"], 3, 2, 1024)
    args = parser.parse_args(["cluster", "--models-dir", "d", "--models-max", "2"])
    assert (args.model, args.models_dir, args.models_max) == ([], "d", 2)


def test_cluster_refuses_bad_many_model_flags_before_starting_ray(tmp_path: Path) -> None:
    from llamarunner.ray.cluster import run_cluster

    parser = build_parser()
    empty = tmp_path / "empty"
    empty.mkdir()
    for argv in (
        ["cluster", "m.gguf", "--models-max", "2"],  # router flags need many models
        ["cluster", "--models-dir", str(empty)],  # no model in it
        ["cluster", "--models-dir", str(tmp_path / "missing")],
        ["cluster", "a.gguf", "--models-dir", str(empty), "--keep-alive", "soon"],
        ["cluster", "a.gguf", "b.gguf", "--alias", "one"],  # --alias names one model
        ["cluster", "a.gguf", "b.gguf", "--models-memory", "-5"],
    ):
        assert run_cluster(parser.parse_args(argv)) == 2, argv
    assert not ray.is_initialized()


DOCS = Path(__file__).resolve().parent.parent / "docs" / "k8s"


def test_the_inference_pool_manifest_parses_and_runs_serve() -> None:
    import yaml

    docs = list(yaml.safe_load_all((DOCS / "inference-pool.yaml").read_text()))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Deployment", "InferencePool", "ConfigMap", "HTTPRoute"]
    deployment, pool = docs[0], docs[1]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["llamarunner"]
    args = build_parser().parse_args(container["args"])  # exits on an unknown flag
    assert args.command == "serve" and args.port == container["ports"][0]["containerPort"]
    assert pool["spec"]["targetPorts"] == [{"number": args.port}]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"] == labels
    epp_args = docs[2]["data"]["args"]
    for metric in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        assert f"=llamarunner:{metric}" in epp_args


def test_the_rayservice_manifest_builds_the_app() -> None:
    import yaml

    from llamarunner.ray import app_builder

    (service,) = yaml.safe_load_all((DOCS / "rayservice.yaml").read_text())
    assert service["kind"] == "RayService"
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    assert app["import_path"] == "llamarunner.ray:app_builder"
    assert app_builder(dict(app["args"])) is not None  # bad keywords raise


def replica_deployment(app: object) -> Any:
    ingress = app._bound_deployment  # type: ignore[attr-defined]
    return ingress.init_args[0]._bound_deployment


def test_build_app_passes_autoscaling_resources_and_router_through() -> None:
    from llamarunner.ray import build_app

    app = build_app(
        "m.gguf",
        replicas=2,
        min_replicas=1,
        max_replicas=4,
        parallel=3,
        threads=2,
        affinity={"max_queue_imbalance": 7},
    )
    rep = replica_deployment(app)
    config = rep._deployment_config
    auto = config.autoscaling_config
    assert (auto.min_replicas, auto.initial_replicas, auto.max_replicas) == (1, 2, 4)
    assert auto.target_ongoing_requests == 3
    assert config.max_ongoing_requests == 6
    assert rep.ray_actor_options["num_cpus"] == 2
    router = config.request_router_config
    assert router.request_router_class == "llamarunner.ray.router:PrefixAffinityRouter"
    assert router.request_router_kwargs["max_queue_imbalance"] == 7
    fixed = replica_deployment(build_app("m.gguf", replicas=3, routing="pow2"))
    assert fixed._deployment_config.num_replicas == 3
    assert "PowerOfTwo" in fixed._deployment_config.request_router_config.request_router_class
    gpu = replica_deployment(build_app("m.gguf", ray_actor_options={"num_gpus": 1}))
    assert gpu.ray_actor_options["num_gpus"] == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"replicas": 0},
        {"routing": "random"},
        {"parallel": 0},
        {"min_replicas": 3, "replicas": 2},
        {"max_replicas": 1, "replicas": 2},
        {"affinity": {"min_match_ratio": 2}},
        {"affinity": {"no_such": 1}},
        {"no_such_setting": 1},
    ],
)
def test_build_app_refuses_bad_settings(kwargs: dict[str, Any]) -> None:
    from llamarunner.ray import build_app

    with pytest.raises((ValueError, TypeError)):
        build_app("m.gguf", **kwargs)


class FakeConfig:
    def __init__(self, target: float) -> None:
        self.target = target

    def get_target_ongoing_requests(self) -> float:
        return self.target


class FakeContext:
    def __init__(self, metrics: dict[str, dict[str, float]], target: float, total: float) -> None:
        self.aggregated_metrics = metrics
        self.config = FakeConfig(target)
        self.total_num_requests = total
        self.policy_state: dict[str, Any] = {}


def test_the_autoscaling_policy_reads_the_gauges() -> None:
    from llamarunner.ray.autoscaling import gauge_policy

    def want(metrics: dict[str, dict[str, float]], target: float = 4, total: float = 0) -> int:
        return gauge_policy(FakeContext(metrics, target, total))[0]

    idle = {"requests_running": {"a": 0, "b": 0}, "requests_waiting": {"a": 0, "b": 0}}
    assert want(idle) == 1
    busy = {"requests_running": {"a": 4, "b": 4}, "requests_waiting": {"a": 6, "b": 0}}
    assert want(busy) == 4  # 14 requests at 4 per replica
    full = {**busy, "kv_cache_usage_perc": {"a": 0.95, "b": 0.97}}
    assert want(full) == 5
    # No gauges yet: Ray's own count of ongoing requests.
    assert want({}, target=2, total=7) == 4


def test_only_authenticated_requests_get_a_routing_key() -> None:
    """The ingress computes (and the router stores) a prefix key only for a request that
    carries one of the server's keys: an unauthenticated client leaves nothing behind."""
    from llamarunner.ray.ingress import key_digest, request_key

    body = json.dumps({"prompt": "a long shared prefix"}).encode()
    keys = [key_digest("k1"), key_digest("k2")]
    assert request_key("POST", "/completion", [], body, []) is not None  # no key needed
    assert request_key("GET", "/completion", [], body, []) is None
    for headers in (
        [(b"authorization", b"Bearer k2")],
        [(b"Authorization", b"  bearer   k1 ")],
        [(b"x-api-key", b"k1")],
        [(b"x-api-key", b"wrong"), (b"authorization", b"Bearer k1")],
    ):
        assert request_key("POST", "/completion", headers, body, keys) is not None, headers
    for headers in (
        [],
        [(b"authorization", b"Bearer wrong")],
        [(b"authorization", b"Basic k1")],
        [(b"authorization", b"Bearerk1")],
        [(b"x-api-key", b"")],
    ):
        assert request_key("POST", "/completion", headers, body, keys) is None, headers


def test_build_app_gives_the_ingress_key_digests_not_keys() -> None:
    from llamarunner.ray import build_app
    from llamarunner.ray.ingress import key_digest

    app = build_app("m.gguf", replicas=1, api_key=["secret"])
    ingress = app._bound_deployment  # type: ignore[attr-defined]
    assert ingress.init_args[2] == [key_digest("secret")]
    assert "secret" not in repr(ingress.init_args[1:])
