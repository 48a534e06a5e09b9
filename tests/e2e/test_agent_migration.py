"""An operator moves a stranded session to another published version of its agent, end to end.

Real processes (``mesh``): ``writer@1.0.0`` plans three parts and has a worker role append one
line per part to a file in the shared workspace, one part at a time. The daemon is killed while
the session runs, so its side effects put it on the recoverable list. ``writer@1.1.0`` changes the
worker's instructions, script and skill body and the root's last answer. The operator sees the
difference, resumes with ``--migrate-pin agent=1.1.0``, and the session completes on 1.1.0: the
log's fold shows the migrated shape, the parts dispatched after the move ran with the 1.1.0 config
(the line they appended says so), and the lines appended before the move were not appended again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
from tests.e2e.plane_support import events, recoverable, run_cli, session_view, wait_terminal

from apomesh.core.envelope import Envelope
from apomesh.core.events import Event
from apomesh.core.state import SessionState, fold
from apomesh.testing import Mesh

STYLE_V1 = "Plain sentences.\n"
STYLE_V2 = "Loud sentences!\n"


def writer(version: str, *, coordination: str = "fanout") -> dict[str, Any]:
    return {
        "name": "writer",
        "version": version,
        "instructions": f"Split the goal into parts ({version}).",
        "coordination": coordination,
        "coordination_params": {"max_parallel": 1},
        "model": {
            "provider": "scripted",
            "turns": [{"plan": ["alpha", "beta", "gamma"]}, {"final": f"all parts by {version}"}],
        },
        "roles": {
            "worker": {
                "instructions": f"Write your part as {version} does.",
                "tools": ["fs.append"],
                "skills": ["style"],
                "model": {
                    "provider": "scripted",
                    "turns": [
                        {
                            "tool_calls": [
                                {
                                    "tool": "fs.append",
                                    "args": {"path": "out.txt", "line": f"{version} {{task}}"},
                                }
                            ]
                        },
                        {"delay": 1.5, "final": f"wrote {{task}} with {version}"},
                    ],
                },
            }
        },
    }


def publish(url: str, definition: dict[str, Any], style: str) -> None:
    assert httpx.put(f"{url}/v1/skills/style", json={"body": style}).status_code == 200
    response = httpx.post(f"{url}/v1/agents", json=definition, timeout=30.0)
    assert response.status_code == 201, response.text


def wait_for(predicate: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def phase(url: str, session_id: str, ref: str) -> str | None:
    agents = {a["ref"]: a for a in session_view(url, session_id)["agents"]}
    return agents[ref]["phase"] if ref in agents else None


def folded(records: list[dict[str, Any]], session_id: str) -> SessionState:
    """The fold of a session's log as the events stream served it."""
    envelopes = [
        Envelope(
            1,
            session_id,
            r["index"],
            r["ts"],
            r.get("event_id", ""),
            msgspec.convert({**r["event"], "kind": r["kind"]}, Event, strict=False),  # type: ignore[arg-type]
        )
        for r in records
    ]
    return fold(envelopes, session_id)


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def test_an_operator_moves_a_stranded_session_to_a_new_agent_version(mesh: Mesh) -> None:
    url = mesh.url
    publish(url, writer("1.0.0"), STYLE_V1)
    start = httpx.post(f"{url}/v1/sessions", json={"goal": "write", "agent": "writer@1.0.0"})
    assert start.status_code == 201, start.text
    session_id = start.json()["session_id"]
    out = mesh.daemon.workspace / session_id / "out.txt"

    # A side effect is on the log and the session still runs: killed now, it needs an operator.
    wait_for(lambda: phase(url, session_id, "root/0") == "completed", "the first part")
    mesh.daemon.kill()
    mesh.daemon.start()
    entry = wait_for(lambda: recoverable(url).get(session_id), "the recoverable entry")
    assert entry["category"] == "side_effects"
    before = lines(out)
    assert "1.0.0 alpha" in before and not any(line.startswith("1.1.0") for line in before)

    publish(url, writer("1.1.0"), STYLE_V2)
    publish(url, writer("2.0.0", coordination="refine"), STYLE_V2)

    # The operator sees the difference between the bundles first.
    preview = httpx.get(
        f"{url}/v1/recoverable/{session_id}", params={"migrate_pin": "agent=1.1.0"}
    ).json()
    diff = preview["agent_diff"]
    assert (diff["old"], diff["new"]) == ("writer@1.0.0", "writer@1.1.0")
    assert diff["old_digest"] != diff["new_digest"]
    assert [s["name"] for s in diff["skills"]] == ["style"]
    assert diff["coordination"] == ["fanout", "fanout"]
    assert diff["roles"] == ["root", "worker"]
    assert diff["problem"] is None
    confirm = httpx.post(
        f"{url}/v1/sessions/{session_id}/resume", json={"migrate_pins": {"agent": "1.1.0"}}
    )
    assert confirm.status_code == 409 and confirm.json()["preview"]["agent_diff"] == diff

    # Refused, and nothing logged: an unpublished version, a changed coordination kind.
    resume = f"{url}/v1/sessions/{session_id}/resume"
    missing = httpx.post(resume, json={"confirm": True, "migrate_pins": {"agent": "9.9.9"}})
    assert missing.status_code == 404, missing.text
    kind = httpx.post(resume, json={"confirm": True, "migrate_pins": {"agent": "2.0.0"}})
    assert kind.status_code == 409 and kind.json()["error"] == "migration_refused"
    assert "keeps the coordination kind" in kind.json()["message"]
    assert session_id in recoverable(url)

    done = run_cli(url, "recover", "resume", session_id, "--migrate-pin", "agent=1.1.0", "--yes")
    assert "moving the agent writer@1.0.0 -> writer@1.1.0" in done.stdout
    assert "skill style:" in done.stdout
    assert "migrating pin agent: 1.0.0 -> 1.1.0" in done.stdout
    view = wait_terminal(url, session_id)
    assert view["status"] == "completed", view
    assert view["output"] == "all parts by 1.1.0"
    assert view["agent"] == "writer@1.1.0"

    # A completed session is not stranded: it cannot be migrated.
    again = httpx.post(resume, json={"confirm": True, "migrate_pins": {"agent": "1.1.0"}})
    assert again.status_code == 409 and again.json()["error"] == "migration_refused"

    log = events(url, session_id)
    state = folded(log, session_id)
    actions = [r for r in log if r["kind"] == "OperatorAction"]
    assert [a["event"]["action"] for a in actions] == ["migrate_pin", "resume"]
    moved_at = actions[0]["index"]
    assert actions[0]["event"]["detail"]["agent"] == {"from": "writer@1.0.0", "to": "writer@1.1.0"}
    assert state.bootstrap is not None and state.bootstrap.shape.agent == "writer@1.0.0"
    shape = state.effective_shape
    assert shape is not None and shape.agent == "writer@1.1.0"
    assert [s.body for s in shape.skills] == [STYLE_V2]

    # Every agent dispatched after the move ran with its role's 1.1.0 config.
    dispatched_after = {
        r["event"]["agent"]
        for r in log
        if r["index"] > moved_at and r["kind"] == "AgentLifecycle"
        if r["event"]["phase"] == "dispatched"
    }
    assert "root" in dispatched_after and len(dispatched_after) >= 2
    for ref in dispatched_after:
        config = state.agents[ref].current_config
        assert config is not None and config.version == "1.1.0", ref
        assert config.skills == [] or [s.body for s in config.skills] == [STYLE_V2]
    assert state.agents["root/0"].current_config.version == "1.0.0"  # type: ignore[union-attr]
    born_before = {ref for ref, a in state.agents.items() if a.born_index < moved_at}
    for ref in dispatched_after & born_before:
        assert state.agents[ref].config.version == "1.0.0"  # type: ignore[union-attr]

    # The effects before the move stay as they were; the parts after it wrote 1.1.0 lines.
    after = lines(out)
    assert after[: len(before)] == before
    assert sorted(after) == sorted(set(after))  # nothing appended twice
    # A 1.0.0 call in flight at the kill may land after ``before`` was read: a probe settles it.
    settled = [
        r
        for r in log
        if r["kind"] == "ToolCallRecorded"
        and r["index"] > moved_at
        and r["event"].get("resolved_by") == "probe"
    ]
    late = [line for line in after[len(before) :] if line.startswith("1.0.0 ")]
    assert len(late) <= len(settled), (late, settled)
    new_lines = [line for line in after[len(before) :] if line.startswith("1.1.0 ")]
    assert new_lines and all(line.startswith(("1.0.0 ", "1.1.0 ")) for line in after)
    parts = {line.split(" ", 1)[1] for line in after}
    assert parts == {"alpha", "beta", "gamma"}
    # Each result recorded after the move is a line written after it, but for a call whose effect
    # happened before the kill (its line is in ``before``): its probe settles it, writing nothing
    # (as an unknown outcome would).
    recorded = [
        r
        for r in log
        if r["kind"] == "ToolCallRecorded"
        and r["index"] > moved_at
        and r["event"].get("resolved_by") != "probe"
        and r["event"]["outcome"] in ("ok", "error")
    ]
    assert len(recorded) == len(new_lines), recorded
