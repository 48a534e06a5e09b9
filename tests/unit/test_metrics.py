"""The daemon's metrics: names, labels and what one model call, tool call or session end adds,
as prometheus-client renders them (imported at the first scrape, not at a daemon's start)."""

from __future__ import annotations

import platform
import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from apomesh._version import __version__
from apomesh.runtime.metrics import DaemonMetrics


def samples(metrics: DaemonMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render())
        for s in family.samples
    }


def test_a_model_call_counts_its_latency_outcome_and_tokens() -> None:
    metrics = DaemonMetrics()
    metrics.observe_model_call("openai", "gpt-x", 0.7, 120, 30, "ok")
    metrics.observe_model_call("openai", "gpt-x", 3.0, 100, 0, "rate_limited")
    found = samples(metrics)
    ok = (("model", "gpt-x"), ("outcome", "ok"), ("provider", "openai"))
    limited = (("model", "gpt-x"), ("outcome", "rate_limited"), ("provider", "openai"))
    assert found[("apomesh_model_call_seconds_count", ok)] == 1
    assert found[("apomesh_model_call_seconds_sum", ok)] == 0.7
    assert found[("apomesh_model_call_seconds_bucket", (("le", "1.0"), *ok))] == 1
    assert found[("apomesh_model_call_seconds_count", limited)] == 1
    tokens = "apomesh_model_tokens_total"
    assert metrics.value(tokens, provider="openai", model="gpt-x", kind="prompt") == 220
    assert metrics.value(tokens, provider="openai", model="gpt-x", kind="completion") == 30


def test_tool_calls_and_session_ends_are_histograms_by_outcome() -> None:
    metrics = DaemonMetrics()
    metrics.observe_tool_call("fs.write", 0.002, "ok")
    metrics.observe_tool_call("fs.write", 0.5, "error")
    metrics.observe_session_end("completed", 42.0)
    metrics.observe_session_end("failed", 3.0)
    count = "apomesh_tool_call_seconds_count"
    assert metrics.value(count, tool="fs.write", outcome="ok") == 1
    assert metrics.value(count, tool="fs.write", outcome="error") == 1
    assert metrics.value("apomesh_session_seconds_count", status="completed") == 1
    assert metrics.value("apomesh_session_seconds_sum", status="completed") == 42.0
    assert metrics.value("apomesh_session_seconds_count", status="cancelled") == 0


def test_build_info_and_gauges_replaced_whole() -> None:
    metrics = DaemonMetrics()
    metrics.sessions.replace({("running",): 2, ("paused",): 1})
    metrics.sessions.replace({("running",): 1})
    found = samples(metrics)
    assert found[("apomesh_sessions", (("state", "running"),))] == 1
    assert ("apomesh_sessions", (("state", "paused"),)) not in found
    build = (("python", platform.python_version()), ("version", __version__))
    assert found[("apomesh_build_info", build)] == 1


def test_every_metric_is_an_apomesh_name_and_two_daemons_do_not_share_values() -> None:
    first, second = DaemonMetrics(), DaemonMetrics()
    first.resumes.labels("worker_lost").inc()
    text = first.render()
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert names and all(name.startswith("apomesh_") for name in names)
    assert "_created" not in text
    assert first.value("apomesh_resumes_total", path="worker_lost") == 1
    assert second.value("apomesh_resumes_total", path="worker_lost") == 0


def test_a_daemon_starts_without_importing_prometheus_client() -> None:
    # ~9 ms of every restart: the metrics are plain numbers until /metrics is first scraped.
    probe = (
        "import sys, apomesh.runtime.node, apomesh.api.server;"
        "from apomesh.runtime.metrics import DaemonMetrics;"
        "m = DaemonMetrics(); m.resumes.labels('auto').inc(); m.append_seconds.observe(0.1);"
        "assert 'prometheus_client' not in sys.modules, 'imported';"
        "m.render(); assert 'prometheus_client' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)


def test_a_bucket_counts_what_does_not_exceed_its_bound() -> None:
    metrics = DaemonMetrics()
    for seconds in (0.001, 0.0011, 5.0, 11.0):
        metrics.append_seconds.observe(seconds)
    bucket = "apomesh_append_seconds_bucket"
    assert metrics.value(bucket, le="0.0005") == 0
    assert metrics.value(bucket, le="0.001") == 1
    assert metrics.value(bucket, le="0.0025") == 2
    assert metrics.value(bucket, le="5.0") == 3
    assert metrics.value(bucket, le="10.0") == 3
    assert metrics.value(bucket, le="+Inf") == 4
    assert metrics.value("apomesh_append_seconds_count") == 4
    assert found_sum(metrics) == 0.001 + 0.0011 + 5.0 + 11.0


def found_sum(metrics: DaemonMetrics) -> float:
    return samples(metrics)[("apomesh_append_seconds_sum", ())]
