"""How ``apomesh serve`` and ``apomesh worker`` write their log lines: text or JSON on stderr.

``[log] format = "json"`` (``--log-format json``) writes one JSON object a line: ``ts`` (ISO 8601,
UTC), ``level``, ``logger``, ``message``, ``exception`` when there is one, and ``trace_id`` /
``span_id`` while a span is current (``runtime.tracing``), so a log line leads to its trace. The
HTTP client libraries are kept at warnings unless the level is ``debug``: httpx logs every request
at info, which is one line per model call.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any, Literal

from apomesh.runtime import tracing

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

CHATTY_LIBRARIES = ("httpx", "httpcore")
"""Loggers that say something at info on every request they make."""


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        if tracing.enabled():
            from opentelemetry import trace

            span = trace.get_current_span().get_span_context()
            if span.is_valid:
                entry["trace_id"] = format(span.trace_id, "032x")
                entry["span_id"] = format(span.span_id, "016x")
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(
    level: Literal["debug", "info", "warning", "error"], format: Literal["text", "json"]
) -> None:
    """Send every log record at ``level`` or above to stderr, in ``format``."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    number = logging.getLevelName(level.upper())
    root.setLevel(number)
    for name in CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(
            number if level == "debug" else max(number, logging.WARNING)
        )
