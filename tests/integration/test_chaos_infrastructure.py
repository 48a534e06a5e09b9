"""The chaos infrastructure itself: the fresh-model server never repeats itself, pairs tool-call
ids like the real API, keeps a structure the openai provider completes, injects the faults it is
configured with, and serves its record to other processes; the session audit flags a planted
duplicate, a planted missing effect, a rephrased re-run and an output no model gave."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.e2e.chaos_audit import audit_session
from tests.fakes.fresh_model import Behaviour, Fault, FreshModelServer, fetch_log

from apomesh.builtin.openai_model import OpenAIProvider
from apomesh.core.definition import ModelSpec
from apomesh.plugins.api import Message, ModelError, ModelRequest

APPEND_TOOLS = [
    {"name": "fs.append", "description": "append", "parameters": {"type": "object"}},
    {"name": "fs.list", "description": "list", "parameters": {"type": "object"}},
]


def _body(model: str, messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages or [{"role": "user", "content": "write the thing"}],
        "tools": [
            {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
            for n in ("fs__append", "fs__list")
        ],
    }


def _post(server: FreshModelServer, body: dict[str, Any], timeout: float = 10) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=timeout)


def _provider_model(server: FreshModelServer, name: str, timeout: float = 10.0) -> Any:
    table = server.model(name, timeout=timeout)
    options = {k: v for k, v in table.items() if k not in ("provider", "model")}
    return OpenAIProvider(environ={}).create(ModelSpec("openai", table["model"], options=options))


def test_the_same_request_never_gets_the_same_answer() -> None:
    with FreshModelServer() as server:
        answers = [_post(server, _body("fresh:appends=2")).json() for _ in range(5)]
    calls = [a["choices"][0]["message"]["tool_calls"] for a in answers]
    assert all(c[0]["function"]["name"] == "fs__append" for c in calls)
    arguments = {c[0]["function"]["arguments"] for c in calls}
    ids = {c[0]["id"] for c in calls}
    assert len(arguments) == len(ids) == 5


def test_tool_call_ids_must_pair_up_like_the_real_api() -> None:
    unanswered = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "fs__list", "arguments": "{}"}},
        ]},
        {"role": "user", "content": "and?"},
    ]  # fmt: skip
    stray = [
        {"role": "user", "content": "go"},
        {"role": "tool", "tool_call_id": "call_9", "content": "x"},
    ]
    with FreshModelServer() as server:
        for messages in (unanswered, stray):
            reply = _post(server, _body("fresh", messages))
            assert reply.status_code == 400, reply.text
            assert "tool" in reply.json()["error"]["message"]


@pytest.mark.anyio
async def test_the_openai_provider_completes_an_agent_against_it() -> None:
    """appends=3,reads=1: three turns of an append beside a read-only call, then a final text."""
    with FreshModelServer() as server:
        model = _provider_model(server, "fresh:appends=3,reads=1")
        messages = [Message(role="user", content="write the thing")]
        lines = []
        for _ in range(10):
            request = ModelRequest("be brief", messages, APPEND_TOOLS, {})
            response = await model.respond(request)
            if response.final is not None:
                break
            assert [c.tool for c in response.tool_calls] == ["fs.append", "fs.list"]
            lines.append(response.tool_calls[0].args["line"])
            messages.append(
                Message(role="assistant", content="", tool_calls=list(response.tool_calls))
            )
            messages += [
                Message(role="tool", content="done", name=c.tool) for c in response.tool_calls
            ]
        assert response.final is not None and response.final.startswith("fresh final ")
        assert len(lines) == len(set(lines)) == 3
        plan = await model.respond(
            ModelRequest("", [Message(role="user", content="goal")], [], {}, purpose="plan")
        )
        assert plan.plan is not None and len(plan.plan) == 2
        given = {c["answer"].get("content") for c in server.log() if c.get("answer")}
        assert response.final in given


def test_structure_follows_the_model_name_and_the_tools_offered() -> None:
    assert Behaviour.parse("fresh:appends=3,plan=4,jobs=1,fault=429@once+503@3") == Behaviour(
        appends=3, plan=4, jobs=1, faults=(Fault("429"), Fault("503", 3))
    )
    with pytest.raises(ValueError, match="unknown parameter"):
        Behaviour.parse("fresh:apends=3")
    with FreshModelServer() as server:
        body = _body("fresh:appends=1,jobs=1")  # jobs.sleep is not offered: only the append
        first = _post(server, body).json()["choices"][0]["message"]
        assert [c["function"]["name"] for c in first["tool_calls"]] == ["fs__append"]
        body["messages"] += [
            first,
            {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "ok"},
        ]
        second = _post(server, body).json()["choices"][0]
        assert second["finish_reason"] == "stop" and "tool_calls" not in second["message"]


def test_faults_once_and_every_kth_call() -> None:
    with FreshModelServer(faults=(Fault("503", 3),)) as server:
        once = [_post(server, _body("fresh:fault=429@once")) for _ in range(3)]
        assert [r.status_code for r in once] == [429, 200, 503]
        assert once[0].headers["Retry-After"] == "1"
        denied = [_post(server, _body("fresh:fault=401@2")).status_code for _ in range(4)]
        assert denied == [200, 401, 503, 401]
        ride = [_post(server, _body("fresh:fault=429@once+503#2+hang#9")) for _ in range(4)]
        assert [r.status_code for r in ride] == [429, 503, 503, 200]
    assert [c["fault"] for c in server.log()][:3] == ["429", None, "503"]


@pytest.mark.anyio
async def test_a_hang_outlasts_the_clients_timeout() -> None:
    with FreshModelServer(hang_seconds=3.0) as server:
        model = _provider_model(server, "fresh:fault=hang@once", timeout=0.3)
        request = ModelRequest("", [Message(role="user", content="go")], APPEND_TOOLS, {})
        with pytest.raises(ModelError, match="no answer") as raised:
            await model.respond(request)
        assert raised.value.retryable
        assert (await model.respond(request)).tool_calls


def test_runs_as_a_process_and_serves_its_record() -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.fresh_model", "--port", "0"],
        stdout=subprocess.PIPE, text=True, cwd=root,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        reply = httpx.post(f"{url}/chat/completions", json=_body("fresh"), timeout=10)
        assert reply.status_code == 200
        (call,) = fetch_log(url)
        assert call["answer"] == reply.json()["choices"][0]["message"]
        assert call["request"]["model"] == "fresh"
        (short,) = fetch_log(url, requests=False)
        assert "request" not in short and short["answer"] == call["answer"]
    finally:
        proc.kill()
        proc.wait()


# --- the audit ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rec:
    kind: str
    event: dict[str, Any]


def _intent(agent: str, key: str, path: str, line: str) -> Rec:
    args = {"path": path, "line": line}
    return Rec("ToolCallIntent", {"agent": agent, "key": key, "tool": "fs.append", "args": args})


def _ok(agent: str, key: str) -> Rec:
    return Rec(
        "ToolCallRecorded", {"agent": agent, "key": key, "tool": "fs.append", "outcome": "ok"}
    )


def _model_call(n: int, slot: str, step: int, answer: dict[str, Any]) -> dict[str, Any]:
    return {"n": n, "status": 200, "slot": slot, "step": step, "answer": answer}


def _append_answer(path: str, line: str) -> dict[str, Any]:
    args = json.dumps({"path": path, "line": line})
    call = {"id": "c", "type": "function", "function": {"name": "fs__append", "arguments": args}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def test_audit_flags_a_planted_duplicate_and_a_planted_missing_effect(tmp_path: Path) -> None:
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh/a.txt").write_text("one\none\n")  # "one" twice, "two" never
    records = [
        _intent("root", "k1", "fresh/a.txt", "one"),
        _ok("root", "k1"),
        _intent("root", "k2", "fresh/a.txt", "two"),
        _ok("root", "k2"),
        Rec("SessionEnded", {"status": "completed", "output": "done"}),
    ]
    audit = audit_session(records, {"ok": True, "problems": []}, tmp_path)
    assert audit.duplicates == 1
    assert audit.never_run == 1
    assert not audit.lost and not audit.undecodable


def test_audit_flags_a_rephrased_rerun_and_an_output_no_model_gave(tmp_path: Path) -> None:
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh/a.txt").write_text("first words\nsecond words\n")
    records = [
        _intent("root", "k1", "fresh/a.txt", "first words"),
        _intent("root", "k2", "fresh/a.txt", "second words"),
        _ok("root", "k2"),
        Rec("SessionEnded", {"status": "completed", "output": ""}),
    ]
    calls = [  # the same agent and step asked twice, answered differently, both effects ran
        _model_call(0, "s1", 0, _append_answer("fresh/a.txt", "first words")),
        _model_call(1, "s1", 0, _append_answer("fresh/a.txt", "second words")),
        _model_call(2, "s1", 1, {"role": "assistant", "content": "the real answer"}),
    ]
    audit = audit_session(records, {"ok": True, "problems": []}, tmp_path, calls)
    assert audit.duplicates == 1
    assert audit.output_from_model is False
    clean = audit_session(
        [*records[:-1], Rec("SessionEnded", {"status": "completed", "output": "the real answer"})],
        {"ok": True, "problems": []},
        tmp_path,
        calls[1:],
    )
    assert clean.output_from_model is True
    assert clean.foreign_effects == 1  # "first words" came from no answer in this record


def test_audit_counts_lost_and_undecodable_sessions(tmp_path: Path) -> None:
    verification = {"ok": False, "problems": [{"kind": "undecodable", "message": "bad"}]}
    audit = audit_session([Rec("SessionStarted", {})], verification, tmp_path, timed_out=True)
    assert audit.lost and audit.undecodable


def test_audit_counts_two_writes_for_one_step_though_the_file_keeps_one(tmp_path: Path) -> None:
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh/w.txt").write_text("second")

    def write(key: str, content: str) -> list[Rec]:
        args = {"path": "fresh/w.txt", "content": content}
        return [
            Rec("ToolCallIntent", {"agent": "root", "key": key, "tool": "fs.write", "args": args}),
            Rec("ToolCallRecorded", {"agent": "root", "key": key, "outcome": "ok"}),
        ]

    def answer(content: str) -> dict[str, Any]:
        args = json.dumps({"path": "fresh/w.txt", "content": content})
        call = {"id": "c", "type": "function", "function": {"name": "fs__write", "arguments": args}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}

    records = [*write("k1", "first"), *write("k2", "second")]
    calls = [_model_call(0, "s", 0, answer("first")), _model_call(1, "s", 0, answer("second"))]
    audit = audit_session(records, {"problems": []}, tmp_path, calls)
    assert audit.duplicates == 1
    assert audit.never_run == 0
