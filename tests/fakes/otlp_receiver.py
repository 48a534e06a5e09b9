"""A local OTLP/HTTP trace receiver, for tests: what an OpenTelemetry collector would be told.

``OTLPReceiver`` listens on a free 127.0.0.1 port in a background thread, decodes every
``POST /v1/traces`` (``ExportTraceServiceRequest``, protobuf) and keeps its spans as
``ReceivedSpan`` rows (ids in hex, the ``service.name`` of the process that sent them).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from tests.fakes.local_http import LocalHTTPServer


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    events: list[str]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass
class OTLPReceiver(LocalHTTPServer):
    """Start with ``with OTLPReceiver() as receiver:``; export to ``receiver.endpoint``."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"{self.base_url}/traces"

    def received(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def _take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        rows = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    rows.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=[event.name for event in span.events],
                        )
                    )
        with self._lock:
            self.spans.extend(rows)

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver._take(body)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.serve(Handler)
