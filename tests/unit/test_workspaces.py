"""Which directory an agent's tools act in: its session's own by default, the shared workspace
when its definition asks, and the shared one for a config pinned before agents had their own."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from apomesh.core.definition import AgentConfig, parse_definition, role_config
from apomesh.core.errors import ApomeshError, DefinitionError
from apomesh.runtime.agent_loop import agent_workspace
from apomesh.runtime.protocol import Run


def config_of(**extra: object) -> AgentConfig:
    definition = parse_definition({"name": "a", "roles": {"worker": {}}, **extra})
    return role_config(definition, "root", [])


def test_a_session_workspace_by_default_and_the_shared_one_when_asked() -> None:
    root = Path("/srv/workspace")
    own = Run("5f0c9a", "root", 1, config_of(), "act", "")
    assert agent_workspace(root, own) == root / "5f0c9a"
    shared = Run("5f0c9a", "root", 1, config_of(workspace="shared"), "act", "")
    assert agent_workspace(root, shared) == root
    definition = parse_definition({"name": "a", "workspace": "shared", "roles": {"worker": {}}})
    assert role_config(definition, "worker", []).workspace == "shared"  # roles share it


def test_a_session_id_that_cannot_name_a_directory_is_refused() -> None:
    for bad in ("a/b", "/etc", "", "x" * 201):
        with pytest.raises(ApomeshError, match="cannot name a workspace directory"):
            agent_workspace(Path("/w"), Run(bad, "root", 1, config_of(), "act", ""))


def test_an_unknown_scope_is_refused_at_submit_and_an_old_config_decodes_as_shared() -> None:
    with pytest.raises(DefinitionError, match=r"\$\.workspace"):
        parse_definition({"name": "a", "workspace": "private"})
    old = msgspec.json.encode(config_of())
    without = msgspec.json.decode(old)
    del without["workspace"]
    assert msgspec.convert(without, AgentConfig).workspace == "shared"
