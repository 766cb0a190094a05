"""JSON Schemas for the three custom resources the chart renders with ``routing: inference-pool``, for
tests/helm/ (kubernetes-validate knows only the built-in kinds).

Written from the CRDs' own OpenAPI schemas, the fields the chart uses and their neighbours, with
their types, bounds, enums and required lists (checked on 2026-11-29 against:
kubernetes-sigs/gateway-api-inference-extension@84436a9
``config/crd/bases/inference.networking.k8s.io_inferencepools.yaml`` (v1);
llm-d/llm-d-router@ebab687 ``config/crd/bases/llm-d.ai_inferenceobjectives.yaml`` (v1alpha2; the
InferenceObjective moved there from GIE's ``inference.networking.x-k8s.io``);
kubernetes-sigs/gateway-api@4564255 ``config/crd/standard/gateway.networking.k8s.io_httproutes.yaml``
(v1: parentRefs, rules, matches, backendRefs). Unknown fields are
errors here: the API server would prune them silently, and a field the chart believes it set would
not be there.
"""

from __future__ import annotations

from typing import Any

_DNS_LABEL = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_GROUP = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_KIND = "^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
_LABEL_VALUE = "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
        "required": list(required),
    }


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    metadata = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 253, "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
            "labels": {"type": "object", "additionalProperties": {"type": "string", "pattern": _LABEL_VALUE}},
        },
        "required": ["name"],
    }
    return _object(
        {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": metadata, "spec": spec},
        ("apiVersion", "kind", "metadata", "spec"),
    )


_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_REF_GROUP = {"type": "string", "maxLength": 253, "pattern": _GROUP}
_REF_KIND = {"type": "string", "minLength": 1, "maxLength": 63, "pattern": _KIND}

INFERENCE_POOL = _resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    _object(
        {
            "selector": _object(
                {
                    "matchLabels": {
                        "type": "object",
                        "minProperties": 1,
                        "maxProperties": 64,
                        "additionalProperties": {"type": "string", "maxLength": 63, "pattern": _LABEL_VALUE},
                    }
                },
                ("matchLabels",),
            ),
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "items": _object({"number": _PORT}, ("number",)),
            },
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": _object(
                {
                    "group": _REF_GROUP,
                    "kind": _REF_KIND,
                    "name": _NAME,
                    "port": _object({"number": _PORT}, ("number",)),
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
                # The CRD's rule: a port is required when kind is Service, the default.
                ("name", "port"),
            ),
        },
        ("selector", "targetPorts"),
    ),
)

INFERENCE_OBJECTIVE = _resource(
    "llm-d.ai/v1alpha2",
    "InferenceObjective",
    _object(
        {
            "priority": {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1},
            "poolRef": _object({"group": _REF_GROUP, "kind": _REF_KIND, "name": _NAME}, ("name",)),
        },
        ("poolRef",),
    ),
)

_PARENT_REF = _object(
    {
        "group": _REF_GROUP,
        "kind": _REF_KIND,
        "name": _NAME,
        "namespace": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": _DNS_LABEL},
        "sectionName": {"type": "string"},
        "port": _PORT,
    },
    ("name",),
)
_BACKEND_REF = _object(
    {
        "group": _REF_GROUP,
        "kind": _REF_KIND,
        "name": _NAME,
        "namespace": {"type": "string"},
        "port": _PORT,
        "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},
    },
    ("name",),
)
_PATH_MATCH = _object(
    {
        "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
        "value": {"type": "string", "maxLength": 1024},
    }
)

HTTP_ROUTE = _resource(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    _object(
        {
            "parentRefs": {"type": "array", "maxItems": 32, "items": _PARENT_REF},
            "hostnames": {"type": "array", "items": {"type": "string"}},
            "rules": {
                "type": "array",
                "maxItems": 16,
                "items": _object(
                    {
                        "matches": {"type": "array", "maxItems": 64, "items": _object({"path": _PATH_MATCH})},
                        "backendRefs": {"type": "array", "maxItems": 16, "items": _BACKEND_REF},
                    }
                ),
            },
        }
    ),
)

SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL,
    ("llm-d.ai/v1alpha2", "InferenceObjective"): INFERENCE_OBJECTIVE,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE,
}
