"""``DaemonMetrics``: the daemon's Prometheus metrics, all named ``apomesh_*``, on
``prometheus-client``, each daemon with its own registry that ``/metrics`` renders.

Call sites update a metric through its attribute (``metrics.resumes.labels("auto").inc()``), or
through the ``observe_*`` methods for what one event touches several of: a model call (latency,
tokens, outcome), a tool call (latency, outcome) and a session's end (duration, status). Updates
are thread-safe (prometheus-client takes a lock per child). The ``_created`` series
prometheus-client adds to every counter and histogram are switched off (process-wide): nothing
reads them and they would double every counter's lines. docs/api.md lists every metric served; a
test scrapes a real daemon to keep that list true.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from apomesh._version import __version__
from apomesh.core.events import Event, event_name

prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

APPEND_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Seconds of one append to the log: sub-millisecond on a local server, seconds when degraded."""

MODEL_CALL_BUCKETS: tuple[float, ...] = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
"""Seconds of one model call: a local model's short answer to a long remote generation."""

TOOL_CALL_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.5,
    1.0,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
"""Seconds of one tool call: a file read to a long-running command."""

SESSION_BUCKETS: tuple[float, ...] = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0)
"""Seconds from a session's start to its end (a paused session waits for a human: hours)."""


class LabelledGauge(Gauge):
    """A gauge whose whole labelled state is set at once (``replace``): the sessions and agents a
    daemon holds are counted afresh at every scrape, and a label set not counted any more goes."""

    def replace(self, values: Mapping[tuple[str, ...], float]) -> None:
        self.clear()
        for labels, value in values.items():
            self.labels(*labels).set(value)


class DaemonMetrics:
    """The daemon's metrics. The daemon creates one and updates it; ``/metrics`` renders it."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.build = Info(
            "apomesh_build", "The apomesh version and Python this daemon runs.", registry=r
        )
        self.build.info({"version": __version__, "python": platform.python_version()})
        self.sessions = LabelledGauge(
            "apomesh_sessions", "Sessions the daemon holds, by status.", ["state"], registry=r
        )
        self.agents = LabelledGauge(
            "apomesh_agents", "Agents of live sessions, by phase.", ["phase"], registry=r
        )
        self.session_seconds = Histogram(
            "apomesh_session_seconds",
            "Seconds from a session's start to its end, by how it ended (completed, failed,"
            " cancelled); its count is the sessions ended.",
            ["status"],
            buckets=SESSION_BUCKETS,
            registry=r,
        )
        self.model_call_seconds = Histogram(
            "apomesh_model_call_seconds",
            "Seconds one model call took, by provider, model and outcome; its count is the calls.",
            ["provider", "model", "outcome"],
            buckets=MODEL_CALL_BUCKETS,
            registry=r,
        )
        self.model_tokens = Counter(
            "apomesh_model_tokens_total",
            "Tokens of model calls, by provider, model and kind (prompt, completion).",
            ["provider", "model", "kind"],
            registry=r,
        )
        self.tool_call_seconds = Histogram(
            "apomesh_tool_call_seconds",
            "Seconds one tool call ran on its worker, by tool and outcome (ok, error); its count"
            " is the calls.",
            ["tool", "outcome"],
            buckets=TOOL_CALL_BUCKETS,
            registry=r,
        )
        self.events_appended = Counter(
            "apomesh_events_appended_total",
            "Events appended to the log, by kind.",
            ["kind"],
            registry=r,
        )
        self._appended_by_kind: dict[type, Any] = {}
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        """Labelled children by (metric, label values), each looked up once (``_child``)."""
        self.append_seconds = Histogram(
            "apomesh_append_seconds",
            "Seconds one (batched) append to the log took.",
            buckets=APPEND_BUCKETS,
            registry=r,
        )
        self.heartbeats_received = Counter(
            "apomesh_heartbeats_received_total", "Worker heartbeats received.", registry=r
        )
        self.workers_alive = Gauge(
            "apomesh_workers_alive", "Workers currently considered alive.", registry=r
        )
        self.workers_lost = Counter(
            "apomesh_workers_lost_total",
            "Workers declared lost after missed heartbeats.",
            registry=r,
        )
        self.resumes = Counter(
            "apomesh_resumes_total",
            "Agent and session resumes, by path (worker_lost, auto, operator).",
            ["path"],
            registry=r,
        )
        self.journal_hits = Counter(
            "apomesh_journal_hits_total",
            "Side-effecting tool calls served from the journal.",
            registry=r,
        )
        self.recoverable_sessions = Gauge(
            "apomesh_recoverable_sessions", "Sessions on the recoverable list.", registry=r
        )
        self.fenced_reports = Counter(
            "apomesh_fenced_reports_total",
            "Worker reports rejected for a stale epoch or identity.",
            registry=r,
        )
        self.snapshot_bytes = Counter(
            "apomesh_snapshot_bytes_total",
            "Bytes of snapshot records written to LMDB.",
            registry=r,
        )
        self.dropped_requests = Counter(
            "apomesh_control_requests_dropped_total",
            "Control requests dropped unanswered: not on a worker's bound subject, or with a reply"
            " subject outside that worker's own inbox.",
            registry=r,
        )
        self.dispatches_refused = Counter(
            "apomesh_dispatches_refused_total",
            "Dispatches a worker did not take, by reason: full (it ran as many agents as it may),"
            " refused (a stale epoch, an undecodable dispatch) or unanswered.",
            ["reason"],
            registry=r,
        )
        self.placement_waits = Counter(
            "apomesh_placement_waits_total",
            "Agents that waited for room because every worker able to run them was full.",
            registry=r,
        )
        self.append_conflicts = Counter(
            "apomesh_append_conflicts_total",
            "Sessions this daemon stopped driving because another writer appended to their log.",
            registry=r,
        )

    def count_appended(self, events: Iterable[Event]) -> None:
        """Count appended events by kind (``apomesh_events_appended_total``); each kind's
        counter is looked up once."""
        children = self._appended_by_kind
        for event in events:
            kind = type(event)
            child = children.get(kind)
            if child is None:
                child = children[kind] = self.events_appended.labels(event_name(event))
            child.inc()

    def observe_model_call(
        self,
        provider: str,
        model: str,
        seconds: float,
        prompt_tokens: int,
        completion_tokens: int,
        outcome: str,
    ) -> None:
        """One model call a worker made: how long it took, the tokens it used, how it ended
        (``ok``, or the kind of error)."""
        self._child(self.model_call_seconds, provider, model, outcome).observe(seconds)
        if prompt_tokens:
            self._child(self.model_tokens, provider, model, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self._child(self.model_tokens, provider, model, "completion").inc(completion_tokens)

    def observe_tool_call(self, tool: str, seconds: float, outcome: str) -> None:
        """One tool call a worker ran: how long it took and whether it returned (``ok``) or
        failed (``error``)."""
        self._child(self.tool_call_seconds, tool, outcome).observe(seconds)

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once (a step reports several of them)."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_session_end(self, status: str, seconds: float) -> None:
        """A session this daemon drove ended (``completed``, ``failed``, ``cancelled``) after
        ``seconds`` since it started (on any daemon)."""
        self.session_seconds.labels(status).observe(max(seconds, 0.0))

    def value(self, name: str, **labels: str) -> float:
        """The current value of one sample (``apomesh_resumes_total``, ``path="auto"``), 0 when
        it has none yet."""
        found = self.registry.get_sample_value(name, labels)
        return found if found is not None else 0.0

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        return prometheus_client.generate_latest(self.registry).decode("utf-8")
