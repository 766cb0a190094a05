"""The Helm chart renders for each example values file, every document is valid Kubernetes, and the
rendered objects wire the parts together as docs/operations.md says (probes, ports, migrations,
engine discovery, the llm-d inference pool, services and monitors). Helpers: tests/helm/chart.py.
"""

from __future__ import annotations

import copy

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest

from tests.helm.chart import (
    CHART,
    EXAMPLES_NAMES,
    NAMESPACE,
    ROOT,
    Doc,
    container,
    engine_routes,
    env,
    example_values,
    find,
    merge_values,
    one,
    render,
    validate,
)


def test_every_example_renders_and_validates(example: tuple[str, list[Doc]]) -> None:
    name, docs = example
    assert docs, f"{name} rendered nothing"
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize("name", EXAMPLES_NAMES)
def test_helm_lint_finds_no_warnings(name: str) -> None:
    report = helm.lint(CHART, example_values(name), strict=True, namespace=NAMESPACE)
    assert not report["errors"]
    assert not [m for m in report["messages"] if m["severity"] >= 2], report["messages"]


def test_validators_reject_broken_documents(rendered: dict[str, list[Doc]]) -> None:
    """The checks above can fail: a misplaced field, a wrong type and an unknown CRD field are caught."""
    gateway = copy.deepcopy(one(rendered["production"], "Deployment", "gateway"))
    container(gateway)["readinessProbe"]["httpGet"]["paht"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(gateway)
    hpa = copy.deepcopy(one(rendered["production"], "HorizontalPodAutoscaler"))
    hpa["spec"]["minReplicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(hpa)
    pool = copy.deepcopy(one(rendered["llm-d"], "InferencePool"))
    del pool["spec"]["endpointPickerRef"]["port"]  # required when the picker is a Service
    with pytest.raises(jsonschema.ValidationError):
        validate(pool)
    objective = copy.deepcopy(one(rendered["llm-d"], "InferenceObjective"))
    objective["spec"]["poolRef"]["nmae"] = objective["spec"]["poolRef"].pop("name")
    with pytest.raises(jsonschema.ValidationError):
        validate(objective)
    monitor = copy.deepcopy(find(rendered["production"], "ServiceMonitor")[0])
    monitor["spec"]["endpoints"][0]["scrapeEvery"] = "30s"
    with pytest.raises(AssertionError, match="unknown fields"):
        validate(monitor)


def test_probes_point_at_the_real_endpoints(rendered: dict[str, list[Doc]]) -> None:
    from gateway.ops.router import router

    gateway_routes = {route.path for route in router.routes}
    gateway = container(one(rendered["production"], "Deployment", "gateway"))
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz", (
        "only replicas that can serve get traffic"
    )
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert gateway[probe]["httpGet"]["path"] in gateway_routes
        assert gateway[probe]["httpGet"]["port"] == "http"

    engine = container(one(rendered["production"], "StatefulSet", "engine"))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert engine[probe]["httpGet"]["path"] == "/health"
        assert engine[probe]["httpGet"]["path"] in engine_routes()
    # A model may take minutes to load: the startup probe covers engine.startupTimeoutSeconds.
    startup = engine["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_ports_match_the_images() -> None:
    """The chart's defaults are the ports the Dockerfile's images expose and their commands use."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    docs = render(example_values("trial"))
    gateway = container(one(docs, "Deployment", "gateway"))
    engine = container(one(docs, "StatefulSet", "engine"))
    assert "EXPOSE 8000" in dockerfile and gateway["ports"][0]["containerPort"] == 8000
    assert "EXPOSE 8100" in dockerfile and engine["ports"][0]["containerPort"] == 8100
    assert gateway["command"][:2] == ["tern", "gateway"] and "8000" in gateway["command"]
    assert engine["command"][:2] == ["tern", "engine"] and "8100" in engine["command"]


def test_migrations_run_before_new_gateways_with_an_external_database(rendered: dict[str, list[Doc]]) -> None:
    for name in ("production", "vllm"):
        job = one(rendered[name], "Job", "migrate")
        hooks = set(job["metadata"]["annotations"]["helm.sh/hook"].split(","))
        assert hooks == {"pre-install", "pre-upgrade"}
        assert container(job)["command"] == ["tern", "migrate"]
        url = env(job)["TERN_DATABASE_URL"]
        assert url["valueFrom"]["secretKeyRef"] == {"name": "tern-datastores", "key": "TERN_DATABASE_URL"}


def test_bundled_database_migrates_in_a_plain_job_per_revision(rendered: dict[str, list[Doc]]) -> None:
    """A pre-install hook would wait for a PostgreSQL that the install has not created yet."""
    job = one(rendered["trial"], "Job", "migrate")
    assert "helm.sh/hook" not in job["metadata"].get("annotations", {})
    assert job["metadata"]["name"] == "tern-migrate-1"
    assert container(job)["command"] == ["tern", "migrate"]
    assert "tern-postgresql:5432" in env(job)["TERN_DATABASE_URL"]["value"]


def test_tern_migrate_is_a_real_command() -> None:
    from tern_cli.main import build_parser

    args = build_parser().parse_args(["migrate"])
    assert args.revision == "head"


def test_vllm_example_starts_no_engine_and_fronts_vllm(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["vllm"]
    workloads = [doc for doc in docs if doc["kind"] in {"Deployment", "StatefulSet", "DaemonSet"}]
    assert [w["metadata"]["labels"]["app.kubernetes.io/component"] for w in workloads] == ["gateway"]
    assert not find(docs, "Service", "engine")
    variables = env(one(docs, "Deployment", "gateway"))
    assert variables["TERN_ENGINE_URLS"]["value"] == "openai+http://vllm.vllm.svc:8000"
    api_key = variables["TERN_ENGINE_API_KEY"]
    assert api_key["valueFrom"]["secretKeyRef"] == {"name": "vllm-api-key", "key": "api-key"}
    assert [m["metadata"]["name"] for m in find(docs, "ServiceMonitor")] == ["tern-gateway"]


def test_engines_are_found_through_their_headless_service(rendered: dict[str, list[Doc]]) -> None:
    """routing: tern: the gateway health-checks and prefix-routes per engine. By default it resolves the
    headless Service's name to the pods before every health round (gateway/proxy/engine_discovery.py),
    so scaling the StatefulSet needs no Helm upgrade; engine.discovery=static lists one URL per pod."""
    docs = rendered["production"]
    engine = one(docs, "StatefulSet", "engine")
    service = one(docs, "Service", "engine")
    assert (
        service["spec"]["clusterIP"] == "None"
        and engine["spec"]["serviceName"] == service["metadata"]["name"]
        and service["spec"]["publishNotReadyAddresses"]  # the gateway's own probe decides readiness
    )
    name, port = engine["metadata"]["name"], container(engine)["ports"][0]["containerPort"]
    urls = env(one(docs, "Deployment", "gateway"))["TERN_ENGINE_URLS"]["value"]
    assert urls == f"dns+http://{name}.{NAMESPACE}.svc:{port}"
    assert service["spec"]["ports"][0]["port"] == port

    static = render(merge_values(example_values("production"), {"engine": {"discovery": "static"}}))
    urls = env(one(static, "Deployment", "gateway"))["TERN_ENGINE_URLS"]["value"].split(",")
    expected = [f"http://{name}-{i}.{name}.{NAMESPACE}.svc:{port}" for i in range(engine["spec"]["replicas"])]
    assert urls == expected and len(urls) == 2


def test_the_gateway_reads_the_engine_urls_the_chart_writes(rendered: dict[str, list[Doc]]) -> None:
    """Each mode's TERN_ENGINE_URLS is one the gateway's settings accept, of the intended kind."""
    from gateway.config import Settings

    kinds = {}
    for name in ("production", "llm-d"):
        urls = env(one(rendered[name], "Deployment", "gateway"))["TERN_ENGINE_URLS"]["value"]
        kinds[name] = [(s.kind, s.discover) for s in Settings(engine_urls=urls).engine_specs()]
    assert kinds == {"production": [("tern", True)], "llm-d": [("openai", False)]}


def test_inference_pool_mode_pools_the_engines_for_llm_d(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["llm-d"]
    values = example_values("llm-d")
    engine = one(docs, "StatefulSet", "engine")
    pool = one(docs, "InferencePool")
    objective = one(docs, "InferenceObjective")
    route = one(docs, "HTTPRoute")
    pod_labels = engine["spec"]["template"]["metadata"]["labels"]
    # The pool selects exactly the engine pods, on their serving port, through the named picker.
    assert pool["spec"]["selector"]["matchLabels"] == engine["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": container(engine)["ports"][0]["containerPort"]}]
    assert pool["spec"]["endpointPickerRef"] == {
        "name": "tern-router-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    assert pod_labels["llm-d.ai/engine-type"] == "vllm"  # the picker reads vLLM's metric names
    assert pod_labels["llm-d.ai/inference-serving"] == "true"  # llm-d's KV-events pod discovery
    pool_name = pool["metadata"]["name"]
    pool_ref = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool_name}
    assert objective["spec"] == {"priority": 1, "poolRef": pool_ref}
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [pool_ref]
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"
    # KV events for the precise prefix scorer, on llm-d's default port, replay on the next one.
    command = container(engine)["command"]
    assert command[command.index("--kv-events-port") + 1] == "5557"
    ports = {p["name"]: p["containerPort"] for p in container(engine)["ports"]}
    assert ports == {"http": 8100, "kv-events": 5557, "kv-replay": 5558}
    gateway_urls = env(one(docs, "Deployment", "gateway"))["TERN_ENGINE_URLS"]["value"]
    assert gateway_urls == "openai+" + values["inferencePool"]["gatewayUrl"]


def test_services_select_their_pods(example: tuple[str, list[Doc]]) -> None:
    _, docs = example
    workloads = [doc for doc in docs if doc["kind"] in {"Deployment", "StatefulSet"}]
    for service in find(docs, "Service"):
        selector = service["spec"]["selector"].items()
        matches = [w for w in workloads if selector <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, service["metadata"]["name"]
        port_names = {p["name"] for p in container(matches[0])["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


def test_service_monitors_scrape_metrics_from_named_ports(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["production"]
    monitors = find(docs, "ServiceMonitor")
    assert {m["metadata"]["labels"]["app.kubernetes.io/component"] for m in monitors} == {"gateway", "engine"}
    services = find(docs, "Service")
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        selector = monitor["spec"]["selector"]["matchLabels"].items()
        [service] = [s for s in services if selector <= s["metadata"]["labels"].items()]
        endpoint = monitor["spec"]["endpoints"][0]
        assert endpoint["path"] == "/metrics"
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert not find(rendered["trial"], "ServiceMonitor"), "off unless switched on: the CRD may be absent"
