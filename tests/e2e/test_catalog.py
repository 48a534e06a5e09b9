"""The agent-configuration plane end to end: the skill catalog, the skill resolvers in their order,
published agents sealed as bundles, and sessions started from them.

Real processes (``mesh``: a nats-server, an ``apomesh serve`` process, two worker processes); the
command line is run as a user runs it, in a subprocess. The skill resolvers exercised are the
catalog (KV), the ``[skills] directory`` of the daemon's configuration, the built-in
``entrypoint`` resolver (a skill shipped as an ``apomesh.skills`` entry point) and the third-party
``skillpack`` plugin.
"""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from tests.e2e.plane_support import (
    SKILLPACK_PROJECT,
    events,
    install_test_plugins,
    run_cli,
    wait_terminal,
)

import apomesh
from apomesh.testing import Mesh

TONE_V1 = "Be terse.\r\nNever use exclamation marks \u2014 not once.\n  trailing blanks  \n"
TONE_V2 = "Be chatty.\n"
SHIPPED = SKILLPACK_PROJECT / "src" / "apomesh_skillpack" / "skills"

JSON = {"Content-Type": "application/json"}
"""Every write says JSON (the API refuses any other with 415)."""


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@pytest.fixture(scope="session", autouse=True)
def plugin_packages() -> None:
    install_test_plugins()


def writer(version: str = "1.0.0", skills: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "name": "writer",
        "version": version,
        "instructions": "Write what you are asked.",
        "coordination": "solo",
        "skills": ["tone"] if skills is None else skills,
        "model": {"provider": "scripted", "turns": [{"final": "written"}]},
        **extra,
    }


def started_shape(url: str, session_id: str) -> dict[str, Any]:
    assert wait_terminal(url, session_id)["status"] == "completed"
    first = events(url, session_id)[0]
    assert first["kind"] == "SessionStarted"
    shape: dict[str, Any] = first["event"]["shape"]
    return shape


# --- the skill catalog -----------------------------------------------------------------------------


def test_skills_put_get_list_history_and_delete_from_the_cli_and_rest(
    mesh: Mesh, tmp_path: Path
) -> None:
    skill_file = tmp_path / "tone.md"
    skill_file.write_bytes(TONE_V1.encode("utf-8"))
    put = run_cli(mesh.url, "skills", "put", "tone", str(skill_file))
    assert f"skill tone revision 1 digest {sha256(TONE_V1)[:12]}" in put.stdout

    got = httpx.get(f"{mesh.url}/v1/skills/tone").json()
    assert (got["body"], got["digest"], got["revision"]) == (TONE_V1, sha256(TONE_V1), 1)
    raw = subprocess.run(
        [sys.executable, "-m", "apomesh", "skills", "get", "tone", "--url", mesh.url],
        capture_output=True, check=True,
    )  # fmt: skip
    assert raw.stdout == TONE_V1.encode("utf-8")  # byte for byte

    second = httpx.put(f"{mesh.url}/v1/skills/tone", json={"body": TONE_V2})
    assert second.status_code == 200 and second.json()["revision"] > 1
    assert httpx.put(f"{mesh.url}/v1/skills/house-style", json={"body": "x"}).status_code == 200

    listed = run_cli(mesh.url, "skills", "list").stdout
    assert "tone" in listed and "house-style" in listed
    rest_list = httpx.get(f"{mesh.url}/v1/skills").json()["skills"]
    assert [(s["name"], s["body"]) for s in rest_list] == [("house-style", "x"), ("tone", TONE_V2)]

    history = run_cli(mesh.url, "skills", "history", "tone").stdout
    assert sha256(TONE_V1)[:12] in history and sha256(TONE_V2)[:12] in history
    bodies = [s["body"] for s in httpx.get(f"{mesh.url}/v1/skills/tone/history").json()["skills"]]
    assert bodies == [TONE_V1, TONE_V2]

    assert "deleted tone" in run_cli(mesh.url, "skills", "rm", "tone").stdout
    gone = httpx.get(f"{mesh.url}/v1/skills/tone")
    assert gone.status_code == 404 and gone.json()["error"] == "not_found"
    assert run_cli(mesh.url, "skills", "get", "tone", check=False).returncode == 1
    # The history outlives the deletion; a name never put has none.
    kept = httpx.get(f"{mesh.url}/v1/skills/tone/history").json()["skills"]
    assert [s["body"] for s in kept] == [TONE_V1, TONE_V2]
    assert httpx.get(f"{mesh.url}/v1/skills/never/history").status_code == 404
    assert httpx.delete(f"{mesh.url}/v1/skills/never", headers=JSON).status_code == 404
    assert httpx.put(f"{mesh.url}/v1/skills/bad name", json={"body": "x"}).status_code == 400


def test_skills_resolve_from_the_catalog_then_the_directory_then_plugins_with_exact_bytes(
    bare_mesh: Mesh, tmp_path: Path
) -> None:
    directory = tmp_path / "skills"
    directory.mkdir()
    (directory / "tone.md").write_bytes(b"the directory's tone\n")
    dir_only = "from the directory\r\nkept as written \u00e9\n"
    (directory / "dir-only.md").write_bytes(dir_only.encode("utf-8"))
    (directory / "plain-language.md").write_bytes(b"the directory shadows the skill pack\n")
    (directory / "with-tools.toml").write_text('body = "use the list"\ntools = ["fs.list"]\n')
    bare_mesh.daemon.env["APOMESH_SKILLS_DIRECTORY"] = str(directory)
    bare_mesh.start(2)
    assert httpx.put(f"{bare_mesh.url}/v1/skills/tone", json={"body": TONE_V1}).status_code == 200

    names = [
        "tone",
        "dir-only",
        "plain-language",
        "cite-sources",
        "skillpack-checklist",
        "with-tools",
    ]
    response = httpx.post(
        f"{bare_mesh.url}/v1/sessions", json={"goal": "write", "definition": writer(skills=names)}
    )
    assert response.status_code == 201, response.text
    shape = started_shape(bare_mesh.url, response.json()["session_id"])
    pins = {s["name"]: s for s in shape["skills"]}
    from apomesh_skillpack.shipped import CHECKLIST

    expected = {
        "tone": ("catalog", TONE_V1),
        "dir-only": ("directory", dir_only),
        "plain-language": ("directory", "the directory shadows the skill pack\n"),
        "cite-sources": ("skillpack", (SHIPPED / "cite-sources.md").read_bytes().decode()),
        "skillpack-checklist": ("entrypoint", CHECKLIST),
        "with-tools": ("directory", "use the list"),
    }
    assert {n: (p["resolver"], p["body"]) for n, p in pins.items()} == expected
    assert all(p["digest"] == sha256(p["body"]) for p in pins.values())
    assert pins["with-tools"]["tools"] == ["fs.list"]
    assert [s["name"] for s in shape["root"]["skills"]] == names

    unknown = httpx.post(
        f"{bare_mesh.url}/v1/sessions", json={"goal": "w", "definition": writer(skills=["nowhere"])}
    )
    assert unknown.status_code == 400
    message = unknown.json()["message"]
    assert "'nowhere'" in message and "catalog, directory, entrypoint, skillpack" in message


# --- published agents ------------------------------------------------------------------------------


def write_agent_file(path: Path, instructions: str) -> Path:
    (path.parent / "writer.script.toml").write_text('[[turns]]\nfinal = "written"\n')
    path.write_text(
        textwrap.dedent(
            f"""\
            name = "writer"
            version = "1.0.0"
            instructions = "{instructions}"
            coordination = "solo"
            skills = ["tone"]
            [model]
            provider = "scripted"
            script = "writer.script.toml"
            """
        )
    )
    return path


def test_publishing_seals_a_bundle_once_and_refuses_other_content(
    mesh: Mesh, tmp_path: Path
) -> None:
    assert httpx.put(f"{mesh.url}/v1/skills/tone", json={"body": TONE_V1}).status_code == 200
    agent_file = write_agent_file(tmp_path / "writer.toml", "Write what you are asked.")

    assert (
        "published writer@1.0.0" in run_cli(mesh.url, "agents", "publish", str(agent_file)).stdout
    )
    again = run_cli(mesh.url, "agents", "publish", str(agent_file))
    assert "already published (same content) writer@1.0.0" in again.stdout

    changed = write_agent_file(tmp_path / "changed.toml", "Write something else.")
    refused = run_cli(mesh.url, "agents", "publish", str(changed), check=False)
    assert refused.returncode == 1 and "publish_conflict" in refused.stderr

    # The same over REST: the definition as JSON, its script inline.
    from apomesh.runtime.composition import load_definition_file

    definition = load_definition_file(agent_file)
    same = httpx.post(f"{mesh.url}/v1/agents", json=definition)
    assert same.status_code == 200 and same.json()["version"] == "1.0.0"
    other = httpx.post(f"{mesh.url}/v1/agents", json={**definition, "description": "new"})
    assert other.status_code == 409 and other.json()["error"] == "publish_conflict"
    newer = httpx.post(f"{mesh.url}/v1/agents", json={**definition, "version": "1.1.0"})
    assert newer.status_code == 201

    # The bundle is sealed: the catalog changes, the published agent does not.
    assert httpx.put(f"{mesh.url}/v1/skills/tone", json={"body": TONE_V2}).status_code == 200
    resealed = httpx.post(f"{mesh.url}/v1/agents", json=definition)
    assert resealed.status_code == 409  # same definition, other skill bytes: other content

    listed = run_cli(mesh.url, "agents", "list").stdout
    assert "writer" in listed and "1.0.0" in listed and "1.1.0" in listed
    latest = msgspec.json.decode(run_cli(mesh.url, "agents", "show", "writer", "-o", "json").stdout)
    assert latest["version"] == "1.1.0"
    pinned = msgspec.json.decode(
        run_cli(mesh.url, "agents", "show", "writer@1.0.0", "-o", "json").stdout
    )
    assert pinned["version"] == "1.0.0" and pinned["skills"] == ["tone"]
    assert {"name": "apomesh", "version": apomesh.__version__} in pinned["plugins"]
    assert httpx.get(f"{mesh.url}/v1/agents/writer", params={"version": "9"}).status_code == 404

    started = httpx.post(
        f"{mesh.url}/v1/sessions",
        json={"goal": "write", "agent": {"name": "writer", "version": "1.0.0"}},
    )
    assert started.status_code == 201, started.text
    shape = started_shape(mesh.url, started.json()["session_id"])
    assert (shape["source"], shape["agent"]) == ("published", "writer@1.0.0")
    assert [(s["name"], s["body"]) for s in shape["skills"]] == [("tone", TONE_V1)]
    assert shape["root"]["skills"][0]["body"] == TONE_V1


def test_a_bundle_lacking_a_skill_or_sealed_with_other_pins_is_a_typed_error(mesh: Mesh) -> None:
    from apomesh.adapters.kv import KvBuckets
    from apomesh.core.definition import PinnedSkill
    from apomesh.core.events import PluginPin
    from apomesh.runtime.catalog import AgentBundle

    good = PinnedSkill("tone", TONE_V1, sha256(TONE_V1), "catalog")
    spoiled = PinnedSkill("tone", TONE_V2, sha256(TONE_V1), "catalog")
    installed = PluginPin("apomesh", apomesh.__version__)

    def bundle(version: str, skills: list[PinnedSkill], plugins: list[PluginPin]) -> bytes:
        definition = msgspec.to_builtins(writer(version))
        return msgspec.json.encode(
            AgentBundle(
                name="writer", version=version, digest="", definition=definition, skills=skills,
                coordination="solo", coordination_params={}, plugins=plugins,
            )
        )  # fmt: skip

    async def seal_by_hand() -> None:
        import nats

        nc = await nats.connect(mesh.nats_url)
        try:
            kv = await KvBuckets.open(nc)
            await kv.agents.create("writer@1.0.0", bundle("1.0.0", [], [installed]))
            await kv.agents.create("writer@2.0.0", bundle("2.0.0", [spoiled], [installed]))
            await kv.agents.create(
                "writer@3.0.0", bundle("3.0.0", [good], [PluginPin("apomesh", "0.0.1")])
            )
        finally:
            await nc.close()

    asyncio.run(seal_by_hand())
    # A correct `tone` is in the catalog: composition must not reach for it.
    assert httpx.put(f"{mesh.url}/v1/skills/tone", json={"body": TONE_V1}).status_code == 200

    cases = {
        "1.0.0": (
            "missing_skill",
            "pin 'writer@1.0.0 skill tone': the sealed bundle lacks this skill",
        ),
        "2.0.0": (
            "corrupt_pin",
            "pin 'writer@2.0.0 skill tone': the sealed skill body does not match",
        ),
        "3.0.0": (
            "plugin_pin_mismatch",
            "pin 'apomesh==0.0.1': the plugin is installed at version",
        ),
    }
    for version, (code, message) in cases.items():
        body = {"goal": "write", "agent": {"name": "writer", "version": version}}
        response = httpx.post(f"{mesh.url}/v1/sessions", json=body)
        assert response.status_code == 409, response.text
        assert response.json()["error"] == code
        assert message in response.json()["message"]
    assert httpx.get(f"{mesh.url}/v1/sessions").json()["sessions"] == []
