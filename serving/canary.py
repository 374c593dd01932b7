"""Canary judgement: a canary version is compared with the stable version on the traffic they both
serve, and the comparison decides promotion and rollback.

    policy = CanaryPolicy.from_spec(spec.canary_policy)          # spec: raypai.deployment.DeploymentSpec
    windows = Windows()
    windows.observe("chat", 3, ok=True, seconds=0.12)       # the router, per answered request
    decision, reason, stats = judge(policy, windows.summary("chat", 2), windows.summary("chat", 3))

Per version, over the last `window_s` seconds: requests, errors (5xx answers and failed calls; a
4xx is the client's fault and does not count) and the 95th-percentile latency (nearest rank: the
ceil(0.95 n)-th smallest, so of 20 requests the 19th: one outlier in 20 is the maximum, not the
p95). The canary is
- `insufficient` while it has answered fewer than `min_requests` requests in the window;
- `worse` when its error rate exceeds the stable version's by more than `max_error_rate_increase`,
  or (with at least `min_requests` on both sides) its p95 latency is over `max_latency_ratio` x the
  stable version's;
- `healthy` otherwise.
The router judges after answering (at most once a second per deployment), records each changed
verdict in the metadata store (`canary_checks`), and with `auto_rollback` takes a `worse` canary
out of the routing table at once. Promotion (`PATCH … promote`) goes ahead only on a `healthy`
verdict, unless forced.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, fields

from raypai.errors import ConfigError

__all__ = ["CanaryPolicy", "Windows", "judge"]


@dataclass(frozen=True)
class CanaryPolicy:
    window_s: float = 300.0
    min_requests: int = 20
    max_error_rate_increase: float = 0.02
    max_latency_ratio: float = 1.5
    auto_rollback: bool = True

    @classmethod
    def from_spec(cls, value: dict | None) -> "CanaryPolicy":
        value = dict(value or {})
        known = {f.name for f in fields(cls)}
        problems = [f"unknown field {k!r} (known: {', '.join(sorted(known))})" for k in value if k not in known]
        if problems:
            raise ConfigError(problems, what="canary_policy")
        policy = cls(**value)
        if (
            policy.window_s <= 0
            or policy.min_requests < 1
            or policy.max_latency_ratio < 1
            or not 0 <= policy.max_error_rate_increase <= 1
        ):
            raise ConfigError(
                [
                    f"{asdict(policy)}: need window_s > 0, min_requests >= 1, max_latency_ratio >= 1 "
                    "and 0 <= max_error_rate_increase <= 1"
                ],
                what="canary_policy",
            )
        return policy

    def to_dict(self) -> dict:
        return asdict(self)


class Windows:
    """Recent outcomes per (deployment, version): (monotonic time, ok, seconds)."""

    def __init__(self, keep_s: float = 3600.0, max_per_version: int = 100_000):
        self.keep_s, self.max_per_version = keep_s, max_per_version
        self.seen: dict[tuple[str, int], deque] = {}

    def observe(self, name: str, version: int, ok: bool, seconds: float, now: float | None = None) -> None:
        q = self.seen.setdefault((name, version), deque(maxlen=self.max_per_version))
        now = time.monotonic() if now is None else now
        q.append((now, ok, seconds))
        while q and q[0][0] < now - self.keep_s:
            q.popleft()

    def summary(self, name: str, version: int, window_s: float, now: float | None = None) -> dict:
        now = time.monotonic() if now is None else now
        recent = [(ok, s) for t, ok, s in self.seen.get((name, version), ()) if t >= now - window_s]
        n = len(recent)
        errors = sum(1 for ok, _ in recent if not ok)
        latencies = sorted(s for _, s in recent)
        p95 = latencies[(95 * n + 99) // 100 - 1] if n else None  # nearest rank: ceil(0.95 n), in integers
        return {
            "version": version,
            "requests": n,
            "errors": errors,
            "error_rate": errors / n if n else 0.0,
            "p95_ms": round(p95 * 1e3, 2) if p95 is not None else None,
        }


def judge(policy: CanaryPolicy, stable: dict, canary: dict) -> tuple[str, str]:
    """(decision, reason) for `canary` against `stable` (two `Windows.summary` results)."""
    window = f"in the last {policy.window_s:.0f} s"
    if canary["requests"] < policy.min_requests:
        return "insufficient", (
            f"the canary answered {canary['requests']} of the {policy.min_requests} requests a verdict needs {window}"
        )
    limit = stable["error_rate"] + policy.max_error_rate_increase
    if canary["error_rate"] > limit:
        return "worse", (
            f"canary error rate {canary['error_rate']:.1%} ({canary['errors']}/{canary['requests']}) "
            f"exceeds the stable version's {stable['error_rate']:.1%} by more than "
            f"{policy.max_error_rate_increase:.1%} {window}"
        )
    if (
        stable["requests"] >= policy.min_requests
        and stable["p95_ms"]
        and canary["p95_ms"] is not None
        and canary["p95_ms"] > policy.max_latency_ratio * stable["p95_ms"]
    ):
        return "worse", (
            f"canary p95 latency {canary['p95_ms']:.0f} ms is over {policy.max_latency_ratio:g}x the "
            f"stable version's {stable['p95_ms']:.0f} ms {window}"
        )
    return "healthy", (
        f"canary error rate {canary['error_rate']:.1%} vs stable {stable['error_rate']:.1%}, "
        f"p95 {canary['p95_ms']} ms vs {stable['p95_ms']} ms over {canary['requests']} canary "
        f"requests {window}"
    )
