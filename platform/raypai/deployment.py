"""The deployment spec: the desired state of one deployment, as the metadata store keeps it, the
control plane (raypai.serving.control) applies it to Ray Serve, the router reads it to route, and
lineage (raypai.lineage.deploy) follows it to the served model versions.

    spec = DeploymentSpec(model="tinychat", version=3)
    spec = spec.with_canary(4, percent=10)        # frozen: every change is a new spec
    spec.served()                                 # [(3, "stable"), (4, "canary")]
    store.save_deployment("tinychat", spec, "running");  store.get_deployment("tinychat").spec

It lives in the core, not in raypai.serving, because the store and lineage read it too and the core
never imports a component package. Stored as JSON (`to_dict` / `from_dict`); the deploy API returns
the same JSON under "spec".
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from types import MappingProxyType

from raypai.config import parse_config
from raypai.errors import ConfigError

DEFAULT_MAX_BATCH_SIZE = 16  # requests one engine step decodes together
DEFAULT_BATCH_WAIT_S = 0.01  # how long the engine thread waits to group arrivals into one batch
DEFAULT_ALIAS = "champion"  # the registry alias `register` moves and a deploy without a version resolves
# the engine a replica decodes with: raypai's own (raypai.serving.engine), vLLM (raypai.serving.vllm_server),
# or auto: vLLM when the deployment asks for GPUs and vLLM imports, else raypai's (resolved at create time)
ENGINES = ("raypai", "vllm", "auto")


@dataclass(frozen=True)
class Batching:
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    batch_wait_timeout_s: float = DEFAULT_BATCH_WAIT_S
    # admission by KV budget (raypai.serving.engine): rows x the longest prompt + max_tokens among them,
    # counted before a request joins; 16 rows of 4096 positions (a 0.5B Qwen2 in bf16: ~0.75 GiB of KV)
    max_kv_cells: int = 65536


@dataclass(frozen=True)
class DeploymentSpec:
    """A registered model version served under a name, an optional canary taking `canary_percent`
    of the traffic, and the resources of each replica. `previous_versions` (last 5 stable ones)
    are what rollback returns to."""

    model: str  # registered model name in the MLflow registry
    version: int  # the stable version
    canary_version: int | None = None
    canary_percent: int = 0
    previous_versions: tuple[int, ...] = ()
    replicas: int = 1
    autoscaling: dict | None = None  # Ray Serve autoscaling_config; replaces `replicas` when set
    cpus: float = 1.0
    gpus: float = 0.0
    batching: Batching = field(default_factory=Batching)
    canary_policy: dict | None = None  # raypai.serving.canary.CanaryPolicy fields; None: its defaults
    # back-pressure and time limits (Ray Serve deployment options; docs/serving.md)
    max_ongoing_requests: int = 64  # per replica, its engine's waiting requests included
    max_queued_requests: int = 128  # waiting at the router for a replica; past it 503 + Retry-After
    request_timeout_s: float = 300.0  # one answer (a stream included), then 504 and its engine row freed
    drain_timeout_s: float = 60.0  # a replica being removed finishes its requests for up to this long
    engine: str = "auto"  # one of ENGINES; the control plane stores the one `auto` resolved to

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ConfigError(
                [f"engine must be one of {', '.join(ENGINES)} (got {self.engine!r})"], what="deployment spec"
            )

    def served(self) -> list[tuple[int, str]]:
        """(version, role) of every version with a Serve application: the stable one, then the canary."""
        out = [(self.version, "stable")]
        if self.canary_version is not None:
            out.append((self.canary_version, "canary"))
        return out

    def versions(self) -> set[int]:
        return {v for v, _ in self.served()}

    def with_canary(self, version: int | None, percent: int = 0) -> "DeploymentSpec":
        """The spec with `version` as the canary (None: no canary) at `percent` of the traffic."""
        return replace(self, canary_version=version, canary_percent=percent if version is not None else 0)

    def promoted(self) -> "DeploymentSpec":
        """The canary as the stable version; the old stable version joins `previous_versions`."""
        return replace(
            self,
            version=self.canary_version,
            canary_version=None,
            canary_percent=0,
            previous_versions=(*self.previous_versions, self.version)[-5:],
        )

    def rolled_back(self) -> "DeploymentSpec":
        """The last previous stable version as the stable one again (no canary)."""
        *rest, prev = self.previous_versions
        return replace(self, version=prev, previous_versions=tuple(rest), canary_version=None, canary_percent=0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["previous_versions"] = list(self.previous_versions)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DeploymentSpec":
        """A spec from its stored JSON; a malformed one is a ConfigError naming every bad field."""
        return parse_config(cls, d, what="deployment spec")


def _field_defaults(cls) -> dict:
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


# Every deploy default, read from the two dataclasses above and nowhere else: the `raypai deploy create`
# options, the deploy API's schema, `Controller.create` and the `deploy` step take theirs from here
# (replicas, cpus, gpus, max_batch_size, batch_wait_timeout_s, ...; batching's fields at top level).
DEFAULTS = MappingProxyType({**_field_defaults(DeploymentSpec), **_field_defaults(Batching)})

__all__ = [
    "DeploymentSpec",
    "Batching",
    "DEFAULTS",
    "DEFAULT_ALIAS",
    "ENGINES",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_BATCH_WAIT_S",
]
