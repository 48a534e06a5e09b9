"""What an operator sees of a session, on a real daemon process and a real worker process: one
OpenTelemetry trace across both (the worker's spans joined through the dispatch's NATS headers),
received by an OTLP/HTTP receiver; JSON log lines with no line per model call; and ``/metrics``
serving exactly the metrics docs/api.md lists, with tool latency, session duration and build info.

One system for the module: a session with a model call over HTTP (the local OpenAI-compatible
server), a tool call and a final answer, run once; each test looks at one thing it left.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.fakes.openai_server import FakeOpenAIServer
from tests.fakes.otlp_receiver import OTLPReceiver, ReceivedSpan

from apomesh._version import __version__
from apomesh.adapters.natsserver import NatsServer
from apomesh.testing import Mesh

TIMEOUT = 60.0
API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"

AGENT = {
    "name": "observed",
    "coordination": "solo",
    "instructions": "Write the goal to observed.txt, then answer.",
    "tools": ["fs.write"],
    "model": {"provider": "openai", "model": "fake-model", "credential": "local"},
}


@dataclass
class Observed:
    mesh: Mesh
    receiver: OTLPReceiver
    model_server: FakeOpenAIServer
    session_id: str
    view: dict[str, Any]


def wait_until(check: Any, what: Any) -> Any:
    """``check()`` once it is truthy; ``what()`` says what did not happen."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"{what()} within {TIMEOUT} s")


@pytest.fixture(scope="module")
def observed(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Observed]:
    base = tmp_path_factory.mktemp("observed")
    with OTLPReceiver() as receiver, FakeOpenAIServer() as model_server:
        # Both processes read the same file: the model endpoint and where spans go. The daemon
        # is told JSON logs by its flag, the worker by the environment.
        config = base / "apomesh.toml"
        config.write_text(
            "[providers.openai.credentials.local]\n"
            f'base_url = "{model_server.base_url}"\n'
            'api_key_env = ""\n'
            "[tracing]\n"
            'exporter = "otlp"\n'
            f'endpoint = "{receiver.endpoint}"\n'
        )
        env = {
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            # A worker's first model call may hold its loop a moment (building its HTTP client).
            "APOMESH_LIVENESS_HEARTBEAT_INTERVAL": "0.5",
            "APOMESH_LIVENESS_MISSED_BEATS": "6",
        }
        mesh = Mesh(nats_server, base, env=env)
        mesh.daemon.extra_args = ("--config", str(config), "--log-format", "json")
        try:
            mesh.daemon.start()
            mesh.worker("traced", env={"APOMESH_LOG_FORMAT": "json"}, config=config)
            mesh.wait_workers(1)
            model_server.reply(
                tool_calls=[("fs__write", {"path": "observed.txt", "content": "seen"})],
                total_tokens=30,
            )
            model_server.reply("written", total_tokens=40)
            response = httpx.post(
                f"{mesh.url}/v1/sessions", json={"goal": "seen", "definition": AGENT}
            )
            assert response.status_code == 201, response.text
            session_id = response.json()["session_id"]

            def ended() -> dict[str, Any] | None:
                view: dict[str, Any] = httpx.get(f"{mesh.url}/v1/sessions/{session_id}").json()
                return view if view["status"] in ("completed", "failed") else None

            view = wait_until(ended, lambda: f"session {session_id} did not end")
            yield Observed(mesh, receiver, model_server, session_id, view)
        finally:
            mesh.close()


def test_the_session_completes_with_a_model_call_and_a_tool_call(observed: Observed) -> None:
    assert observed.view["status"] == "completed", observed.view
    assert observed.view["output"] == "written"
    written = observed.mesh.daemon.workspace / observed.session_id / "observed.txt"
    assert written.read_text() == "seen"
    assert len(observed.model_server.requests) == 2


def test_one_trace_spans_the_daemon_and_the_worker(observed: Observed) -> None:
    def outcome(span: ReceivedSpan) -> Any:
        return span.attributes.get("apomesh.outcome")

    def complete() -> list[ReceivedSpan] | None:
        # The worker ends its dispatch span last, after all of that dispatch's spans.
        spans = observed.receiver.received()
        names = {s.name for s in spans}
        final = [s for s in spans if s.name == "apomesh.dispatch" and outcome(s) == "final"]
        return spans if "apomesh.session" in names and final else None

    spans = wait_until(
        complete,
        lambda: f"not every span arrived: {[s.name for s in observed.receiver.received()]}",
    )
    assert {s.trace_id for s in spans} == {spans[0].trace_id}, "more than one trace"
    by_name: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    (session,) = by_name["apomesh.session"]
    (agent,) = by_name["apomesh.agent"]
    assert session.service == agent.service == "apomesh-daemon"
    assert session.parent_id == ""  # the trace's root
    assert session.attributes["apomesh.session_id"] == observed.session_id
    assert session.attributes["apomesh.status"] == "completed"
    assert agent.parent_id == session.span_id
    assert "dispatched" in agent.events
    # The worker's spans, in another process, hang under the daemon's agent span (every
    # dispatch of it: one, or more if a slow start made the daemon think the worker lost).
    dispatches = by_name["apomesh.dispatch"]
    assert {(d.service, d.parent_id) for d in dispatches} == {("apomesh-worker", agent.span_id)}
    (final,) = [d for d in dispatches if outcome(d) == "final"]
    nodes = {s.span_id: s for s in by_name["apomesh.node"] if s.parent_id == final.span_id}
    assert [n.attributes.get("apomesh.step") for n in nodes.values()].count(1) == 1
    chats = [c for c in by_name["chat fake-model"] if c.parent_id in nodes]
    reasons = sorted(c.attributes["gen_ai.response.finish_reasons"][0] for c in chats)
    assert reasons == ["stop", "tool_calls"]
    assert {c.attributes["gen_ai.provider.name"] for c in chats} == {"openai"}
    (tool,) = by_name["execute_tool fs.write"]
    assert tool.parent_id in nodes
    assert tool.attributes["apomesh.outcome"] == "ok"


def log_lines(path: Path) -> list[str]:
    return [line for line in path.read_text(errors="replace").splitlines() if line.strip()]


def test_both_processes_log_json_lines_and_no_line_per_model_call(observed: Observed) -> None:
    worker_log = observed.mesh.workers[0].log_file
    for path in (observed.mesh.daemon.log_file, worker_log):
        lines = log_lines(path)
        assert lines, f"{path.name} is empty"
        for line in lines:
            entry = json.loads(line)  # every line, startup banner included, is one JSON object
            assert {"ts", "level", "logger", "message"} <= set(entry), line
    worker = [json.loads(line) for line in log_lines(worker_log)]
    assert any(
        e["logger"] == "apomesh.worker" and "registered with daemon" in e["message"] for e in worker
    )
    # Two model calls went over HTTP; httpx said nothing about them.
    assert not [e for e in worker if e["logger"].startswith(("httpx", "httpcore"))], worker


def documented_metrics() -> dict[str, str]:
    """The metrics table of docs/api.md: name -> type."""
    text = API_DOC.read_text(encoding="utf-8")
    section = text.split("### Metrics", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| `(apomesh_[a-z_]+)` \| (counter|gauge|histogram) \|", section, re.M)
    return dict(rows)


def test_metrics_serves_exactly_what_the_api_doc_lists(observed: Observed) -> None:
    text = httpx.get(f"{observed.mesh.url}/metrics").text
    types = [line.split() for line in text.splitlines() if line.startswith("# TYPE")]
    assert {name: kind for _, _, name, kind in types} == documented_metrics()


def test_metrics_count_the_tool_call_the_session_and_the_build(observed: Observed) -> None:
    text = httpx.get(f"{observed.mesh.url}/metrics").text
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    tool = (("outcome", "ok"), ("tool", "fs.write"))
    assert samples[("apomesh_tool_call_seconds_count", tool)] == 1
    assert samples[("apomesh_tool_call_seconds_sum", tool)] > 0
    assert samples[("apomesh_session_seconds_count", (("status", "completed"),))] == 1
    build = [labels for (name, labels), value in samples.items() if name == "apomesh_build_info"]
    assert len(build) == 1 and ("version", __version__) in build[0]
