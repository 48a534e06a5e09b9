"""The metrics registry and its Prometheus text exposition."""

from __future__ import annotations

import pytest

from apomesh.runtime.metrics import DaemonMetrics, Registry


def test_counters_gauges_and_histograms_render_in_the_text_format() -> None:
    registry = Registry()
    requests = registry.counter("demo_requests_total", "Requests.\nBy path.", ["path"])
    requests.labels('/a"b').inc()
    requests.labels('/a"b').inc(2)
    depth = registry.gauge("demo_depth", "Queue depth.")
    depth.set(5)
    depth.dec()
    latency = registry.histogram("demo_seconds", "Latency.", buckets=[0.1, 1.0])
    for value in (0.05, 0.5, 3.0):
        latency.observe(value)
    assert registry.render().splitlines() == [
        "# HELP demo_requests_total Requests.\\nBy path.",
        "# TYPE demo_requests_total counter",
        'demo_requests_total{path="/a\\"b"} 3',
        "# HELP demo_depth Queue depth.",
        "# TYPE demo_depth gauge",
        "demo_depth 4",
        "# HELP demo_seconds Latency.",
        "# TYPE demo_seconds histogram",
        'demo_seconds_bucket{le="0.1"} 1',
        'demo_seconds_bucket{le="1"} 2',
        'demo_seconds_bucket{le="+Inf"} 3',
        "demo_seconds_sum 3.55",
        "demo_seconds_count 3",
    ]


def test_misuse_is_refused() -> None:
    registry = Registry()
    counter = registry.counter("demo_total", "Demo.", ["kind"])
    with pytest.raises(ValueError):
        counter.inc()  # needs its label
    with pytest.raises(ValueError):
        counter.labels("a").inc(-1)
    with pytest.raises(ValueError):
        counter.labels("a", "b")
    with pytest.raises(ValueError):
        registry.gauge("demo_total", "Twice.")


def test_the_daemon_metrics_are_all_apomesh_names() -> None:
    metrics = DaemonMetrics()
    metrics.sessions.replace({("running",): 2, ("recoverable",): 1})
    metrics.resumes.labels("worker_lost").inc()
    with metrics.append_seconds.time():
        pass
    text = metrics.render()
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert names == {
        "apomesh_sessions",
        "apomesh_agents",
        "apomesh_events_appended_total",
        "apomesh_append_seconds",
        "apomesh_heartbeats_received_total",
        "apomesh_workers_alive",
        "apomesh_workers_lost_total",
        "apomesh_resumes_total",
        "apomesh_journal_hits_total",
        "apomesh_recoverable_sessions",
        "apomesh_fenced_reports_total",
        "apomesh_snapshot_bytes_total",
        "apomesh_append_conflicts_total",
        "apomesh_control_requests_dropped_total",
        "apomesh_dispatches_refused_total",
        "apomesh_placement_waits_total",
        "apomesh_model_calls_total",
        "apomesh_model_call_seconds",
        "apomesh_model_tokens_total",
    }
    assert 'apomesh_sessions{state="running"} 2' in text
    assert 'apomesh_resumes_total{path="worker_lost"} 1' in text
    assert metrics.append_seconds.count() == 1


def test_a_model_call_is_counted_with_its_latency_and_tokens() -> None:
    metrics = DaemonMetrics()
    metrics.observe_model_call("openai", "m", 0.25, 12, 3, "ok")
    metrics.observe_model_call("openai", "m", 1.5, 0, 0, "error")
    text = metrics.render()
    assert 'apomesh_model_calls_total{provider="openai",model="m",outcome="ok"} 1' in text
    assert 'apomesh_model_calls_total{provider="openai",model="m",outcome="error"} 1' in text
    assert 'apomesh_model_tokens_total{provider="openai",model="m",kind="prompt"} 12' in text
    assert 'apomesh_model_tokens_total{provider="openai",model="m",kind="completion"} 3' in text
    assert 'apomesh_model_call_seconds_count{provider="openai",model="m"} 2' in text
