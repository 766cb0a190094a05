"""docker-compose.yml against the Compose specification, plus the structure Tern relies on.

No Docker engine runs in CI, so this and a careful read are the checks. The schema comes from the
``docker-compose==1.29.2`` wheel (installed ``--no-deps`` by ``make test``), which ships the Compose
spec's JSON schema as package data; the package itself is never imported.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
CPU_OVERRIDE_FILE = ROOT / "deploy" / "compose.cpu.yml"
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
DOCKERFILE = ROOT / "Dockerfile"
CONFIG_DOC = ROOT / "docs" / "configuration.md"

# `${VAR}`, `${VAR:-default}`, `${VAR:?error}` are interpolated by Compose; `$${VAR}` is a literal `${VAR}`.
INTERPOLATION = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)")


def _compose_spec_schema() -> dict[str, Any]:
    spec = importlib.util.find_spec("compose")
    assert spec is not None and spec.submodule_search_locations, (
        "the Compose JSON schema comes from `pip install --no-deps docker-compose==1.29.2` (see Makefile)"
    )
    schema_path = Path(next(iter(spec.submodule_search_locations))) / "config" / "compose_spec.json"
    return json.loads(schema_path.read_text())


class _OverrideLoader(yaml.SafeLoader):
    """A safe loader that also reads Compose's `!reset` tag (override files) as the plain value it tags."""


def _construct_reset(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    return loader.construct_scalar(node)


_OverrideLoader.add_constructor("!reset", _construct_reset)


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return _compose_spec_schema()


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def test_schema_is_the_compose_spec_with_the_features_we_use(schema: dict[str, Any]) -> None:
    assert schema["title"] == "Compose Specification"
    definitions = schema["definitions"]
    depends_on_conditions = definitions["service"]["properties"]["depends_on"]["oneOf"][1][
        "patternProperties"
    ]["^[a-zA-Z0-9._-]+$"]["properties"]["condition"]["enum"]
    assert "service_completed_successfully" in depends_on_conditions
    assert "service_healthy" in depends_on_conditions
    reservations = definitions["deployment"]["properties"]["resources"]["properties"]["reservations"]
    assert "devices" in reservations["properties"]
    assert "start_period" in definitions["healthcheck"]["properties"]


def test_compose_file_is_valid(schema: dict[str, Any], compose: dict[str, Any]) -> None:
    jsonschema.Draft201909Validator(schema).validate(compose)


def test_cpu_override_is_valid(schema: dict[str, Any]) -> None:
    override = yaml.load(CPU_OVERRIDE_FILE.read_text(), Loader=_OverrideLoader)
    jsonschema.Draft201909Validator(schema).validate(override)
    assert override["services"]["engine"]["environment"]["TERN_ENGINE_DEVICE"] == "cpu"
    assert "!reset" in CPU_OVERRIDE_FILE.read_text(), "the override must drop the GPU reservation"


def test_schema_rejects_a_broken_file(schema: dict[str, Any], compose: dict[str, Any]) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["gateway"]["depends_on"]["migrate"]["condition"] = "service_finished"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft201909Validator(schema).validate(broken)


def test_expected_services(services: dict[str, Any]) -> None:
    assert set(services) == {"postgres", "redis", "migrate", "engine", "gateway", "proxy"}


def test_postgres_keeps_its_data_in_a_named_volume(compose: dict[str, Any], services: dict[str, Any]) -> None:
    postgres = services["postgres"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in postgres["volumes"]}
    assert mounts["/var/lib/postgresql/data"] in compose["volumes"]
    assert "healthcheck" in postgres


def test_migrate_runs_once_after_postgres_and_before_the_gateway(services: dict[str, Any]) -> None:
    migrate = services["migrate"]
    assert migrate["command"] == ["tern", "migrate"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["gateway"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_engine_reserves_a_gpu_has_a_model_volume_and_a_healthcheck(
    compose: dict[str, Any], services: dict[str, Any]
) -> None:
    engine = services["engine"]
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in device["capabilities"] for device in devices)
    named_volumes = {v.split(":")[0] for v in engine["volumes"]}
    assert named_volumes & set(compose["volumes"])
    assert "/health" in " ".join(engine["healthcheck"]["test"])
    assert "--port 8100" in " ".join(engine["command"])


def test_gateway_is_scalable(services: dict[str, Any]) -> None:
    gateway = services["gateway"]
    assert "container_name" not in gateway
    assert "ports" not in gateway, "a fixed host port would stop `--scale gateway=3`"
    assert "/healthz" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["environment"]["TERN_ENGINE_URLS"] == "http://engine:8100"
    # Tenants never share cached prompts unless the operator says so (docs/gateway.md).
    assert gateway["environment"]["TERN_PREFIX_CACHE_ISOLATION"] == "${TERN_PREFIX_CACHE_ISOLATION:-tenant}"
    assert "--port" in gateway["command"] and "8000" in gateway["command"]
    assert "8000" in gateway["expose"]


def test_proxy_is_the_one_published_port_and_resolves_gateways_per_request(services: dict[str, Any]) -> None:
    published = [name for name, service in services.items() if "ports" in service]
    assert published == ["proxy"]
    proxy = services["proxy"]
    assert len(proxy["ports"]) == 1
    container_port = proxy["ports"][0].rsplit(":", 1)[1]
    assert f"./{NGINX_CONF.relative_to(ROOT)}:/etc/nginx/nginx.conf:ro" in proxy["volumes"]

    conf = NGINX_CONF.read_text()
    assert re.search(rf"listen\s+{container_port};", conf)
    assert re.search(r"resolver\s+127\.0\.0\.11\b", conf), "Docker's embedded DNS lists every replica"
    variable = re.search(r"set\s+(\$\w+)\s+http://gateway:8000;", conf)
    assert variable, "the upstream must be a variable so nginx re-resolves `gateway` at run time"
    assert re.search(rf"proxy_pass\s+\{variable.group(1)};", conf)
    assert re.search(r"proxy_buffering\s+off;", conf), "SSE must not be buffered"


def test_healthchecks_everywhere_a_dependency_waits_on_one(services: dict[str, Any]) -> None:
    for name, service in services.items():
        for dependency, condition in (service.get("depends_on") or {}).items():
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits on {dependency}'s health"


def test_every_variable_is_documented(services: dict[str, Any]) -> None:
    documented = CONFIG_DOC.read_text()
    names = set(INTERPOLATION.findall(COMPOSE_FILE.read_text()))
    names |= set(INTERPOLATION.findall(CPU_OVERRIDE_FILE.read_text()))
    for service in services.values():
        names |= set(service.get("environment") or {})
    names |= set(re.findall(r"^ARG\s+(\w+)", DOCKERFILE.read_text(), flags=re.MULTILINE))
    missing = sorted(name for name in names if f"`{name}`" not in documented)
    assert not missing, f"not in {CONFIG_DOC.relative_to(ROOT)}: {missing}"


def test_image_runs_as_an_unprivileged_user() -> None:
    dockerfile = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, flags=re.MULTILINE)
    users = re.findall(r"^USER\s+(\S+)", dockerfile, flags=re.MULTILINE)
    assert users and users[-1] not in {"root", "0"}
    cpu_torch_by_default = r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$"
    assert re.search(cpu_torch_by_default, dockerfile, flags=re.MULTILINE)
