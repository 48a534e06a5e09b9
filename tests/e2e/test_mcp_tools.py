"""Real tools on real processes: MCP tool servers, ``http.request`` and the workspace per session.

A worker offers the tools of a real MCP server process (``tests/fakes/mcp_server.py``, on the
official ``mcp`` package) and is SIGKILLed in the middle of three calls; the tools' annotations
decide what happens to each, and no effect runs twice.

The server counts what it does in files: every call it gets in ``calls.txt``, every effect in
``effects.txt``. While the test holds ``hold`` the server's calls wait after their effect, so the
worker dies with each effect done and its result not yet reported (the hardest case: the journal
has an intent and no result).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from tests.e2e.chaos_kit import check_session
from tests.fakes.echo_http import Recorder

from apomesh.adapters.natsserver import NatsServer, single_node
from apomesh.core.journal import call_key, idempotency_key
from apomesh.sdk.client import Client, EventRecord
from apomesh.testing import Mesh

SERVER = Path(__file__).resolve().parents[1] / "fakes" / "mcp_server.py"


class Shop:
    """The MCP server's directory and what it wrote there."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def lines(self, name: str) -> list[str]:
        path = self.root / name
        return path.read_text().splitlines() if path.exists() else []

    def hold(self) -> None:
        (self.root / "hold").touch()

    def release(self) -> None:
        (self.root / "hold").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Shop:
    return Shop(tmp_path_factory.mktemp("shop"))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, shop: Shop) -> Iterator[Mesh]:
    """A nats-server, a daemon and one worker, both reading a config that names the MCP server
    ``shop`` (a stdio command each worker starts)."""
    base = tmp_path_factory.mktemp("mcp-mesh")
    config = base / "apomesh.toml"
    command = ", ".join(f'"{part}"' for part in (sys.executable, str(SERVER), str(shop.root)))
    config.write_text(f"[mcp.servers.shop]\ncommand = [{command}]\n")
    server = NatsServer(single_node(base, name="nats"))
    server.start()
    system = Mesh(server, base)
    system.daemon.extra_args = ("--config", str(config))
    system.config = config  # type: ignore[attr-defined]
    try:
        system.daemon.start()
        system.worker(config=config)
        system.wait_workers(1)
        yield system
    finally:
        system.close()
        server.stop()


def buyer(name: str, tool: str, args: dict[str, Any]) -> dict[str, Any]:
    """A solo agent making one call to the MCP tool ``shop.<tool>``, then answering."""
    return {
        "name": name,
        "version": "1.0.0",
        "coordination": "solo",
        "tools": [f"shop.{tool}"],
        "model": {
            "provider": "scripted",
            "turns": [
                {"tool_calls": [{"tool": f"shop.{tool}", "args": args}]},
                {"final": f"{name} done"},
            ],
        },
    }


async def wait_for(predicate: Any, what: str, timeout: float = 60.0) -> Any:
    with anyio.fail_after(timeout):
        while True:
            value = await predicate()
            if value:
                return value
            await anyio.sleep(0.1)


async def records_of(client: Client, session_id: str) -> list[EventRecord]:
    with anyio.fail_after(90):
        return [record async for record in client.events(session_id)]


def of_kind(records: list[EventRecord], kind: str) -> list[dict[str, Any]]:
    return [r.event for r in records if r.kind == kind]


@pytest.mark.anyio
async def test_the_annotations_decide_what_a_killed_worker_leaves_and_no_effect_runs_twice(
    mesh: Mesh, shop: Shop
) -> None:
    calls = {
        "lookup": {"item": "apple"},
        "put": {"item": "apple", "value": "red"},
        "charge": {"amount": 7},
    }
    shop.hold()
    async with Client(mesh.url) as client:
        ids = {
            tool: await client.start_session(f"mcp {tool}", definition=buyer(tool, tool, args))
            for tool, args in calls.items()
        }

        async def all_inside() -> bool:
            started = " ".join(shop.lines("calls.txt"))
            return all(f"{tool} " in started for tool in calls)

        await wait_for(all_inside, "the three calls are inside the MCP server")
        assert len(shop.lines("effects.txt")) == 2  # put and charge did their effect
        mesh.workers[0].kill()  # SIGKILL, mid-call: no result was reported
        shop.release()
        mesh.worker(config=mesh.config)  # type: ignore[attr-defined]

        # Read-only (readOnlyHint): not journaled, simply run again on the new worker.
        lookup = await records_of(client, ids["lookup"])
        assert of_kind(lookup, "SessionEnded")[-1]["status"] == "completed"
        assert not of_kind(lookup, "ToolCallIntent")
        assert of_kind(lookup, "AgentResuming"), "the lookup was not resumed elsewhere"
        # Run again at least once. Not exactly once: a read-only call is never journaled, so any
        # dispatch sent again runs it again (in one full run on two cores it ran a third time;
        # that run kept no daemon log to say which dispatch was sent again, or why: a run where
        # it happens now warns with the daemon's log, shown in the summary of a passing run).
        lookups = shop.lines("calls.txt").count("lookup apple")
        assert lookups >= 2, mesh.daemon.output_tail()
        if lookups > 2:
            warnings.warn(f"lookup ran {lookups} times:\n{mesh.daemon.output_tail()}", stacklevel=1)

        # Idempotent (idempotentHint): run again under the same idempotency key, which the
        # server applies once.
        put = await records_of(client, ids["put"])
        assert of_kind(put, "SessionEnded")[-1]["status"] == "completed"
        key = call_key("shop.put", calls["put"])
        assert [i["key"] for i in of_kind(put, "ToolCallIntent")] == [key, key]
        assert [r["outcome"] for r in of_kind(put, "ToolCallRecorded")] == ["ok"]
        sent = idempotency_key(ids["put"], "root", key)
        assert shop.lines("calls.txt").count(f"put apple=red key={sent}") == 2
        assert shop.lines("effects.txt").count("put apple=red") == 1

        # A plain side effect: held as an unknown outcome for the operator, never run again.
        async def held() -> Any:
            entries = {r.session_id: r for r in await client.list_recoverable()}
            return entries.get(ids["charge"])

        entry = await wait_for(held, "the charge is held for an operator")
        assert entry.category == "held"
        assert [(u.tool, u.args) for u in entry.unknown_outcomes] == [
            ("shop.charge", calls["charge"])
        ]
        assert not (await client.get_session(ids["charge"])).terminal
        await client.resume(ids["charge"], confirm=True)
        charge = await records_of(client, ids["charge"])
        verification = await client.verify_session(ids["charge"])
    assert [r["outcome"] for r in of_kind(charge, "ToolCallRecorded")] == ["unknown"]
    assert of_kind(charge, "SessionEnded")[-1]["status"] == "completed"
    check = check_session(charge, verification, mesh.daemon.workspace)
    assert check.ok, check.problems
    assert [line for line in shop.lines("calls.txt") if line.startswith("charge")] == [
        f"charge 7 key={idempotency_key(ids['charge'], 'root', call_key('shop.charge', calls['charge']))}"
    ]
    assert shop.lines("effects.txt").count("charge 7") == 1


def writer(name: str, content: str, **extra: Any) -> dict[str, Any]:
    """A solo agent writing ``note.txt`` with ``content``, then answering."""
    call = {"tool": "fs.write", "args": {"path": "note.txt", "content": content}}
    return {
        "name": name,
        "version": "1.0.0",
        "tools": ["fs.write"],
        "model": {"provider": "scripted", "turns": [{"tool_calls": [call]}, {"final": "noted"}]},
        **extra,
    }


@pytest.mark.anyio
async def test_each_session_writes_in_its_own_workspace_unless_it_asks_for_the_shared_one(
    mesh: Mesh,
) -> None:
    root = mesh.daemon.workspace
    async with Client(mesh.url) as client:
        first = await client.start_session("one", definition=writer("first", "from one"))
        second = await client.start_session("two", definition=writer("second", "from two"))
        shared = await client.start_session(
            "shared", definition=writer("sharer", "for all", workspace="shared")
        )
        for session_id in (first, second, shared):
            assert (await client.wait(session_id, timeout=60)).status == "completed"
    assert (root / first / "note.txt").read_text() == "from one"
    assert (root / second / "note.txt").read_text() == "from two"
    assert (root / "note.txt").read_text() == "for all"
    assert not (root / shared).exists()


@pytest.mark.anyio
async def test_http_request_journals_a_post_with_its_idempotency_key_and_not_a_get(
    mesh: Mesh,
) -> None:
    with Recorder() as server:
        calls = [
            {"url": f"{server.url}/stock"},
            {"url": f"{server.url}/orders", "method": "POST", "body": "apple"},
        ]
        definition = {
            "name": "orderer",
            "version": "1.0.0",
            "tools": ["http.request"],
            "model": {
                "provider": "scripted",
                "turns": [
                    *({"tool_calls": [{"tool": "http.request", "args": c}]} for c in calls),
                    {"final": "ordered"},
                ],
            },
        }
        async with Client(mesh.url) as client:
            session_id = await client.start_session("order", definition=definition)
            records = await records_of(client, session_id)
    assert of_kind(records, "SessionEnded")[-1]["status"] == "completed"
    key = call_key("http.request", calls[1])
    assert [(i["tool"], i["key"]) for i in of_kind(records, "ToolCallIntent")] == [
        ("http.request", key)
    ]
    got, posted = server.requests
    assert got["method"] == "GET" and "Idempotency-Key" not in got["headers"]
    assert posted["method"] == "POST" and posted["body"] == "apple"
    assert posted["headers"]["Idempotency-Key"] == idempotency_key(session_id, "root", key)


@pytest.mark.anyio
async def test_a_call_whose_server_dies_mid_call_is_an_unknown_outcome_not_an_error(
    mesh: Mesh, shop: Shop
) -> None:
    """The MCP server process is SIGKILLed while a call waits inside it after its effect (the
    worker lives on): the idempotent call runs again under its key on a new server process and
    is applied once; the plain side effect is not reported to the model as an error it might
    retry: it is held for the operator as an unknown outcome, and its effect stays single."""
    import os
    import signal

    calls = {"put": {"item": "pear", "value": "green"}, "charge": {"amount": 11}}
    for tool, args in calls.items():
        shop.hold()
        async with Client(mesh.url) as client:
            session_id = await client.start_session(
                f"mcp broken {tool}", definition=buyer(f"broken-{tool}", tool, args)
            )

            sent = "put pear=green" if tool == "put" else "charge 11"

            async def inside(sent: str = sent) -> bool:
                return any(line.startswith(sent) for line in shop.lines("calls.txt"))

            await wait_for(inside, f"the {tool} call is inside the MCP server")
            os.kill(int(shop.lines("pids.txt")[-1]), signal.SIGKILL)
            shop.release()
            if tool == "put":
                records = await records_of(client, session_id)
                assert of_kind(records, "SessionEnded")[-1]["status"] == "completed"
                key = call_key("shop.put", args)
                assert [i["key"] for i in of_kind(records, "ToolCallIntent")] == [key, key]
                assert [r["outcome"] for r in of_kind(records, "ToolCallRecorded")] == ["ok"]
                assert shop.lines("effects.txt").count("put pear=green") == 1
                continue

            async def held(session_id: str = session_id) -> Any:
                entries = {r.session_id: r for r in await client.list_recoverable()}
                return entries.get(session_id)

            entry = await wait_for(held, "the charge is held for an operator")
            assert entry.category == "held"
            assert [(u.tool, u.args) for u in entry.unknown_outcomes] == [("shop.charge", args)]
            await client.resume(session_id, confirm=True)
            records = await records_of(client, session_id)
            recorded = of_kind(records, "ToolCallRecorded")
            assert [r["outcome"] for r in recorded] == ["unknown"]
            assert "interrupted" in recorded[0]["result"]
            assert of_kind(records, "SessionEnded")[-1]["status"] == "completed"
    assert shop.lines("effects.txt").count("charge 11") == 1
    assert len([line for line in shop.lines("calls.txt") if line.startswith("charge 11")]) == 1
