"""The Helm chart's values do what docs/operations.md says: secrets referenced or made, datastores
bundled or external, prefix-cache isolation, GPU, scaling, and a values schema that rejects typos.
Helpers: tests/helm/chart.py.
"""

from __future__ import annotations

import base64

import helm_python as helm
import pytest
import yaml

from tests.helm.chart import (
    EXAMPLES,
    TRIAL_SECRET,
    Doc,
    container,
    env,
    example_values,
    find,
    merge_values,
    one,
    render,
)


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
        render(merge_values(example_values("trial"), {"postgresql": {"enabled": False}}))
    with pytest.raises(helm.HelmRenderError, match=r"gateway\.engineUrls"):
        render(merge_values(example_values("trial"), {"engine": {"enabled": False}}))


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


def test_tenants_prefix_caches_are_isolated_unless_the_values_say_shared(
    example: tuple[str, list[Doc]],
) -> None:
    """The safe default in every example: a shared cache lets a tenant see another's prompts as cached."""
    _, docs = example
    for gateway in find(docs, "Deployment", "gateway"):
        assert env(gateway)["TERN_PREFIX_CACHE_ISOLATION"]["value"] == "tenant"
    shared = render(merge_values(example_values("trial"), {"gateway": {"prefixCacheIsolation": "shared"}}))
    assert env(one(shared, "Deployment", "gateway"))["TERN_PREFIX_CACHE_ISOLATION"]["value"] == "shared"


def test_tern_mode_renders_no_pool_and_no_llm_d_labels(rendered: dict[str, list[Doc]]) -> None:
    for name in ("trial", "production"):
        docs = rendered[name]
        assert not find(docs, "InferencePool") and not find(docs, "InferenceObjective")
        engine = one(docs, "StatefulSet", "engine")
        assert "llm-d.ai/engine-type" not in engine["spec"]["template"]["metadata"]["labels"]
        assert "--kv-events-port" not in container(engine)["command"]


def test_inference_pool_mode_needs_the_gateway_url_and_the_engines() -> None:
    base = merge_values(example_values("llm-d"), {"inferencePool": {"gatewayUrl": ""}})
    with pytest.raises(helm.HelmRenderError, match=r"inferencePool\.gatewayUrl"):
        render(base)
    with pytest.raises(helm.HelmRenderError, match=r"engine\.enabled"):
        render(merge_values(example_values("llm-d"), {"engine": {"enabled": False}}))
    # Without a Gateway name the route is yours to write; the pool and objective still render.
    docs = render(merge_values(example_values("llm-d"), {"inferencePool": {"gateway": {"name": ""}}}))
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


def test_values_schema_rejects_typos_and_bad_engine_urls() -> None:
    """values.schema.json: a misspelt switch fails the install instead of being silently ignored."""
    with pytest.raises(helm.HelmError, match="enable"):
        render(merge_values(example_values("trial"), {"engine": {"gpu": {"enable": True}}}))
    with pytest.raises(helm.HelmError, match="engineUrls"):
        render(merge_values(example_values("vllm"), {"gateway": {"engineUrls": ["vllm.vllm.svc:8000"]}}))
