"""Tracing off costs the step path nothing; on, a dispatch's spans join the trace whose context
its NATS headers carry, and the JSON log lines name the span they were written in. In-process,
with the OpenTelemetry SDK's in-memory exporter (the real processes are in
tests/e2e/test_observability.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from apomesh.core.definition import ModelSpec
from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import ModelRequest, ModelResponse, ToolCallSpec
from apomesh.runtime import tracing
from apomesh.runtime.config import TracingConfig, load_config
from apomesh.runtime.logging_config import JsonFormatter, configure_logging

pytestmark = pytest.mark.anyio


class Answering:
    async def respond(self, request: ModelRequest) -> ModelResponse:
        return ModelResponse(
            tool_calls=[ToolCallSpec("fs.read", {})], prompt_tokens=11, completion_tokens=4
        )


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    """Tracing on, through a provider whose spans land in memory (``exporter = "global"``
    takes the application's provider, as an embedding application would install it)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing._tracer = provider.get_tracer("apomesh")
    try:
        yield exporter
    finally:
        tracing._tracer = None
        provider.shutdown()


def test_off_nothing_is_made_and_a_model_is_not_wrapped() -> None:
    tracing.configure(TracingConfig(), service="apomesh-daemon")
    assert not tracing.enabled()
    assert tracing.headers() is None
    dispatch = tracing.dispatch_trace(
        {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}, {}
    )
    assert dispatch is tracing.NO_TRACE
    model = Answering()
    assert dispatch.wrap_model(model, ModelSpec()) is model


async def test_a_dispatch_joins_the_trace_its_headers_carry(
    exported: InMemorySpanExporter,
) -> None:
    async def drive() -> dict[str, str] | None:
        return tracing.headers()

    headers = await tracing.traced(drive(), "apomesh.agent", {"apomesh.agent": "root"})
    assert headers is not None and "traceparent" in headers
    dispatch = tracing.dispatch_trace(headers, {"apomesh.agent": "root"})
    dispatch.start_node()
    model = dispatch.wrap_model(Answering(), ModelSpec(provider="openai", model="m1"))
    await model.respond(ModelRequest(instructions="", messages=[], tools=[], memory={}))
    with dispatch.tool_call("fs.read") as call:
        call.ended("error")
    dispatch.end_node(1)
    # Meanwhile the dispatch span is the current one: the worker's log lines name it.
    inside = trace.get_current_span()
    dispatch.close("final")
    assert trace.get_current_span() is not inside
    spans = {span.name: span for span in exported.get_finished_spans()}
    assert set(spans) == {
        "apomesh.agent",
        "apomesh.dispatch",
        "apomesh.node",
        "chat m1",
        "execute_tool fs.read",
    }
    agent = spans["apomesh.agent"]
    assert inside.get_span_context().span_id == spans["apomesh.dispatch"].context.span_id
    assert {s.context.trace_id for s in spans.values()} == {agent.context.trace_id}

    def parent(name: str) -> Any:
        span_parent = spans[name].parent
        assert span_parent is not None
        return span_parent.span_id

    assert parent("apomesh.dispatch") == agent.context.span_id
    assert parent("apomesh.node") == spans["apomesh.dispatch"].context.span_id
    assert (
        parent("chat m1") == parent("execute_tool fs.read") == spans["apomesh.node"].context.span_id
    )
    chat = spans["chat m1"].attributes or {}
    assert (chat["gen_ai.usage.input_tokens"], chat["gen_ai.usage.output_tokens"]) == (11, 4)
    assert spans["apomesh.node"].attributes["apomesh.step"] == 1  # type: ignore[index]
    assert spans["execute_tool fs.read"].status.status_code is trace.StatusCode.ERROR


async def test_a_json_log_line_names_its_trace_and_span(exported: InMemorySpanExporter) -> None:
    record: dict[str, Any] = {}

    async def log_inside() -> None:
        line = logging.LogRecord("apomesh.node", logging.WARNING, __file__, 1, "x %s", ("y",), None)
        record.update(json.loads(JsonFormatter().format(line)))

    await tracing.traced(log_inside(), "apomesh.session", {})
    (span,) = exported.get_finished_spans()
    assert record["message"] == "x y" and record["level"] == "warning"
    assert record["trace_id"] == format(span.context.trace_id, "032x")
    assert record["span_id"] == format(span.context.span_id, "016x")


def test_httpx_says_nothing_per_request_unless_debugging() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("info", "json")
        assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
        assert isinstance(root.handlers[-1].formatter, JsonFormatter)
        configure_logging("debug", "text")
        assert logging.getLogger("httpx").getEffectiveLevel() == logging.DEBUG
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        logging.getLogger("httpx").setLevel(logging.NOTSET)
        logging.getLogger("httpcore").setLevel(logging.NOTSET)


def test_tracing_and_log_settings_are_checked(tmp_path: Any) -> None:
    config = load_config(
        None, env={"APOMESH_TRACING_EXPORTER": "otlp", "APOMESH_LOG_FORMAT": "json"}
    )
    assert (config.tracing.exporter, config.log.format) == ("otlp", "json")
    with pytest.raises(DefinitionError, match=r"tracing\.endpoint"):
        load_config(None, env={"APOMESH_TRACING_ENDPOINT": "127.0.0.1:4318"})
    with pytest.raises(DefinitionError, match=r"tracing\.exporter"):
        load_config(None, env={"APOMESH_TRACING_EXPORTER": "jaeger"})


async def test_a_failed_drive_is_an_error_and_a_cancelled_one_is_not(
    exported: InMemorySpanExporter,
) -> None:
    async def fail() -> None:
        raise RuntimeError("no answer")

    async def cancelled() -> None:
        raise asyncio.CancelledError

    with pytest.raises(RuntimeError):
        await tracing.traced(fail(), "apomesh.agent", {})
    with pytest.raises(asyncio.CancelledError):
        await tracing.traced(cancelled(), "apomesh.session", {})
    spans = {span.name: span for span in exported.get_finished_spans()}
    assert spans["apomesh.agent"].status.status_code is trace.StatusCode.ERROR
    assert spans["apomesh.agent"].status.description == "RuntimeError: no answer"
    assert spans["apomesh.session"].status.status_code is trace.StatusCode.UNSET
    assert (spans["apomesh.session"].attributes or {})["apomesh.cancelled"] is True
