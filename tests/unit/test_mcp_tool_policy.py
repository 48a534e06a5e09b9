"""MCP tool servers without a mesh: the config that names them, the journal policy their
annotations give, the daemon accepting their tools at submit, and a real server's tools
(``tests/fakes/mcp_server.py``, over stdio and streamable HTTP) called through ``McpTools``."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from mcp_types import ToolAnnotations

from apomesh.adapters.natsserver import free_port
from apomesh.builtin.mcp_tools import McpServer, McpTools, journal_policy
from apomesh.core.errors import DefinitionError, ToolError
from apomesh.plugins.manager import PluginHost
from apomesh.plugins.pins import pins_for
from apomesh.runtime.config import load_config

SERVER = Path(__file__).resolve().parents[1] / "fakes" / "mcp_server.py"


def test_the_annotations_decide_the_journal_policy() -> None:
    read_only = ToolAnnotations(read_only_hint=True)
    idempotent = ToolAnnotations(idempotent_hint=True)
    destructive = ToolAnnotations(destructive_hint=True)
    assert journal_policy(read_only, "hold") == (False, False, "hold")
    assert journal_policy(idempotent, "hold") == (True, True, "rerun")
    assert journal_policy(destructive, "hold") == (True, False, "hold")
    assert journal_policy(None, "fail") == (True, False, "fail")
    assert journal_policy(ToolAnnotations(), "hold") == (True, False, "hold")


@pytest.mark.parametrize(
    ("table", "problem", "where"),
    [
        ('[mcp.servers.shop]\ncommand = ["x"]\nurl = "http://h/mcp"', "exactly one", "shop"),
        ("[mcp.servers.shop]\nenv = {}", "exactly one", "shop"),
        ('[mcp.servers.shop]\nurl = "ftp://h/mcp"', "http:// or https://", "shop"),
        ('[mcp.servers.Shop]\ncommand = ["x"]', "lower-case", "Shop"),
        (
            '[mcp.servers.shop]\ncommand = ["x"]\non_unknown = "rerun"',
            "Invalid enum",
            "[...].on_unknown",
        ),
    ],
)
def test_a_server_the_config_cannot_use_is_refused_with_its_path(
    tmp_path: Path, table: str, problem: str, where: str
) -> None:
    path = tmp_path / "apomesh.toml"
    path.write_text(table + "\n")
    with pytest.raises(DefinitionError, match=problem) as raised:
        load_config(path, env={})
    assert f"$.mcp.servers{'' if where.startswith('[') else '.'}{where}" in str(raised.value)


def test_the_daemon_accepts_a_named_server_tools_and_pins_nothing_for_them() -> None:
    host = PluginHost.for_tests()
    with pytest.raises(DefinitionError, match=r"unknown tool 'shop\.charge'"):
        pins_for(host, "solo", ["shop.charge"], [])
    host.tool_servers = frozenset({"shop"})
    assert pins_for(host, "solo", ["shop.charge"], []) == pins_for(host, "solo", [], [])
    assert not host.served_remotely("fs.read") and not host.served_remotely("shop")


class Ctx:
    idempotency_key = "key-1"


@pytest.mark.anyio
async def test_a_stdio_server_tools_are_apomesh_tools(tmp_path: Path) -> None:
    server = McpServer(command=[sys.executable, str(SERVER), str(tmp_path)])
    down = McpServer(command=[sys.executable, "-c", "raise SystemExit(3)"], timeout=5)
    async with McpTools({"shop": server, "down": down}) as mcp:
        tools = {tool.name: tool for tool in mcp.tools}
        assert sorted(tools) == ["shop.charge", "shop.fail", "shop.lookup", "shop.put"]
        assert list(mcp.unreachable) == ["down"]
        assert "ExceptionGroup" not in mcp.unreachable["down"], mcp.unreachable
        charge = tools["shop.charge"]
        assert (charge.side_effect, charge.idempotent, charge.on_unknown) == (True, False, "hold")
        assert charge.parameters["required"] == ["amount"]
        assert await tools["shop.lookup"].run(Ctx(), {"item": "pear"}) == "pear costs 5"
        assert await charge.run(Ctx(), {"amount": 2}) == "charged 2"
        with pytest.raises(ToolError, match=r"shop\.fail: .*out of pears"):
            await tools["shop.fail"].run(Ctx(), {"reason": "out of pears"})
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls == ["lookup pear", "charge 2 key=key-1"]


@pytest.mark.anyio
async def test_a_streamable_http_server_tools_are_apomesh_tools(tmp_path: Path) -> None:
    port = free_port()
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed with the process below
    process = subprocess.Popen(
        [sys.executable, str(SERVER), str(tmp_path), "--http", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        with anyio.fail_after(60):
            while True:  # until the server listens
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    assert process.poll() is None, (tmp_path / "server.log").read_text()
                    await anyio.sleep(0.1)
        async with McpTools({"shop": McpServer(url=url)}) as mcp:
            tools = {tool.name: tool for tool in mcp.tools}
            assert not mcp.unreachable
            put = tools["shop.put"]
            assert (put.side_effect, put.idempotent, put.on_unknown) == (True, True, "rerun")
            assert await put.run(Ctx(), {"item": "fig", "value": "ripe"}) == "fig is ripe"
            assert await put.run(Ctx(), {"item": "fig", "value": "ripe"}) == "fig is ripe"
        assert (tmp_path / "effects.txt").read_text().splitlines() == ["put fig=ripe"]
    finally:
        process.terminate()
        process.wait(10)
        log.close()
