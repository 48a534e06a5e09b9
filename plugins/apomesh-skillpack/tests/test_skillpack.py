"""The skillpack resolver, loaded through its entry point, and its skills pinned by a real system.

The resolver is taken from a plugin host that loads only this distribution, so what is tested is
what a daemon loads. The end-to-end test uses apomesh's ``mesh`` fixture: a real nats-server, an
``apomesh serve`` process and two worker processes.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from apomesh.core.errors import DefinitionError
from apomesh.plugins.api import SkillResolver
from apomesh.plugins.manager import PluginHost
from apomesh.sdk.client import SyncClient
from apomesh.testing import Mesh

DIST = "apomesh-skillpack"
SHIPPED = Path(__file__).resolve().parents[1] / "src" / "apomesh_skillpack" / "skills"


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def resolver_from_entry_point() -> SkillResolver:
    host = PluginHost(allow=[DIST], environ={})
    (found,) = [r for r in host.skill_resolvers() if r.name == "skillpack"]
    return found


def test_the_entry_point_registers_the_skillpack_resolver() -> None:
    host = PluginHost(allow=[DIST], environ={})
    assert [r.name for r in host.skill_resolvers()] == ["entrypoint", "skillpack"]
    assert host.owner_of("skill_resolver", "skillpack").name == DIST


@pytest.mark.anyio
@pytest.mark.parametrize("skill", ["plain-language", "cite-sources"])
async def test_a_shipped_skill_is_the_file_byte_for_byte_with_its_digest(skill: str) -> None:
    found = await resolver_from_entry_point().resolve(skill)
    assert found is not None
    expected = (SHIPPED / f"{skill}.md").read_bytes().decode("utf-8")
    assert found.body == expected
    assert found.digest == sha256(expected)
    if skill == "cite-sources":
        assert "\r\n" in found.body  # line endings are kept, not normalised


@pytest.mark.anyio
async def test_a_pack_on_the_search_path_comes_first_and_unknown_names_defer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "plain-language.md").write_bytes(b"pack override\r\n")
    (second / "house-rules.md").write_bytes("no \u00e9moji\n".encode())
    monkeypatch.setenv("APOMESH_SKILLPACK_PATH", os.pathsep.join([str(first), str(second)]))
    resolver = resolver_from_entry_point()

    override = await resolver.resolve("plain-language")
    assert override is not None and override.body == "pack override\r\n"
    rules = await resolver.resolve("house-rules")
    assert (
        rules is not None and rules.body == "no \u00e9moji\n" and rules.digest == sha256(rules.body)
    )
    assert await resolver.resolve("no-such-skill") is None
    with pytest.raises(DefinitionError, match="not a plain name"):
        await resolver.resolve("../etc/passwd")


def wait_status(client: SyncClient, session_id: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    view = client.get_session(session_id)
    while view.status not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.1)
        view = client.get_session(session_id)
    return view


def test_a_session_pins_the_packaged_skills_with_the_resolver_that_gave_them(mesh: Mesh) -> None:
    client = SyncClient(mesh.url)
    definition = {
        "name": "careful-writer",
        "instructions": "Write carefully.",
        "skills": ["plain-language", "cite-sources", "skillpack-checklist"],
        "model": {"provider": "scripted", "turns": [{"final": "done"}]},
    }
    session_id = client.start_session("write", definition=definition)
    assert wait_status(client, session_id).status == "completed"

    started = next(iter(client.events(session_id)))
    assert started.kind == "SessionStarted"
    assert started.event["shape"]["source"] == "catalog"
    pins = {s["name"]: s for s in started.event["shape"]["skills"]}
    for name in ("plain-language", "cite-sources"):
        body = (SHIPPED / f"{name}.md").read_bytes().decode("utf-8")
        assert pins[name]["resolver"] == "skillpack"
        assert pins[name]["body"] == body and pins[name]["digest"] == sha256(body)
    # The package's `apomesh.skills` entry point, found by apomesh's built-in resolver.
    from apomesh_skillpack.shipped import CHECKLIST

    assert pins["skillpack-checklist"]["resolver"] == "entrypoint"
    assert pins["skillpack-checklist"]["body"] == CHECKLIST
