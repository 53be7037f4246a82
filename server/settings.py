"""Server settings: a TOML file and/or ``CIPHERLM_*`` environment variables (pydantic-settings).

Precedence, highest first: keyword arguments, environment variables (``CIPHERLM_PORT=8080``; nested
fields with ``__``, e.g. ``CIPHERLM_LIMITS_DEFAULT__REQUESTS_PER_MINUTE``; lists such as ``tenants`` as
JSON), then the TOML file given to :meth:`Settings.load`. Route handlers receive the settings through
``Depends(get_settings)`` — there is no module-global instance, so tests override it with
``app.dependency_overrides[get_settings]``.

A minimal file::

    model = "/models/SmolLM2-135M-Instruct"   # omitted: the embedded default model
    server_secret = "..."                      # derives per-tenant prefix-cache salts

    [[tenants]]
    id = "acme"
    api_key_hashes = ["sha256:..."]            # `cipherlm serve` prints keys once; only hashes are stored
    privacy_mode = "plaintext"
    [tenants.limits]
    requests_per_minute = 600
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request
from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from server.private.config import PrivateSettings

TENANT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class PrivacyMode(str, Enum):
    """How private a tenant's traffic is. ``encrypted`` tenants may not send plaintext prompts."""

    PLAINTEXT = "plaintext"
    ENCRYPTED = "encrypted"


class FallbackPolicy(str, Enum):
    """May an encrypted tenant's request fall back to the plaintext path?

    ``never`` (default) refuses every plaintext request; ``non_sensitive`` serves a plaintext request
    only when it marks itself non-sensitive explicitly (header ``X-Cipherlm-Sensitivity: non-sensitive``),
    and records every such fallback.
    """

    NEVER = "never"
    NON_SENSITIVE = "non_sensitive"


class LimitSettings(BaseModel):
    """Per-tenant limits; ``None`` (or 0, for TOML) means unlimited (the engine's queue bound still applies).

    The defaults bound what one tenant can queue on a small (CPU, demo) deployment: a prompt plus its
    ``max_tokens`` fits 4,096 tokens, and 60,000 tokens a minute (1,000 a second sustained) is more than a
    CPU engine computes, so one tenant's backlog is bounded while the engine's fair scheduler shares each
    step. Larger deployments raise them per tenant (``docs/operator-guide.md``, Limits).
    """

    requests_per_minute: int | None = Field(600, ge=1)
    #: steps of open encrypted sessions (one layer or linear part for one token each); apart from requests
    #: because one generation is thousands of steps (the 28-layer offload plan: 112 a token)
    steps_per_minute: int | None = Field(60_000, ge=1, description="steps of open encrypted sessions")
    tokens_per_minute: int | None = Field(60_000, ge=1, description="prompt + reserved completion tokens")
    max_concurrent: int | None = Field(16, ge=1)
    max_context_tokens: int | None = Field(4096, ge=1, description="prompt + max_tokens per request")
    max_tokens: int | None = Field(None, ge=1, description="upper bound of a request's max_tokens")

    @field_validator("*", mode="before")
    @classmethod
    def _zero_is_unlimited(cls, value: Any) -> Any:
        # TOML has no null: 0 is how a settings file switches a default limit off
        return None if value == 0 and not isinstance(value, bool) else value


class TenantSettings(BaseModel):
    """One tenant as written in the settings file."""

    id: str = Field(pattern=TENANT_ID_PATTERN)
    api_key_hashes: list[str] = Field(default_factory=list, description="'sha256:<hex>' of each API key")
    privacy_mode: PrivacyMode = PrivacyMode.PLAINTEXT
    fallback: FallbackPolicy = FallbackPolicy.NEVER
    priority: int = Field(0, description="engine scheduling priority (lower runs first)")
    limits: LimitSettings | None = Field(None, description="None: the server-wide limits_default")

    @field_validator("api_key_hashes")
    @classmethod
    def _hash_format(cls, hashes: list[str]) -> list[str]:
        for h in hashes:
            algo, _, digest = h.partition(":")
            if algo != "sha256" or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"api key hash {h[:16]!r}... must be 'sha256:<64 lowercase hex>'")
        return hashes


class ReplicaSettings(BaseModel):
    """Plaintext engine replicas (``server/replicas.py``): 1 is the in-process engine; more are Ray actors
    on ``private.ray.address`` (unset: a Ray head on 127.0.0.1 inside the server)."""

    count: int = Field(1, ge=1, le=256, description="engine replicas; >1 runs each as a Ray actor")
    num_cpus: float = Field(1.0, ge=0, description="CPUs one replica actor reserves")
    num_gpus: float = Field(0.0, ge=0, description="GPUs one replica actor reserves (1 for a GPU engine)")
    prefix_tokens: int = Field(32, ge=1, description="prompt tokens (with the tenant) that pick a replica")
    load_slack: int = Field(4, ge=0, description="in-flight requests a preferred replica may have over the "
                            "least loaded before the least loaded takes the request")


class Settings(BaseSettings):
    """Everything ``cipherlm serve`` needs; validated on construction."""

    model_config = SettingsConfigDict(env_prefix="CIPHERLM_", env_nested_delimiter="__", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    model: str | None = Field(None, description="model folder or .gguf; None: the embedded default")
    served_model_name: str | None = Field(None, description="name in /v1/models; default: folder name")
    server_secret: SecretStr | None = Field(
        None, description="derives per-tenant prefix-cache salts; None: random per process")
    tenants: list[TenantSettings] = Field(default_factory=list)
    limits_default: LimitSettings = Field(default_factory=LimitSettings)
    engine: dict[str, Any] = Field(default_factory=dict, description="passed to the engine's config")
    max_request_bytes: int = Field(1_000_000, ge=1024)
    max_n: int = Field(8, ge=1, description="upper bound of n (choices per prompt)")
    max_prompts_per_request: int = Field(16, ge=1)
    drain_timeout_s: float = Field(30.0, ge=0, description="SIGTERM: how long in-flight requests may run")
    retry_after_s: float = Field(1.0, gt=0, description="Retry-After sent with 503 while draining")
    engine_process: bool = Field(
        True, description="run the engine core in its own process (false: a thread of the API process)")
    stream_interval: int = Field(
        1, ge=1, le=1024, description="streamed responses: a chunk waits for this many new tokens of its "
        "completion (the first chunk and the last never wait); 1: every step's tokens as they come, "
        "coalesced only when the client's stream is behind")
    stream_coalesce_streams: int = Field(
        96, ge=0, description="streamed responses with the engine in its own process: while S requests are "
        "in the engine, a chunk waits for 1 + S // this many new tokens (96: 1 below 96 requests, 3 at 256), "
        "held in the engine's process (never built, sent or read before); the first chunk and the last never "
        "wait; 0: off (stream_interval alone)")
    gc_freeze: bool = Field(
        True, description="`cipherlm serve`: once started (engine up, app ready), collect once and freeze the "
        "API process's heap (gc.freeze, as vLLM's API server does), so later full collections skip the "
        "~10^6 objects of the imported libraries: a fifth of the API's CPU at 256 streamed users went to the "
        "collector without it")
    replicas: ReplicaSettings = Field(default_factory=ReplicaSettings,
                                      description="plaintext engine replicas (data parallel, on Ray)")
    private: PrivateSettings = Field(default_factory=PrivateSettings,
                                     description="encrypted sessions (/v1/private): plan, workers, limits")

    def private_enabled(self) -> bool:
        """Encrypted sessions on? ``private.enabled`` if set, else: some tenant is in encrypted mode."""
        if self.private.enabled is not None:
            return self.private.enabled
        return any(t.privacy_mode is PrivacyMode.ENCRYPTED for t in self.tenants)

    @model_validator(mode="after")
    def _unique_tenants(self) -> Settings:
        ids = [t.id for t in self.tenants]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"duplicate tenant ids: {dup}")
        hashes = [h for t in self.tenants for h in t.api_key_hashes]
        if len(hashes) != len(set(hashes)):
            raise ValueError("one API key hash is listed under two tenants")
        return self

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """init > env > TOML file (when the class was built by :meth:`load`)."""
        toml_file = settings_cls.model_config.get("toml_file")
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        if toml_file:
            sources += (TomlConfigSettingsSource(settings_cls, toml_file=toml_file),)
        return sources

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> Settings:
        """Settings from ``path`` (TOML) + environment + ``overrides``.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            pydantic.ValidationError: a value is invalid (the message names the field).
        """
        if path is None:
            return cls(**overrides)
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"settings file {path} does not exist")
        from_file = type(cls.__name__, (cls,), {"model_config": {**cls.model_config, "toml_file": str(path)}})
        return cls.model_validate(from_file(**overrides).model_dump())

    def limits_for(self, tenant: TenantSettings) -> LimitSettings:
        """The tenant's limits, else the server-wide default."""
        return tenant.limits or self.limits_default


async def get_settings(request: Request) -> Settings:
    """FastAPI dependency: the settings the app was created with (override in tests)."""
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]
