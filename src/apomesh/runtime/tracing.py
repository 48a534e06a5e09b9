"""OpenTelemetry traces of sessions, through ``opentelemetry-api``; off unless configured.

The spans of one session on one daemon form one trace across that daemon and its workers (a
resume after a restart, or on a peer, starts another; ``apomesh.session_id`` finds them all):

- ``apomesh.session`` (daemon): a session's coordinator loop, from its start (or resume) on this
  daemon to its end or stop;
- ``apomesh.agent`` (daemon): one agent driven to its answer, every dispatch included (events
  ``dispatched`` and ``resuming`` mark each one);
- ``apomesh.dispatch`` (worker): one dispatch of that agent on a worker, a child of the agent span
  whose context travels in the dispatch's NATS message headers (W3C ``traceparent``);
- ``apomesh.node`` (worker): one node, a model turn and the tool calls it asked for;
- ``chat <model>`` (worker): the model call, with the GenAI semantic conventions' attributes;
- ``execute_tool <tool>`` (worker): a tool's run (a call served from the journal runs nothing).

``configure`` reads the ``[tracing]`` config: ``off`` (the default) creates nothing, so the step
path pays nothing: dispatches carry no headers and the worker's per-dispatch trace is
``NO_TRACE``, whose methods do nothing. ``otlp`` and ``console`` build a ``TracerProvider`` of the
OpenTelemetry SDK (the ``apomesh[otel]`` extra) for this process alone; ``global`` uses the
provider an embedding application installed. A worker follows the daemon's sampling decision.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

from apomesh._version import __version__
from apomesh.core.definition import ModelSpec
from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import Model, ModelRequest, ModelResponse

if TYPE_CHECKING:
    # The OpenTelemetry API is imported where a span is made, and only then: tracing is off by
    # default, and a daemon's start saves the import (about 5 ms).
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Span

    from apomesh.runtime.config import TracingConfig

log = logging.getLogger("apomesh.tracing")

T = TypeVar("T")

_tracer: trace.Tracer | None = None
"""The tracer spans come from; None while tracing is off."""
_provider: Any = None
"""The SDK ``TracerProvider`` ``configure`` built (flushed by ``shutdown``), if any."""


def enabled() -> bool:
    """True when spans are made."""
    return _tracer is not None


def configure(config: TracingConfig, *, service: str) -> None:
    """Set this process up for ``config`` (``service`` names it unless ``service_name`` does)."""
    global _tracer, _provider
    shutdown()
    if config.exporter == "off":
        return
    if config.exporter == "global":
        from opentelemetry import trace

        _tracer = trace.get_tracer("apomesh", __version__)
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError:
        raise DefinitionError(
            f"tracing exporter {config.exporter!r} needs the OpenTelemetry SDK:"
            " pip install 'apomesh[otel]'",
            where="config $.tracing.exporter",
        ) from None
    exporter: Any
    if config.exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise DefinitionError(
                "tracing exporter 'otlp' needs the OTLP exporter: pip install 'apomesh[otel]'",
                where="config $.tracing.exporter",
            ) from None
        exporter = OTLPSpanExporter(endpoint=config.endpoint or None)
    else:
        exporter = ConsoleSpanExporter()
    resource = Resource.create(
        {"service.name": config.service_name or service, "service.version": __version__}
    )
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio))
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider = provider
    _tracer = provider.get_tracer("apomesh", __version__)


def shutdown() -> None:
    """Export what is left and turn tracing off (the process is stopping)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        try:
            provider.shutdown()
        except Exception as exc:  # an unreachable collector must not fail a shutdown
            log.warning("tracing shutdown: %s", exc)


# --- the daemon's spans --------------------------------------------------------------------------


async def traced(
    awaitable: Awaitable[T], name: str, attributes: Mapping[str, str | int | bool]
) -> T:
    """Await ``awaitable`` inside a span ``name`` that is current meanwhile (tasks started in it
    and dispatches sent from it are its children). Off, it is awaited as it is."""
    tracer = _tracer
    if tracer is None:
        return await awaitable
    from opentelemetry.trace import Status, StatusCode

    with tracer.start_as_current_span(
        name, attributes=dict(attributes), record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            return await awaitable
        except asyncio.CancelledError:
            # Stopped from outside (a cancel, a shutdown, another writer): not a failure.
            span.set_attribute("apomesh.cancelled", True)
            raise
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise


def add_event(name: str, attributes: Mapping[str, str | int]) -> None:
    """Mark the current span (the agent span: ``dispatched``, ``resuming``)."""
    if _tracer is not None:
        from opentelemetry import trace

        trace.get_current_span().add_event(name, dict(attributes))


def set_attributes(attributes: Mapping[str, str | int | bool]) -> None:
    """Set attributes of the current span (a session's final status)."""
    if _tracer is not None:
        from opentelemetry import trace

        trace.get_current_span().set_attributes(dict(attributes))


def headers() -> dict[str, str] | None:
    """The current trace context as NATS message headers; None while tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None


# --- a worker's spans ----------------------------------------------------------------------------


class TracedDispatch:
    """The spans of one dispatch on a worker: the dispatch span, a child of the daemon's agent
    span, and under it one node span at a time with the model and tool calls of that node. Made
    and closed in the dispatch's task, whose current span the dispatch span is meanwhile (its log
    lines name it)."""

    def __init__(
        self, tracer: trace.Tracer, parent: Context | None, attributes: dict[str, Any]
    ) -> None:
        from opentelemetry import context as otel_context
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        self._tracer = tracer
        self._attributes = attributes
        self._dispatch = tracer.start_span(
            "apomesh.dispatch", context=parent, kind=SpanKind.CONSUMER, attributes=attributes
        )
        self._dispatch_context = trace.set_span_in_context(self._dispatch)
        self._token = otel_context.attach(self._dispatch_context)
        self._set_span_in_context = trace.set_span_in_context
        self._node: Span | None = None
        self._node_context: Context | None = None

    def start_node(self) -> None:
        """A node begins (its model call is next); the previous one, if open, ends."""
        self.end_node()
        self._node = self._tracer.start_span(
            "apomesh.node", context=self._dispatch_context, attributes=self._attributes
        )
        self._node_context = self._set_span_in_context(self._node)

    def end_node(self, step: int | None = None) -> None:
        """The node is stored (``step`` is its number)."""
        node, self._node, self._node_context = self._node, None, None
        if node is not None:
            if step is not None:
                node.set_attribute("apomesh.step", step)
            node.end()

    def close(self, outcome: str) -> None:
        """The dispatch ended with ``outcome`` (or was cut short: ``error``)."""
        from opentelemetry import context as otel_context
        from opentelemetry.trace import Status, StatusCode

        self.end_node()
        self._dispatch.set_attribute("apomesh.outcome", outcome)
        if outcome in ("failed", "error"):
            self._dispatch.set_status(Status(StatusCode.ERROR, outcome))
        self._dispatch.end()
        otel_context.detach(self._token)

    def wrap_model(self, model: Model, spec: ModelSpec) -> Model:
        return _TracedModel(model, spec, self)

    @contextmanager
    def model_call(self, spec: ModelSpec) -> Iterator[_ModelCall]:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        name = f"chat {spec.model}" if spec.model else "chat"
        attributes = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": spec.provider,
            "gen_ai.request.model": spec.model,
        }
        span = self._tracer.start_span(
            name,
            context=self._node_context or self._dispatch_context,
            kind=SpanKind.CLIENT,
            attributes=attributes,
        )
        with trace.use_span(span, end_on_exit=True, record_exception=True):
            yield _ModelCall(span)

    @contextmanager
    def tool_call(self, tool: str) -> Iterator[ToolCall]:
        from opentelemetry import trace

        span = self._tracer.start_span(
            f"execute_tool {tool}",
            context=self._node_context or self._dispatch_context,
            attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": tool},
        )
        with trace.use_span(span, end_on_exit=True, record_exception=False):
            yield ToolCall(span)


class ToolCall:
    """The span of one tool run, told how it ended."""

    def __init__(self, span: Span | None) -> None:
        self._span = span

    def ended(self, outcome: str) -> None:
        """``ok``, ``error`` (the tool raised) or ``stalled`` (it waits for a human)."""
        if self._span is not None:
            self._span.set_attribute("apomesh.outcome", outcome)
            if outcome == "error":
                from opentelemetry.trace import Status, StatusCode

                self._span.set_status(Status(StatusCode.ERROR, "the tool raised"))


class _ModelCall:
    def __init__(self, span: Span) -> None:
        self.span = span

    def answered(self, response: ModelResponse) -> None:
        if response.prompt_tokens:
            self.span.set_attribute("gen_ai.usage.input_tokens", response.prompt_tokens)
        if response.completion_tokens:
            self.span.set_attribute("gen_ai.usage.output_tokens", response.completion_tokens)
        reason = "tool_calls" if response.tool_calls else "stop"
        self.span.set_attribute("gen_ai.response.finish_reasons", [reason])


class _TracedModel:
    """A model whose every call is a ``chat`` span of the node it is made in."""

    def __init__(self, model: Model, spec: ModelSpec, dispatch: TracedDispatch) -> None:
        self._model = model
        self._spec = spec
        self._trace = dispatch

    async def respond(self, request: ModelRequest) -> ModelResponse:
        with self._trace.model_call(self._spec) as call:
            response = await self._model.respond(request)
            call.answered(response)
            return response


class NoTrace:
    """``TracedDispatch`` while tracing is off: every method does nothing."""

    def start_node(self) -> None:
        pass

    def end_node(self, step: int | None = None) -> None:
        pass

    def close(self, outcome: str) -> None:
        pass

    def wrap_model(self, model: Model, spec: ModelSpec) -> Model:
        return model

    def tool_call(self, tool: str) -> AbstractContextManager[ToolCall]:
        return _NO_TOOL_CALL


_NO_TOOL_CALL = nullcontext(ToolCall(None))
NO_TRACE = NoTrace()

DispatchTrace = TracedDispatch | NoTrace
"""The spans of one dispatch on a worker, or none."""


def dispatch_trace(
    message_headers: Mapping[str, str] | None, attributes: dict[str, Any]
) -> DispatchTrace:
    """The trace of one dispatch, joined to the daemon's through ``message_headers``."""
    tracer = _tracer
    if tracer is None:
        return NO_TRACE
    from opentelemetry import propagate

    parent = propagate.extract(dict(message_headers)) if message_headers else None
    return TracedDispatch(tracer, parent, attributes)
