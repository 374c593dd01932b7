"""Request/response shapes of the OpenAI-compatible API and the deploy API (validated by pydantic)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from raypai.deployment import DEFAULT_ALIAS, DEFAULTS, ENGINES

MAX_TOKENS_LIMIT = 2048
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1, max_length=200)
    max_tokens: int = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    user: str | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)  # count checked by raypai.serving.limits


class CompletionRequest(_Sampling):
    prompt: str  # length: Limits.max_prompt_chars (raypai.serving.limits)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1, max_length=256)


class Autoscaling(BaseModel):
    """The subset of Ray Serve's `autoscaling_config` a deployment may set (validated here, not by Serve)."""

    model_config = ConfigDict(extra="forbid")
    min_replicas: int = Field(default=1, ge=0, le=64)
    max_replicas: int = Field(default=2, ge=1, le=64)
    target_ongoing_requests: float = Field(
        default=2.0, gt=0, le=1024, description="requests in flight per replica that Serve aims for"
    )

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        return self


class DeploymentCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="deployment name; also the `model` clients send")
    model: str = Field(description="registered model name in the MLflow registry")
    version: int | None = Field(default=None, ge=1)
    alias: str | None = Field(
        default=None, description=f"registry alias, instead of version (neither given: {DEFAULT_ALIAS})"
    )
    replicas: int = Field(default=DEFAULTS["replicas"], ge=1, le=64)
    autoscaling: Autoscaling | None = Field(default=None, description="autoscale instead of fixed replicas")
    cpus: float = Field(default=DEFAULTS["cpus"], gt=0, le=64)
    gpus: float = Field(default=DEFAULTS["gpus"], ge=0, le=8)
    max_batch_size: int = Field(
        default=DEFAULTS["max_batch_size"], ge=1, le=256, description="dynamic batching: most requests per batch"
    )
    batch_wait_timeout_s: float = Field(
        default=DEFAULTS["batch_wait_timeout_s"],
        ge=0,
        le=1.0,
        description="dynamic batching: longest wait for a batch to fill",
    )
    max_kv_cells: int = Field(
        default=DEFAULTS["max_kv_cells"],
        ge=1,
        description="KV budget per replica: rows x longest prompt + max_tokens of the batch a request would join",
    )
    max_ongoing_requests: int = Field(
        default=DEFAULTS["max_ongoing_requests"], ge=1, le=4096, description="requests one replica holds at once"
    )
    max_queued_requests: int = Field(
        default=DEFAULTS["max_queued_requests"],
        ge=1,
        le=65536,
        description="requests waiting for a replica; past it 503 + Retry-After",
    )
    request_timeout_s: float = Field(
        default=DEFAULTS["request_timeout_s"], gt=0, le=3600, description="one answer (a stream included); then 504"
    )
    drain_timeout_s: float = Field(
        default=DEFAULTS["drain_timeout_s"],
        ge=0,
        le=3600,
        description="a replica being removed finishes its requests for up to this long",
    )
    engine: Literal[ENGINES] = Field(
        default=DEFAULTS["engine"],
        description="raypai, vllm, or auto: vLLM when the deployment asks for GPUs and vLLM is installed, "
        "else raypai's engine (the spec stores the one chosen)",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        if not _NAME.match(v):
            raise ValueError("use 1-63 lowercase letters, digits or '-', starting with a letter or digit")
        return v

    @field_validator("model")
    @classmethod
    def _model(cls, v):
        if not _MODEL.match(v) or ".." in v:
            raise ValueError(
                "must be the name of a model in the MLflow registry, not a path or URL "
                "(loading arbitrary files would be remote code execution)"
            )
        return v


class DeploymentPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    canary_version: int | None = Field(default=None, ge=1, description="start a canary of this registry version")
    canary_alias: str | None = None
    canary_percent: int | None = Field(default=None, ge=0, le=100)
    promote: bool = False
    force: bool = Field(default=False, description="promote without a healthy measured canary verdict")
    canary_policy: dict | None = Field(
        default=None,
        description="window_s, min_requests, max_error_rate_increase, "
        "max_latency_ratio, auto_rollback (raypai.serving.canary)",
    )
    replicas: int | None = Field(default=None, ge=1, le=64)
    autoscaling: Autoscaling | None = None
