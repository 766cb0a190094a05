"""Rendering the Helm chart (deploy/helm/tern) and checking its documents, for tests/helm/.

No cluster and no network: ``helm-python-sdk`` renders with Helm's own Go engine (linked into the
wheel, Helm v4), ``kubernetes-validate`` ships the Kubernetes JSON schemas, and the ServiceMonitor
CRD (not in those schemas) is checked against ``cloudcoil-models-prometheus-operator``'s models,
generated from the Prometheus Operator's CRDs. All are pinned in pyproject's ``test`` extra.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

from tests.inference_crds import SCHEMAS as INFERENCE_SCHEMAS

ROOT = Path(__file__).resolve().parents[2]


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


def merge_values(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_values(merged[key], value)
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
    return merge_values(values, INSTALL_SETS.get(name, {}))


EXAMPLES_NAMES = ("trial", "production", "vllm", "llm-d")


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


def engine_routes() -> set[str]:
    """The engine's HTTP routes, read from its source (importing it would import torch)."""
    source = (ROOT / "engine" / "serving" / "server.py").read_text()
    return set(re.findall(r'@app\.get\("([^"]+)"\)', source))
