"""Gateway settings, read from ``TERN_*`` environment variables (and ``DATABASE_URL`` / ``REDIS_URL``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

KEY_CACHE_MAX_TTL_S = 0.9
"""Revocation must reach every process within 1 s, so no cache entry may live longer than this."""

PrefixCacheIsolation = Literal["shared", "tenant"]
EngineKind = Literal["tern", "openai"]
RoutingPolicy = Literal["cache_aware", "least_loaded", "round_robin"]

_KIND_SCHEMES: dict[str, EngineKind] = {"tern+": "tern", "openai+": "openai"}
DNS_PREFIX = "dns+"


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One ``TERN_ENGINE_URLS`` entry: how to talk to it (``kind``) and where (``url``, plain http(s))."""

    kind: EngineKind
    url: str
    discover: bool = False
    """``dns+``: the host names a headless Service; each of its addresses is an engine
    (gateway/proxy/engine_discovery.py)."""


def parse_engine_url(entry: str) -> EngineSpec:
    """``openai+http://h:8000`` -> an OpenAI-compatible engine; ``http://h:8100`` or
    ``tern+http://h:8100`` -> Tern's RPC; ``dns+`` after the kind (or alone) -> every address the host
    resolves to. The scheme prefixes only name the kind and the discovery; they are never sent."""
    entry = entry.strip().rstrip("/")
    kind: EngineKind = "tern"
    for prefix, named in _KIND_SCHEMES.items():
        if entry.startswith(prefix):
            kind, entry = named, entry[len(prefix) :]
            break
    if entry.startswith(DNS_PREFIX):
        return EngineSpec(kind=kind, url=entry[len(DNS_PREFIX) :], discover=True)
    return EngineSpec(kind=kind, url=entry)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TERN_", populate_by_name=True, extra="ignore")

    database_url: str = Field(
        "postgresql+asyncpg://postgres@127.0.0.1:5432/tern",
        validation_alias=AliasChoices("TERN_DATABASE_URL", "DATABASE_URL", "database_url"),
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("TERN_REDIS_URL", "REDIS_URL", "redis_url"),
    )
    secret: SecretStr | None = Field(None, description="HMAC key for API key hashes (TERN_SECRET).")
    admin_key: SecretStr | None = Field(None, description="Bootstrap platform admin key (TERN_ADMIN_KEY).")
    engine_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)

    host: str = "127.0.0.1"
    port: int = 8080
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    key_cache_ttl_s: float = Field(0.5, ge=0, le=KEY_CACHE_MAX_TTL_S)
    key_last_used_interval_s: float = Field(60.0, ge=0)
    db_pool_size: int = Field(10, gt=0)
    log_level: str = "INFO"
    log_json: bool = True

    # Upstream engines (used by gateway.proxy).
    engine_health_interval_s: float = Field(2.0, gt=0)
    engine_connect_timeout_s: float = Field(5.0, gt=0)
    engine_request_timeout_s: float = Field(600.0, gt=0)
    engine_api_key: SecretStr | None = Field(
        None,
        description="Bearer key the gateway sends to 'openai' engines (TERN_ENGINE_API_KEY); "
        "never the client's key.",
    )
    engine_model_map: dict[str, str] = Field(
        default_factory=dict,
        description="Served model name -> the name an 'openai' engine knows it by, as JSON "
        '(TERN_ENGINE_MODEL_MAP=\'{"llama-3-8b": "meta-llama/Meta-Llama-3-8B-Instruct"}\').',
    )
    engine_tokenizers: dict[str, str] = Field(
        default_factory=dict,
        description="Served model name -> a tokenizer.json, as JSON (TERN_ENGINE_TOKENIZERS): counts the "
        "tokens of an 'openai' engine that reports no usage. Without one the gateway estimates.",
    )
    routing_policy: RoutingPolicy = Field(
        "cache_aware",
        description="How a request picks among the engines serving its model (proxy/prefix_routing.py).",
    )
    routing_load_slack: int = Field(4, ge=0)
    routing_min_match: float = Field(0.3, ge=0, le=1)
    prefix_cache_isolation: PrefixCacheIsolation = Field(
        "tenant",
        description="'tenant' (the default): each tenant's cached prompts serve only that tenant. 'shared': "
        "tenants share the engines' prefix cache, for a single organisation only: a tenant can then tell "
        "from its own answers' cached_tokens whether another tenant sent a prompt.",
    )
    engine_cache_salt: bool = Field(
        True,
        description="Send the cache namespace to 'openai' engines as vLLM's per-request `cache_salt`, which "
        "isolates their prefix caches too. Set false for upstreams that reject unknown fields (OpenAI's "
        "own API); the gateway cannot isolate those engines' caches.",
    )

    @field_validator("database_url")
    @classmethod
    def _asyncpg_driver(cls, url: str) -> str:
        """Accept the plain ``postgresql://`` form too; the gateway always talks asyncpg."""
        for plain in ("postgresql://", "postgres://"):
            if url.startswith(plain):
                return "postgresql+asyncpg://" + url[len(plain) :]
        return url

    @field_validator("engine_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip().rstrip("/") for part in value.split(",") if part.strip()]
        return value

    @field_validator("engine_urls")
    @classmethod
    def _known_kinds(cls, urls: list[str]) -> list[str]:
        for entry in urls:
            if not parse_engine_url(entry).url.startswith(("http://", "https://")):
                raise ValueError(
                    f"TERN_ENGINE_URLS entry {entry!r} is not http(s)://, tern+http(s):// or "
                    "openai+http(s):// (each optionally with dns+ before http)"
                )
        return urls

    @field_validator("engine_model_map")
    @classmethod
    def _one_to_one(cls, mapping: dict[str, str]) -> dict[str, str]:
        """Answers name the served model by reversing the map, so two served names may not share one."""
        if len(set(mapping.values())) != len(mapping):
            raise ValueError("TERN_ENGINE_MODEL_MAP maps two served names to the same upstream name")
        return mapping

    def engine_specs(self) -> list[EngineSpec]:
        return [parse_engine_url(entry) for entry in self.engine_urls]

    @field_validator("secret", "admin_key", "engine_api_key", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        """Compose passes ``TERN_ADMIN_KEY=`` when the variable is unset."""
        return None if value == "" else value

    @field_validator("admin_key")
    @classmethod
    def _admin_key_length(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError("TERN_ADMIN_KEY must be at least 32 characters")
        return value

    @field_validator("secret")
    @classmethod
    def _secret_length(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("TERN_SECRET must be at least 16 characters")
        return value

    def secret_bytes(self) -> bytes:
        """The HMAC key; the gateway refuses to start without one."""
        if self.secret is None:
            raise RuntimeError("TERN_SECRET is not set; the gateway needs it to hash API keys.")
        return self.secret.get_secret_value().encode()
