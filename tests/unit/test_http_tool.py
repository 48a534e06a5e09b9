"""``http.request`` against a real loopback HTTP server: GET and HEAD are read-only, any other
method is journaled and carries the call's idempotency key in its ``Idempotency-Key`` header."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.fakes.echo_http import Recorder

from apomesh.builtin.tools import BUILTIN_TOOLS, MAX_HTTP_BODY
from apomesh.core.errors import ToolError

pytestmark = pytest.mark.anyio

HTTP = next(tool for tool in BUILTIN_TOOLS if tool.name == "http.request")


@pytest.fixture(scope="module")
def server() -> Iterator[Recorder]:
    with Recorder() as recorder:
        yield recorder


class Ctx:
    workspace = Path(".")
    session_id = "s-1"
    agent = "root"
    epoch = 1
    idempotency_key = "key-of-this-call"


def test_get_and_head_are_read_only_and_other_methods_are_journaled() -> None:
    assert HTTP.side_effect and HTTP.on_unknown == "hold" and not HTTP.idempotent
    for method in ("GET", "get", "HEAD"):
        assert not HTTP.journaled({"url": "http://x", "method": method})
    assert not HTTP.journaled({"url": "http://x"})  # GET by default
    for method in ("POST", "PUT", "PATCH", "DELETE", "delete"):
        assert HTTP.journaled({"url": "http://x", "method": method})


async def test_a_post_sends_the_call_idempotency_key_and_a_get_sends_none(
    server: Recorder,
) -> None:
    answer = await HTTP.run(
        Ctx(),
        {
            "url": f"{server.url}/orders",
            "method": "POST",
            "body": '{"item": "apple"}',
            "headers": {"Idempotency-Key": "the model's own", "X-Trace": "t1"},
        },
    )
    assert answer.startswith("HTTP 200 OK\ncontent-type: application/json\n\n")
    posted = server.requests[-1]
    assert posted["method"] == "POST" and posted["body"] == '{"item": "apple"}'
    assert posted["headers"]["Idempotency-Key"] == "key-of-this-call"
    assert posted["headers"]["X-Trace"] == "t1"
    await HTTP.run(Ctx(), {"url": f"{server.url}/orders"})
    got = server.requests[-1]
    assert got["method"] == "GET" and "Idempotency-Key" not in got["headers"]


async def test_an_error_status_a_bad_call_and_a_large_body(server: Recorder) -> None:
    with pytest.raises(ToolError, match="HTTP 404 Not Found"):
        await HTTP.run(Ctx(), {"url": f"{server.url}/missing"})
    with pytest.raises(ToolError, match="`method` must be one of"):
        await HTTP.run(Ctx(), {"url": server.url, "method": "BREW"})
    with pytest.raises(ToolError, match="http:// or https://"):
        await HTTP.run(Ctx(), {"url": "file:///etc/passwd"})
    with pytest.raises(ToolError, match="failed: ConnectError"):
        await HTTP.run(Ctx(), {"url": "http://127.0.0.1:9/"})
    answer = await HTTP.run(Ctx(), {"url": f"{server.url}/big"})
    assert answer.endswith(f"[cut at {MAX_HTTP_BODY} bytes]")
    assert answer.count("x") == MAX_HTTP_BODY


async def test_a_post_whose_connection_breaks_after_it_was_sent_has_an_unknown_outcome() -> None:
    """A server that reads the request and hangs up without answering: a POST's outcome is
    unknown (``OutcomeUnknown``, decided by the journal, never an error the model might retry),
    a GET's is an error; a request that never reached a server is an error for both."""
    import socket
    import threading

    from apomesh.adapters.natsserver import free_port
    from apomesh.core.errors import OutcomeUnknown

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    received: list[bytes] = []

    def hang_up() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            received.append(conn.recv(65536))
            conn.close()

    thread = threading.Thread(target=hang_up, daemon=True)
    thread.start()
    try:
        with pytest.raises(OutcomeUnknown, match="not known"):
            await HTTP.run(Ctx(), {"url": f"http://127.0.0.1:{port}/pay", "method": "POST"})
        with pytest.raises(ToolError) as got:
            await HTTP.run(Ctx(), {"url": f"http://127.0.0.1:{port}/stock"})
        assert not isinstance(got.value, OutcomeUnknown)
    finally:
        thread.join(5)
        listener.close()
    assert received[0].startswith(b"POST /pay") and b"key-of-this-call" in received[0]
    closed = free_port()  # nothing listens there
    with pytest.raises(ToolError) as refused:
        await HTTP.run(Ctx(), {"url": f"http://127.0.0.1:{closed}/pay", "method": "POST"})
    assert not isinstance(refused.value, OutcomeUnknown)
