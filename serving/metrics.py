"""Serving metrics, exported through Ray's metrics: every Ray node's metrics agent serves them to
Prometheus (`ray_` prefixed, on the node's metrics export port), and the Ray dashboard's Metrics
view charts them once Prometheus and Grafana are set up for it (docs/serving.md, "Metrics").

    raypai_serve_queue_depth{deployment, version}        requests a replica holds, not yet admitted
    raypai_serve_inflight_rows{deployment, version}      sequences in a replica's running batch
    raypai_serve_rejections_total{reason}                requests answered with an error, by its code
    raypai_serve_ttft_seconds{deployment, version}       arrival at the replica -> first token (histogram)
    raypai_serve_decode_tokens_per_s{deployment, version} per request, first token -> last (histogram)
    raypai_serve_generated_tokens_total{deployment, version}  tokens produced (rate(): tokens/s)

Recording is a no-op outside a Ray process (an engine built in a test or a script)."""

from __future__ import annotations

import threading

_LOCK = threading.Lock()
_METRICS: dict | None = None
TTFT_BOUNDS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
RATE_BOUNDS = [1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0]
TAGS = ("deployment", "version")


def _metrics() -> dict | None:
    global _METRICS
    import ray

    if not ray.is_initialized():
        return None
    with _LOCK:
        if _METRICS is None:
            from ray.util.metrics import Counter, Gauge, Histogram

            _METRICS = {
                "queue": Gauge("raypai_serve_queue_depth", "requests a replica holds, not yet admitted", TAGS),
                "rows": Gauge("raypai_serve_inflight_rows", "sequences in a replica's running batch", TAGS),
                "rejected": Counter(
                    "raypai_serve_rejections", "requests answered with an error, by its code", ("reason",)
                ),
                "ttft": Histogram(
                    "raypai_serve_ttft_seconds", "arrival at the replica to the first token", TTFT_BOUNDS, TAGS
                ),
                "rate": Histogram(
                    "raypai_serve_decode_tokens_per_s", "a request's tokens/s after its first", RATE_BOUNDS, TAGS
                ),
                "tokens": Counter("raypai_serve_generated_tokens", "tokens produced", TAGS),
            }
    return _METRICS


def rejected(reason: str) -> None:
    """A request answered with an error: `reason` is its code (`invalid_api_key`, `overloaded`, ...)."""
    m = _metrics()
    if m is not None:
        m["rejected"].inc(1, {"reason": reason or "unknown"})


class ReplicaMetrics:
    """What one model-server replica records, tagged with its deployment and version."""

    def __init__(self, deployment: str, version: int):
        self.tags = {"deployment": deployment, "version": str(version)}
        self._last: tuple[int, int] | None = None

    def load(self, waiting: int, rows: int) -> None:
        """Queue depth and running rows, sent only when they change (the engine loop calls it each turn)."""
        if (waiting, rows) == self._last:
            return
        self._last = (waiting, rows)
        m = _metrics()
        if m is not None:
            m["queue"].set(waiting, self.tags)
            m["rows"].set(rows, self.tags)

    def first_token(self, seconds: float) -> None:
        m = _metrics()
        if m is not None:
            m["ttft"].observe(seconds, self.tags)

    def finished(self, tokens: int, decode_seconds: float) -> None:
        m = _metrics()
        if m is None:
            return
        if tokens:
            m["tokens"].inc(tokens, self.tags)
        if tokens > 1 and decode_seconds > 0:
            m["rate"].observe((tokens - 1) / decode_seconds, self.tags)


def deployment_of(app: str | None, fallback: str) -> str:
    """The deployment name in a Serve app name `raypai-<deployment>-v<version>` (raypai.serving.router.app_name)."""
    if app and app.startswith("raypai-") and "-v" in app:
        return app[len("raypai-") : app.rindex("-v")]
    return fallback
