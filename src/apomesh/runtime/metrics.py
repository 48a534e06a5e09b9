"""A small metrics registry (counters, gauges, histograms, with labels) rendered in the Prometheus
text exposition format, and ``DaemonMetrics``: the daemon's own metrics, all named ``apomesh_*``.

Updates are thread-safe (the daemon touches some metrics from worker threads) and cheap: one lock
and one dict lookup. A metric with labels is updated through ``labels(...)``, which returns the
child for that label set; a metric without labels is updated directly.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from time import perf_counter

LabelValues = tuple[str, ...]

DEFAULT_BUCKETS: tuple[float, ...] = (
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


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _labels_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape_label(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help
        self.label_names = tuple(labels)
        self._lock = threading.Lock()

    def _key(self, values: Sequence[str]) -> LabelValues:
        if len(values) != len(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {tuple(values)}")
        return tuple(str(v) for v in values)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {_escape_help(self.help)}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    """A value that only goes up."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, labels)
        self._values: dict[LabelValues, float] = {} if labels else {(): 0.0}

    def labels(self, *values: str) -> _CounterChild:
        return _CounterChild(self, self._key(values))

    def inc(self, amount: float = 1.0) -> None:
        self._inc((), amount)

    def _inc(self, key: LabelValues, amount: float) -> None:
        if amount < 0:
            raise ValueError("a counter cannot go down")
        if key == () and self.label_names:
            raise ValueError(f"{self.name} needs labels {self.label_names}")
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, *values: str) -> float:
        with self._lock:
            return self._values.get(self._key(values), 0.0)

    def samples(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [f"{self.name}{_labels_text(self.label_names, k)} {_number(v)}" for k, v in items]


class _CounterChild:
    def __init__(self, parent: Counter, key: LabelValues) -> None:
        self._parent = parent
        self._key = key

    def inc(self, amount: float = 1.0) -> None:
        self._parent._inc(self._key, amount)


class Gauge(_Metric):
    """A value that goes up and down, or is set."""

    kind = "gauge"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, labels)
        self._values: dict[LabelValues, float] = {} if labels else {(): 0.0}

    def labels(self, *values: str) -> _GaugeChild:
        return _GaugeChild(self, self._key(values))

    def set(self, value: float) -> None:
        self._set(self._key(()), value)

    def inc(self, amount: float = 1.0) -> None:
        self._add(self._key(()), amount)

    def dec(self, amount: float = 1.0) -> None:
        self._add(self._key(()), -amount)

    def _set(self, key: LabelValues, value: float) -> None:
        with self._lock:
            self._values[key] = float(value)

    def _add(self, key: LabelValues, amount: float) -> None:
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def replace(self, values: dict[LabelValues, float]) -> None:
        """Set every labelled value at once (label sets not given disappear)."""
        fresh = {self._key(k): float(v) for k, v in values.items()}
        with self._lock:
            self._values = fresh

    def value(self, *values: str) -> float:
        with self._lock:
            return self._values.get(self._key(values), 0.0)

    def samples(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [f"{self.name}{_labels_text(self.label_names, k)} {_number(v)}" for k, v in items]


class _GaugeChild:
    def __init__(self, parent: Gauge, key: LabelValues) -> None:
        self._parent = parent
        self._key = key

    def set(self, value: float) -> None:
        self._parent._set(self._key, value)

    def inc(self, amount: float = 1.0) -> None:
        self._parent._add(self._key, amount)

    def dec(self, amount: float = 1.0) -> None:
        self._parent._add(self._key, -amount)


class _Series:
    __slots__ = ("buckets", "count", "total")

    def __init__(self, size: int) -> None:
        self.buckets = [0] * size
        self.count = 0
        self.total = 0.0


class Histogram(_Metric):
    """Observations counted into cumulative buckets, with their sum and count."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        help: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        super().__init__(name, help, labels)
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        self._series: dict[LabelValues, _Series] = {} if labels else {(): _Series(len(self.bounds))}

    def labels(self, *values: str) -> _HistogramChild:
        return _HistogramChild(self, self._key(values))

    def observe(self, value: float) -> None:
        self._observe(self._key(()), value)

    @contextmanager
    def time(self) -> Iterator[None]:
        """Observe the seconds the ``with`` block takes."""
        started = perf_counter()
        try:
            yield
        finally:
            self.observe(perf_counter() - started)

    def _observe(self, key: LabelValues, value: float) -> None:
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = _Series(len(self.bounds))
            for i, bound in enumerate(self.bounds):
                if value <= bound:
                    series.buckets[i] += 1
                    break
            series.count += 1
            series.total += value

    def count(self, *values: str) -> int:
        with self._lock:
            series = self._series.get(self._key(values))
            return series.count if series is not None else 0

    def samples(self) -> list[str]:
        lines: list[str] = []
        with self._lock:
            items = sorted((k, list(s.buckets), s.count, s.total) for k, s in self._series.items())
        for key, buckets, count, total in items:
            cumulative = 0
            for bound, n in zip(self.bounds, buckets, strict=True):
                cumulative += n
                le = f'le="{_number(bound)}"'
                lines.append(
                    f"{self.name}_bucket{_labels_text(self.label_names, key, le)} {cumulative}"
                )
            labels = _labels_text(self.label_names, key)
            lines.append(f"{self.name}_sum{labels} {_number(total)}")
            lines.append(f"{self.name}_count{labels} {count}")
        return lines


class _HistogramChild:
    def __init__(self, parent: Histogram, key: LabelValues) -> None:
        self._parent = parent
        self._key = key

    def observe(self, value: float) -> None:
        self._parent._observe(self._key, value)


class Registry:
    """Metrics by name, rendered together."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def register(self, metric: _Metric) -> None:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name!r} is already registered")
        self._metrics[metric.name] = metric

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        metric = Counter(name, help, labels)
        self.register(metric)
        return metric

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        metric = Gauge(name, help, labels)
        self.register(metric)
        return metric

    def histogram(
        self,
        name: str,
        help: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> Histogram:
        metric = Histogram(name, help, labels, buckets)
        self.register(metric)
        return metric

    def render(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        lines: list[str] = []
        for metric in self._metrics.values():
            lines.extend(metric.header())
            lines.extend(metric.samples())
        return "\n".join(lines) + "\n"


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class DaemonMetrics:
    """The daemon's metrics. The daemon creates one and updates it; ``/metrics`` renders it."""

    def __init__(self, registry: Registry | None = None) -> None:
        self.registry = registry if registry is not None else Registry()
        r = self.registry
        self.sessions = r.gauge(
            "apomesh_sessions", "Sessions the daemon holds, by status.", ["state"]
        )
        self.agents = r.gauge("apomesh_agents", "Agents of live sessions, by phase.", ["phase"])
        self.events_appended = r.counter(
            "apomesh_events_appended_total", "Events appended to the log, by kind.", ["kind"]
        )
        self.append_seconds = r.histogram(
            "apomesh_append_seconds", "Seconds one (batched) append to the log took."
        )
        self.heartbeats_received = r.counter(
            "apomesh_heartbeats_received_total", "Worker heartbeats received."
        )
        self.workers_alive = r.gauge("apomesh_workers_alive", "Workers currently considered alive.")
        self.workers_lost = r.counter(
            "apomesh_workers_lost_total", "Workers declared lost after missed heartbeats."
        )
        self.resumes = r.counter(
            "apomesh_resumes_total",
            "Agent and session resumes, by path (worker_lost, auto, operator).",
            ["path"],
        )
        self.journal_hits = r.counter(
            "apomesh_journal_hits_total", "Side-effecting tool calls served from the journal."
        )
        self.recoverable_sessions = r.gauge(
            "apomesh_recoverable_sessions", "Sessions on the recoverable list."
        )
        self.fenced_reports = r.counter(
            "apomesh_fenced_reports_total", "Worker reports rejected for a stale epoch or identity."
        )
        self.snapshot_bytes = r.counter(
            "apomesh_snapshot_bytes_total", "Bytes of snapshot records written to LMDB."
        )
        self.dropped_requests = r.counter(
            "apomesh_control_requests_dropped_total",
            "Control requests dropped unanswered: not on a worker's bound subject, or with a reply"
            " subject outside that worker's own inbox.",
        )
        self.dispatches_refused = r.counter(
            "apomesh_dispatches_refused_total",
            "Dispatches a worker did not take, by reason: full (it ran as many agents as it may),"
            " refused (a stale epoch, an undecodable dispatch) or unanswered.",
            ["reason"],
        )
        self.placement_waits = r.counter(
            "apomesh_placement_waits_total",
            "Agents that waited for room because every worker able to run them was full.",
        )
        self.append_conflicts = r.counter(
            "apomesh_append_conflicts_total",
            "Sessions this daemon stopped driving because another writer appended to their log.",
        )
        self.model_calls = r.counter(
            "apomesh_model_calls_total",
            "Model call attempts its workers reported, by provider, model and outcome (ok, or"
            " error for an attempt that failed, whether or not it was tried again).",
            ["provider", "model", "outcome"],
        )
        self.model_call_seconds = r.histogram(
            "apomesh_model_call_seconds",
            "Seconds one model call attempt took, by provider and model.",
            ["provider", "model"],
        )
        self.model_tokens = r.counter(
            "apomesh_model_tokens_total",
            "Tokens the providers counted for the model calls, by provider, model and kind"
            " (prompt, completion).",
            ["provider", "model", "kind"],
        )

    def observe_model_call(
        self,
        provider: str,
        model: str,
        seconds: float,
        prompt_tokens: int,
        completion_tokens: int,
        outcome: str,
    ) -> None:
        """One model call attempt a worker reported: its outcome, its latency and its tokens."""
        self.model_calls.labels(provider, model, outcome).inc()
        self.model_call_seconds.labels(provider, model).observe(seconds)
        if prompt_tokens:
            self.model_tokens.labels(provider, model, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self.model_tokens.labels(provider, model, "completion").inc(completion_tokens)

    def render(self) -> str:
        return self.registry.render()
