"""``DaemonMetrics``: the daemon's Prometheus metrics, all named ``apomesh_*``, each daemon with
its own set that ``/metrics`` renders.

Call sites update a metric through its attribute (``metrics.resumes.labels("auto").inc()``), or
through the ``observe_*`` methods for what one event touches several of: a model call (latency,
tokens, outcome), a tool call (latency, outcome) and a session's end (duration, status). The
values are plain numbers the daemon's event loop updates (the only thread that does), so an update
costs a dict lookup and an addition, not a lock. ``render`` hands them to ``prometheus-client``,
imported at the first scrape only (a daemon's start does without its ~9 ms of imports), which
writes the text exposition. No ``_created`` series: nothing reads them and they would double every
counter's lines. docs/api.md lists every metric served; a test scrapes a real daemon to keep that
list true.
"""

from __future__ import annotations

import bisect
import platform
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

from apomesh._version import __version__
from apomesh.core.events import Event, event_name

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


class Value:
    """One series: a counter's or a gauge's number."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def set(self, value: float) -> None:
        self.value = float(value)


class Buckets:
    """One histogram series: a count per bucket (each observation in the first bucket whose bound
    it does not exceed, the last one unbounded), their sum and the sum of the observations."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class Metric:
    """A metric with its series by label values (one series with no labels, updated on the
    metric itself: ``metric.inc()``). ``kind`` is ``counter``, ``gauge`` or ``histogram``; a
    counter's ``name`` ends in ``_total``, as its sample does."""

    def __init__(
        self,
        kind: str,
        name: str,
        documentation: str,
        labels: Iterable[str] = (),
        *,
        buckets: tuple[float, ...] = (),
    ) -> None:
        self.kind = kind
        self.name = name
        self.documentation = documentation
        self.label_names = tuple(labels)
        self.buckets = buckets
        self.series: dict[tuple[str, ...], Any] = {}
        if not self.label_names:
            self._only = self.labels()

    def labels(self, *values: str) -> Any:
        """The series of these label values (a ``Value``, or ``Buckets`` for a histogram),
        created at its first use."""
        if len(values) != len(self.label_names):
            raise ValueError(f"{self.name} takes the labels {self.label_names}, not {values}")
        found = self.series.get(values)
        if found is None:
            found = self.series[values] = (
                Buckets(self.buckets) if self.kind == "histogram" else Value()
            )
        return found

    def inc(self, amount: float = 1.0) -> None:
        self._only.inc(amount)

    def set(self, value: float) -> None:
        self._only.set(value)

    def observe(self, value: float) -> None:
        self._only.observe(value)

    def replace(self, values: Mapping[tuple[str, ...], float]) -> None:
        """Set a gauge's whole labelled state at once: the sessions and agents a daemon holds are
        counted afresh at every scrape, and a label set not counted any more goes."""
        self.series.clear()
        for labels, value in values.items():
            self.labels(*labels).set(value)

    def samples(self) -> Iterator[tuple[str, dict[str, str], float]]:
        """(sample name, labels, value) of every series, as the text exposition names them."""
        for values, series in self.series.items():
            labels = dict(zip(self.label_names, values, strict=True))
            if isinstance(series, Value):
                yield self.name, labels, series.value
                continue
            total = 0
            for bound, count in zip((*series.bounds, float("inf")), series.counts, strict=True):
                total += count
                yield f"{self.name}_bucket", {**labels, "le": _bound_text(bound)}, float(total)
            yield f"{self.name}_count", labels, float(total)
            yield f"{self.name}_sum", labels, series.sum


def _bound_text(bound: float) -> str:
    """A bucket's ``le`` label as Prometheus writes it (``0.5``, ``1.0``, ``+Inf``)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


class DaemonMetrics:
    """The daemon's metrics. The daemon creates one and updates it; ``/metrics`` renders it."""

    def __init__(self) -> None:
        self.metrics: list[Metric] = []
        self.build = {"version": __version__, "python": platform.python_version()}
        """The labels of ``apomesh_build_info`` (the version and Python this daemon runs)."""
        self.sessions = self._add(
            Metric("gauge", "apomesh_sessions", "Sessions the daemon holds, by status.", ["state"])
        )
        self.agents = self._add(
            Metric("gauge", "apomesh_agents", "Agents of live sessions, by phase.", ["phase"])
        )
        self.session_seconds = self._add(
            Metric(
                "histogram",
                "apomesh_session_seconds",
                "Seconds from a session's start to its end, by how it ended (completed, failed,"
                " cancelled); its count is the sessions ended.",
                ["status"],
                buckets=SESSION_BUCKETS,
            )
        )
        self.model_call_seconds = self._add(
            Metric(
                "histogram",
                "apomesh_model_call_seconds",
                "Seconds one model call took, by provider, model and outcome; its"
                " count is the calls.",
                ["provider", "model", "outcome"],
                buckets=MODEL_CALL_BUCKETS,
            )
        )
        self.model_tokens = self._add(
            Metric(
                "counter",
                "apomesh_model_tokens_total",
                "Tokens of model calls, by provider, model and kind (prompt, completion).",
                ["provider", "model", "kind"],
            )
        )
        self.tool_call_seconds = self._add(
            Metric(
                "histogram",
                "apomesh_tool_call_seconds",
                "Seconds one tool call ran on its worker, by tool and outcome (ok,"
                " error); its count"
                " is the calls.",
                ["tool", "outcome"],
                buckets=TOOL_CALL_BUCKETS,
            )
        )
        self.events_appended = self._add(
            Metric(
                "counter",
                "apomesh_events_appended_total",
                "Events appended to the log, by kind.",
                ["kind"],
            )
        )
        self._appended_by_kind: dict[type, Any] = {}
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        """Labelled children by (metric, label values), each looked up once (``_child``)."""
        self.append_seconds = self._add(
            Metric(
                "histogram",
                "apomesh_append_seconds",
                "Seconds one (batched) append to the log took.",
                buckets=APPEND_BUCKETS,
            )
        )
        self.heartbeats_received = self._add(
            Metric("counter", "apomesh_heartbeats_received_total", "Worker heartbeats received.")
        )
        self.workers_alive = self._add(
            Metric("gauge", "apomesh_workers_alive", "Workers currently considered alive.")
        )
        self.workers_lost = self._add(
            Metric(
                "counter",
                "apomesh_workers_lost_total",
                "Workers declared lost after missed heartbeats.",
            )
        )
        self.resumes = self._add(
            Metric(
                "counter",
                "apomesh_resumes_total",
                "Agent and session resumes, by path (worker_lost, auto, operator).",
                ["path"],
            )
        )
        self.journal_hits = self._add(
            Metric(
                "counter",
                "apomesh_journal_hits_total",
                "Side-effecting tool calls served from the journal.",
            )
        )
        self.recoverable_sessions = self._add(
            Metric("gauge", "apomesh_recoverable_sessions", "Sessions on the recoverable list.")
        )
        self.fenced_reports = self._add(
            Metric(
                "counter",
                "apomesh_fenced_reports_total",
                "Worker reports rejected for a stale epoch or identity.",
            )
        )
        self.snapshot_bytes = self._add(
            Metric(
                "counter",
                "apomesh_snapshot_bytes_total",
                "Bytes of snapshot records written to LMDB.",
            )
        )
        self.dropped_requests = self._add(
            Metric(
                "counter",
                "apomesh_control_requests_dropped_total",
                "Control requests dropped unanswered: not on a worker's bound subject,"
                " or with a reply"
                " subject outside that worker's own inbox.",
            )
        )
        self.dispatches_refused = self._add(
            Metric(
                "counter",
                "apomesh_dispatches_refused_total",
                "Dispatches a worker did not take, by reason: full (it ran as many"
                " agents as it may),"
                " refused (a stale epoch, an undecodable dispatch) or unanswered.",
                ["reason"],
            )
        )
        self.placement_waits = self._add(
            Metric(
                "counter",
                "apomesh_placement_waits_total",
                "Agents that waited for room because every worker able to run them was full.",
            )
        )
        self.append_conflicts = self._add(
            Metric(
                "counter",
                "apomesh_append_conflicts_total",
                "Sessions this daemon stopped driving because another writer appended"
                " to their log.",
            )
        )

    def _add(self, metric: Metric) -> Metric:
        self.metrics.append(metric)
        return metric

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
        for metric in self.metrics:
            if name.startswith(metric.name):
                for sample, sample_labels, value in metric.samples():
                    if sample == name and sample_labels == labels:
                        return value
        return 0.0

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Exposition(self))
        return generate_latest(registry).decode("utf-8")


class _Exposition:
    """The daemon's metrics as ``prometheus-client`` metric families (a collector it renders)."""

    def __init__(self, metrics: DaemonMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            InfoMetricFamily,
        )
        from prometheus_client.utils import floatToGoString

        go_text = cast(Callable[[float], str], floatToGoString)  # as Prometheus writes a bound

        yield InfoMetricFamily(
            "apomesh_build", "The apomesh version and Python this daemon runs.", self.metrics.build
        )
        for metric in self.metrics.metrics:
            labels = list(metric.label_names)
            if metric.kind == "histogram":
                bounds = [go_text(b) for b in (*metric.buckets, float("inf"))]
                histogram = HistogramMetricFamily(metric.name, metric.documentation, labels=labels)
                for values, series in metric.series.items():
                    cumulative, total = [], 0
                    for bound, count in zip(bounds, series.counts, strict=True):
                        total += count
                        cumulative.append((bound, total))
                    histogram.add_metric(list(values), cumulative, series.sum)
                yield histogram
                continue
            if metric.kind == "counter":
                family: Any = CounterMetricFamily(
                    metric.name.removesuffix("_total"), metric.documentation, labels=labels
                )
            else:
                family = GaugeMetricFamily(metric.name, metric.documentation, labels=labels)
            for values, series in metric.series.items():
                family.add_metric(list(values), series.value)
            yield family
