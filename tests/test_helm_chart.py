"""The Helm chart (deploy/helm/tern) renders for each example values file, every document is valid
Kubernetes, and the rendered objects say what docs/operations.md promises.

No cluster and no network: ``helm-python-sdk`` renders with Helm's own Go engine (linked into the
wheel, Helm v4), ``kubernetes-validate`` ships the Kubernetes JSON schemas, and the ServiceMonitor
CRD (not in those schemas) is checked against ``cloudcoil-models-prometheus-operator``'s models,
generated from the Prometheus Operator's CRDs. All are pinned in pyproject's ``test`` extra.
"""

from __future__ import annotations

import base64
import copy
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.inference_crds import SCHEMAS as INFERENCE_SCHEMAS

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "tern"
EXAMPLES = ROOT / "deploy" / "helm" / "examples"
RELEASE = "tern"
NAMESPACE = "tern"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.25.0", "1.37.0")
# What the trial's install command passes with --set (docs/operations.md).
TRIAL_SECRET = "trial-secret-0123456789abcdef0123456789abcdef"
INSTALL_SETS: dict[str, dict[str, Any]] = {"trial": {"secrets": {"ternSecret": TRIAL_SECRET}}}

Doc = dict[str, Any]


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def render(values: dict[str, Any] | None = None) -> list[Doc]:
    """``helm template``: each template's output parsed on its own, as Helm separates them."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def example_values(name: str) -> dict[str, Any]:
    values = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    return _merge(values, INSTALL_SETS.get(name, {}))


EXAMPLES_NAMES = ("trial", "production", "vllm", "llm-d")


@pytest.fixture(scope="module", params=EXAMPLES_NAMES)
def example(request: pytest.FixtureRequest) -> tuple[str, list[Doc]]:
    return request.param, render(example_values(request.param))


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    return {name: render(example_values(name)) for name in EXAMPLES_NAMES}


def find(docs: list[Doc], kind: str, component: str | None = None) -> list[Doc]:
    return [
        doc
        for doc in docs
        if doc["kind"] == kind
        and (component is None or doc["metadata"]["labels"].get("app.kubernetes.io/component") == component)
    ]


def one(docs: list[Doc], kind: str, component: str | None = None) -> Doc:
    found = find(docs, kind, component)
    assert len(found) == 1, f"expected one {kind} {component or ''}, got {len(found)}"
    return found[0]


def container(workload: Doc) -> Doc:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env(workload: Doc) -> dict[str, Doc]:
    return {var["name"]: var for var in container(workload).get("env", [])}


def validate_service_monitor(doc: Doc) -> None:
    """Types checked by the CRD-generated model; unknown fields caught by a lossless round trip
    (the models ignore fields they do not know, and the API server would too, silently)."""
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    model = ServiceMonitor.model_validate(doc)
    assert model.model_dump(mode="json", by_alias=True, exclude_none=True) == doc, "unknown fields"


def validate(doc: Doc) -> None:
    if doc["apiVersion"] == "monitoring.coreos.com/v1":
        validate_service_monitor(doc)
        return
    if (schema := INFERENCE_SCHEMAS.get((doc["apiVersion"], doc["kind"]))) is not None:
        jsonschema.validate(doc, schema)  # the GIE, llm-d and Gateway API CRDs (tests/inference_crds.py)
        return
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


# --- every document is valid --------------------------------------------------------------------


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


# --- what the documents say ---------------------------------------------------------------------


def _engine_routes() -> set[str]:
    """The engine's HTTP routes, read from its source (importing it would import torch)."""
    source = (ROOT / "engine" / "serving" / "server.py").read_text()
    return set(re.findall(r'@app\.get\("([^"]+)"\)', source))


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
        assert engine[probe]["httpGet"]["path"] in _engine_routes()
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


def test_existing_secrets_are_referenced_not_inlined(rendered: dict[str, list[Doc]]) -> None:
    for name in ("production", "vllm"):
        docs = rendered[name]
        assert not find(docs, "Secret"), "with existingSecret the chart creates no Secret"
        variables = env(one(docs, "Deployment", "gateway"))
        for variable, key in (("TERN_SECRET", "TERN_SECRET"), ("TERN_ADMIN_KEY", "TERN_ADMIN_KEY")):
            assert "value" not in variables[variable]
            assert variables[variable]["valueFrom"]["secretKeyRef"]["name"] == "tern-secrets"
            assert variables[variable]["valueFrom"]["secretKeyRef"]["key"] == key
        for variable in ("TERN_DATABASE_URL", "TERN_REDIS_URL"):
            assert variables[variable]["valueFrom"]["secretKeyRef"]["name"] == "tern-datastores"


def test_chart_made_secret_holds_the_value_and_pods_only_reference_it(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["trial"]
    secret = next(s for s in find(docs, "Secret") if s["metadata"]["name"] == "tern")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert base64.b64decode(secret["data"]["TERN_SECRET"]).decode() == TRIAL_SECRET
    workloads = [doc for doc in docs if doc["kind"] in {"Deployment", "StatefulSet", "Job"}]
    assert TRIAL_SECRET not in yaml.safe_dump(workloads)
    assert (
        env(one(docs, "Deployment", "gateway"))["TERN_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "tern"
    )


def test_tern_secret_is_required() -> None:
    """No silent random TERN_SECRET: a new one on an upgrade would invalidate every key."""
    with pytest.raises(helm.HelmRenderError, match=r"secrets\.ternSecret"):
        render(yaml.safe_load((EXAMPLES / "trial.yaml").read_text()))


def test_external_datastores_need_a_url() -> None:
    with pytest.raises(helm.HelmRenderError, match="externalDatabase"):
        render(_merge(example_values("trial"), {"postgresql": {"enabled": False}}))
    with pytest.raises(helm.HelmRenderError, match=r"gateway\.engineUrls"):
        render(_merge(example_values("trial"), {"engine": {"enabled": False}}))


def test_bundled_and_external_datastores(rendered: dict[str, list[Doc]]) -> None:
    trial = {
        s["metadata"]["labels"]["app.kubernetes.io/component"] for s in find(rendered["trial"], "StatefulSet")
    }
    assert trial == {"engine", "postgresql", "redis"}
    assert find(rendered["production"], "StatefulSet") == find(
        rendered["production"], "StatefulSet", "engine"
    )
    variables = env(one(rendered["trial"], "Deployment", "gateway"))
    assert variables["TERN_DATABASE_URL"]["value"].startswith(
        "postgresql+asyncpg://tern:$(POSTGRES_PASSWORD)@"
    )
    names = list(variables)
    assert names.index("POSTGRES_PASSWORD") < names.index("TERN_DATABASE_URL"), (
        "$(VAR) needs it defined first"
    )
    assert variables["TERN_REDIS_URL"]["value"] == "redis://tern-redis:6379/0"
    redis = container(one(rendered["trial"], "StatefulSet", "redis"))
    assert "--appendonly" in redis["command"]


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

    static = render(_merge(example_values("production"), {"engine": {"discovery": "static"}}))
    urls = env(one(static, "Deployment", "gateway"))["TERN_ENGINE_URLS"]["value"].split(",")
    expected = [f"http://{name}-{i}.{name}.{NAMESPACE}.svc:{port}" for i in range(engine["spec"]["replicas"])]
    assert urls == expected and len(urls) == 2


def test_tenants_prefix_caches_are_isolated_unless_the_values_say_shared(
    example: tuple[str, list[Doc]],
) -> None:
    """The safe default in every example: a shared cache lets a tenant see another's prompts as cached."""
    _, docs = example
    for gateway in find(docs, "Deployment", "gateway"):
        assert env(gateway)["TERN_PREFIX_CACHE_ISOLATION"]["value"] == "tenant"
    shared = render(_merge(example_values("trial"), {"gateway": {"prefixCacheIsolation": "shared"}}))
    assert env(one(shared, "Deployment", "gateway"))["TERN_PREFIX_CACHE_ISOLATION"]["value"] == "shared"


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


def test_tern_mode_renders_no_pool_and_no_llm_d_labels(rendered: dict[str, list[Doc]]) -> None:
    for name in ("trial", "production"):
        docs = rendered[name]
        assert not find(docs, "InferencePool") and not find(docs, "InferenceObjective")
        engine = one(docs, "StatefulSet", "engine")
        assert "llm-d.ai/engine-type" not in engine["spec"]["template"]["metadata"]["labels"]
        assert "--kv-events-port" not in container(engine)["command"]


def test_inference_pool_mode_needs_the_gateway_url_and_the_engines() -> None:
    base = _merge(example_values("llm-d"), {"inferencePool": {"gatewayUrl": ""}})
    with pytest.raises(helm.HelmRenderError, match=r"inferencePool\.gatewayUrl"):
        render(base)
    with pytest.raises(helm.HelmRenderError, match=r"engine\.enabled"):
        render(_merge(example_values("llm-d"), {"engine": {"enabled": False}}))
    # Without a Gateway name the route is yours to write; the pool and objective still render.
    docs = render(_merge(example_values("llm-d"), {"inferencePool": {"gateway": {"name": ""}}}))
    assert not find(docs, "HTTPRoute") and find(docs, "InferencePool")


def test_gpu_is_a_values_switch(rendered: dict[str, list[Doc]]) -> None:
    gpu = container(one(rendered["production"], "StatefulSet", "engine"))
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["command"][gpu["command"].index("--device") + 1] == "cuda"
    cpu = container(one(rendered["trial"], "StatefulSet", "engine"))
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})
    assert cpu["command"][cpu["command"].index("--device") + 1] == "cpu"


def test_gateway_scales_with_an_hpa_and_a_disruption_budget(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["production"]
    gateway = one(docs, "Deployment", "gateway")
    assert "replicas" not in gateway["spec"], "the HPA owns the replica count"
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == gateway["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    pdb = one(docs, "PodDisruptionBudget")
    pod_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # Fail-open limits are divided by the most gateway processes there can be.
    assert env(gateway)["TERN_LIMITS_REPLICAS"]["value"] == "12"
    # One replica: a budget would block every node drain, so there is none.
    assert not find(rendered["trial"], "PodDisruptionBudget")
    assert not find(rendered["trial"], "HorizontalPodAutoscaler")


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


def test_values_schema_rejects_typos_and_bad_engine_urls() -> None:
    """values.schema.json: a misspelt switch fails the install instead of being silently ignored."""
    with pytest.raises(helm.HelmError, match="enable"):
        render(_merge(example_values("trial"), {"engine": {"gpu": {"enable": True}}}))
    with pytest.raises(helm.HelmError, match="engineUrls"):
        render(_merge(example_values("vllm"), {"gateway": {"engineUrls": ["vllm.vllm.svc:8000"]}}))
