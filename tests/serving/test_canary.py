"""Canary verdicts (raypai.serving.canary): the decision rule, with near-misses that must pass."""

import pytest

from raypai.errors import ConfigError
from raypai.serving.canary import CanaryPolicy, Windows, judge


def _windows(stable, canary, now=1000.0):
    """stable/canary: lists of (ok, seconds) observed within the last minute."""
    w = Windows()
    for version, seen in ((1, stable), (2, canary)):
        for i, (ok, s) in enumerate(seen):
            w.observe("chat", version, ok, s, now=now - 60 + i * 0.01)
    return w.summary("chat", 1, 300, now=now), w.summary("chat", 2, 300, now=now)


def test_verdicts_with_near_misses():
    policy = CanaryPolicy(min_requests=20, max_error_rate_increase=0.02, max_latency_ratio=1.5)
    fast_ok = [(True, 0.1)] * 100
    # too little canary traffic for a verdict
    assert judge(policy, *_windows(fast_ok, [(True, 0.1)] * 19))[0] == "insufficient"
    # errors: 1 in 50 (2%) against 0% is within the tolerance; 2 in 50 (4%) is not
    assert judge(policy, *_windows(fast_ok, [(False, 0.1)] + [(True, 0.1)] * 49))[0] == "healthy"
    decision, reason = judge(policy, *_windows(fast_ok, [(False, 0.1)] * 2 + [(True, 0.1)] * 48))
    assert decision == "worse" and "error rate 4.0%" in reason
    # the same canary error rate as a stable version that fails as often is not worse
    flaky = [(False, 0.1)] * 10 + [(True, 0.1)] * 90
    assert judge(policy, *_windows(flaky, [(False, 0.1)] * 5 + [(True, 0.1)] * 45))[0] == "healthy"
    # latency: p95 1.4x the stable's passes, 2x fails
    assert judge(policy, *_windows(fast_ok, [(True, 0.14)] * 50))[0] == "healthy"
    decision, reason = judge(policy, *_windows(fast_ok, [(True, 0.2)] * 50))
    assert decision == "worse" and "p95 latency 200 ms" in reason


def test_old_observations_leave_the_window():
    w = Windows()
    for i in range(30):
        w.observe("chat", 2, False, 0.1, now=100.0 + i)
    assert w.summary("chat", 2, 300, now=200.0)["errors"] == 30
    assert w.summary("chat", 2, 300, now=500.0)["requests"] == 0  # all older than 300 s


def test_policy_rejects_unknown_and_impossible_fields():
    assert CanaryPolicy.from_spec(None) == CanaryPolicy()
    with pytest.raises(ConfigError, match="unknown field 'min_request'"):
        CanaryPolicy.from_spec({"min_request": 5})
    with pytest.raises(ConfigError, match="max_latency_ratio >= 1"):
        CanaryPolicy.from_spec({"max_latency_ratio": 0.5})


def test_p95_is_the_nearest_rank_so_one_slow_request_in_twenty_is_not_the_p95():
    """Nearest-rank percentile: the ceil(0.95 n)-th smallest latency. Of 20 requests that is the 19th,
    so a single slow one (a replica's first request, a scheduling hiccup) is the maximum, not the p95,
    and does not make a canary `worse` at the default `min_requests` by itself; two slow ones do."""
    policy = CanaryPolicy(min_requests=20, max_latency_ratio=1.5)
    fast_ok = [(True, 0.1)] * 100
    stable, canary = _windows(fast_ok, [(True, 0.1)] * 19 + [(True, 0.9)])
    assert canary["p95_ms"] == 100.0
    assert judge(policy, stable, canary)[0] == "healthy"
    assert judge(policy, *_windows(fast_ok, [(True, 0.1)] * 18 + [(True, 0.9)] * 2))[0] == "worse"
    # 100 requests: the 95th smallest; latencies 1..100 ms give 95 ms (the old index gave 96)
    w = Windows()
    for i in range(100):
        w.observe("chat", 1, True, (i + 1) / 1000, now=10.0)
    assert w.summary("chat", 1, 300, now=10.0)["p95_ms"] == 95.0
