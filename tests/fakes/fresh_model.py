"""A nondeterministic OpenAI-compatible chat-completions server that never repeats itself.

``FreshModelServer`` listens on a free 127.0.0.1 port in a background thread (or in a process of
its own: ``python -m tests.fakes.fresh_model --port N`` prints its URL, so daemons, workers and a
chaos run in other processes can share one). Every answer carries fresh, uuid-bearing arguments —
as a real LLM rephrases, a second call for the same step never gets the same answer — while
keeping a structure that lets a session complete. The structure is decided from the request
alone (stateless), read from the model name the definition gives (``fresh_model_spec``):

    fresh:appends=3,writes=1,jobs=1,reads=1,asks=1,plan=2,fault=429@once+503@4

- a planning turn (the provider's plan instructions in the system message) answers a JSON array
  of ``plan`` fresh sub-tasks;
- a synthesizing or critique turn (the coordinator's "Sub-task results" / "Iteration N results"
  prompt) answers a fresh final text;
- otherwise the step is the number of assistant tool-call turns already in the conversation:
  ``asks`` calls of ``ask_human`` with a fresh question, ``jobs`` calls of ``jobs.sleep {"seconds": 1}`` (identical across agents, on purpose), then
  ``appends`` calls of ``fs.append`` with a fresh line, then ``writes`` calls of ``fs.write`` with
  fresh content, each with an ``fs.list`` beside it when ``reads=1`` — only tools the request
  offers — and then a fresh final answer. Files are ``fresh/<slot>.txt``, ``slot`` a digest of the
  agent's system message and task, so each agent writes its own.

Every request and answer is recorded (``calls``; ``GET /_log`` serves them as JSON to other
processes, ``/_log?requests=0`` without the request bodies) with its ``slot`` and ``step``, so a checker can tell whether a session's output is an
answer the server gave and whether each effect in the workspace came from exactly one answer.

Faults (``429`` with ``Retry-After``, ``503``, ``hang`` — answer nothing for ``hang_seconds``,
past the client's timeout — and ``401``) are configured for the whole server (``faults=``,
``--fault``) and per model name (``fault=``), each ``KIND@once`` (the first call of that model
name), ``KIND@K`` (every K-th call of that model name) or ``KIND#N`` (its N-th call only): e.g.
``fresh:appends=1,fault=429@once+503#2+hang#3`` rides through all three, ``fault=401@1`` never
gets an answer. Like the real API, a conversation whose
tool-call ids do not pair up is refused with 400 (``conversation_problem``).

A definition reaches the server by naming the ``fresh`` credential (``fresh_model_spec``); the
daemon and every worker are configured with it (``fresh_model_config``: the server's ``base_url``
and the key's variable, set from ``fresh_model_env``), as a model endpoint is in production.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.fakes.local_http import LocalHTTPServer
from tests.fakes.openai_server import conversation_problem

PLAN_MARKER = "Answer with only a JSON array of strings"
CLOSING_PROMPTS = re.compile(r"^(Sub-task results:|Iteration \d+ results:)")
JOB_ARGS = {"seconds": 1}
FAULT_KINDS = ("429", "503", "hang", "401")


CREDENTIAL = "fresh"
"""The credential a definition names to reach the fresh-model server."""
KEY_ENV = "FRESH_MODEL_API_KEY"
"""The environment variable holding the key the server is called with (it checks none)."""
KEY = "sk-fresh-model"


def fresh_model_spec(name: str = "fresh", *, timeout: float = 10.0) -> dict[str, Any]:
    """The ``[model]`` table pointing an agent at a fresh-model server. The one place that says
    how a definition reaches the server: by naming the ``fresh`` credential, which the daemon and
    every worker must be configured with (``fresh_model_config``, and ``fresh_model_env``)."""
    return {"provider": "openai", "model": name, "credential": CREDENTIAL, "timeout": timeout}


def fresh_model_config(base_url: str) -> str:
    """The config lines giving a daemon or worker the credential ``fresh_model_spec`` names."""
    return (
        f"[providers.openai.credentials.{CREDENTIAL}]\n"
        f'base_url = "{base_url}"\n'
        f'api_key_env = "{KEY_ENV}"\n'
    )


def fresh_model_env() -> dict[str, str]:
    """The environment a process given ``fresh_model_config`` needs: the key's variable."""
    return {KEY_ENV: KEY}


def fresh_credentials(base_url: str) -> dict[str, Any]:
    """The same credential for an in-process ``OpenAIProvider`` (with ``fresh_model_env()`` as
    its environment)."""
    from apomesh.builtin.openai_model import Credential

    return {CREDENTIAL: Credential(base_url=base_url, api_key_env=KEY_ENV)}


# --- configuration -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """``kind`` on the first call of a model name, every ``every``-th call, or call ``at`` only."""

    kind: str
    every: int = 0
    at: int = 0

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``KIND@once`` (the first call), ``KIND@K`` (every K-th call), ``KIND#N`` (call N only)."""
        only = "#" in text
        kind, _, when = text.partition("#" if only else "@")
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r} (one of {', '.join(FAULT_KINDS)})")
        if when in ("", "once"):
            return cls(kind)
        number = int(when)
        if number < 1:
            raise ValueError(f"fault {text!r}: calls are counted from 1")
        return cls(kind, at=number) if only else cls(kind, every=number)

    def hits(self, call: int) -> bool:
        """Whether the ``call``-th call (from 1) of a model name gets this fault."""
        if self.at:
            return call == self.at
        return call == 1 if self.every == 0 else call % self.every == 0


@dataclass(frozen=True)
class Behaviour:
    """What one model name asks of the server."""

    appends: int = 2
    writes: int = 0
    jobs: int = 0
    reads: int = 0
    asks: int = 0
    plan: int = 2
    faults: tuple[Fault, ...] = ()

    @classmethod
    def parse(cls, model: str) -> Behaviour:
        """``fresh:appends=3,plan=2,fault=429@once+503@4``; a plain name gets the defaults."""
        _, _, params = model.partition(":")
        values: dict[str, Any] = {}
        for item in filter(None, params.split(",")):
            key, _, value = item.partition("=")
            if key == "fault":
                values["faults"] = tuple(Fault.parse(f) for f in value.split("+") if f)
            elif key in ("appends", "writes", "jobs", "reads", "asks", "plan"):
                values[key] = int(value)
            else:
                raise ValueError(f"model {model!r}: unknown parameter {key!r}")
        return cls(**values)


# --- the answers ---------------------------------------------------------------------------------


def _fresh() -> str:
    return uuid.uuid4().hex


def slot_of(messages: list[dict[str, Any]]) -> str:
    """Which agent is asking: a digest of its system message and its task (first user message)."""
    system = next((m.get("content") or "" for m in messages if m.get("role") == "system"), "")
    task = next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")
    return hashlib.sha256(f"{system}\0{task}".encode()).hexdigest()[:12]


def offered_tools(body: dict[str, Any]) -> set[str]:
    return {t.get("function", {}).get("name", "") for t in body.get("tools") or []}


def decide(body: dict[str, Any], behaviour: Behaviour) -> tuple[str, int, dict[str, Any]]:
    """``(slot, step, assistant message)`` for one request: fresh content, structure from the
    request itself."""
    messages: list[dict[str, Any]] = body["messages"]
    slot = slot_of(messages)
    step = sum(1 for m in messages if m.get("role") == "assistant" and m.get("tool_calls"))
    system = next((m.get("content") or "" for m in messages if m.get("role") == "system"), "")
    last_user = next(
        (m.get("content") or "" for m in reversed(messages) if m.get("role") == "user"), ""
    )
    if PLAN_MARKER in system:
        tasks = [f"sub-task {n} {_fresh()}" for n in range(behaviour.plan)]
        return slot, step, {"role": "assistant", "content": json.dumps(tasks)}
    if CLOSING_PROMPTS.match(last_user):
        return slot, step, {"role": "assistant", "content": f"fresh synthesis {_fresh()}"}
    tools = offered_tools(body)
    turns: list[str] = ["ask_human"] * behaviour.asks
    turns += ["jobs__sleep"] * behaviour.jobs
    turns += ["fs__append"] * behaviour.appends
    turns += ["fs__write"] * behaviour.writes
    turns = [t for t in turns if t in tools]
    if step >= len(turns):
        return slot, step, {"role": "assistant", "content": f"fresh final {_fresh()}"}
    name = turns[step]
    calls: list[tuple[str, dict[str, Any]]] = []
    if name == "ask_human":
        calls.append((name, {"question": f"which one? {_fresh()}"}))
    elif name == "jobs__sleep":
        calls.append((name, dict(JOB_ARGS)))
    elif name == "fs__append":
        calls.append((name, {"path": f"fresh/{slot}.txt", "line": f"{slot} {step} {_fresh()}"}))
    else:
        calls.append(
            (name, {"path": f"fresh/{slot}-{step}.txt", "content": f"{slot} {step} {_fresh()}"})
        )
    if behaviour.reads and "fs__list" in tools:
        calls.append(("fs__list", {"path": "."}))
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{_fresh()[:16]}",
                "type": "function",
                "function": {"name": n, "arguments": json.dumps(args)},
            }
            for n, args in calls
        ],
    }
    return slot, step, message


# --- the server ----------------------------------------------------------------------------------


@dataclass
class FreshModelServer(LocalHTTPServer):
    """``with FreshModelServer() as server:``; point agents at it with ``server.model(...)``, and
    give the daemon and workers ``server.config()`` (and ``fresh_model_env()``)."""

    port: int = 0
    faults: tuple[Fault, ...] = ()
    hang_seconds: float = 15.0
    retry_after: int = 1
    calls: list[dict[str, Any]] = field(default_factory=list)
    _counts: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)

    def model(self, name: str = "fresh", *, timeout: float = 10.0) -> dict[str, Any]:
        """The ``[model]`` table for an agent answered by this server as ``name`` (the daemon
        and workers need ``config()``)."""
        return fresh_model_spec(name, timeout=timeout)

    def config(self) -> str:
        """The config lines giving a daemon or worker this server's credential."""
        return fresh_model_config(self.base_url)

    def answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        """``(status, body, headers)`` for one chat-completions request, recorded."""
        problem = conversation_problem(body)
        model = str(body.get("model") or "")
        record: dict[str, Any] = {"model": model, "request": body, "at": time.time()}
        with self._lock:
            self._counts[model] += 1
            record["n"] = len(self.calls)
            record["call"] = self._counts[model]
            self.calls.append(record)
        if problem is not None:
            record.update(status=400, fault=None)
            return 400, _error(problem, "invalid_request_error"), {}
        try:
            behaviour = Behaviour.parse(model)
        except ValueError as exc:
            record.update(status=400, fault=None)
            return 400, _error(str(exc), "invalid_request_error"), {}
        fault = next((f for f in (*self.faults, *behaviour.faults) if f.hits(record["call"])), None)
        record["fault"] = fault.kind if fault else None
        if fault is not None and fault.kind != "hang":
            status = int(fault.kind)
            record["status"] = status
            if status == 429:
                return (
                    429,
                    _error("Rate limit reached", "rate_limit_exceeded"),
                    {"Retry-After": str(self.retry_after)},
                )
            if status == 401:
                return 401, _error("Incorrect API key provided", "invalid_api_key"), {}
            return 503, _error("The server is overloaded", "server_error"), {}
        if fault is not None:
            record["status"] = None
            self._stopping.wait(self.hang_seconds)
            return 504, _error("gave up", "timeout"), {}
        slot, step, message = decide(body, behaviour)
        reply = {
            "id": f"chatcmpl-{_fresh()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                }
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }
        record.update(status=200, slot=slot, step=step, answer=message)
        return 200, reply, {}

    def log(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.calls)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        fresh = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                if path != "/_log":
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                calls = fresh.log()
                if "requests=0" in query.split("&"):
                    calls = [{k: v for k, v in c.items() if k != "request"} for c in calls]
                self._send(200, {"calls": calls})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length))
                except ValueError:
                    self._send(400, _error("body is not JSON", "invalid_request_error"))
                    return
                if self.path != "/v1/chat/completions" or not isinstance(body, dict):
                    self._send(404, _error(f"no route {self.path}", "invalid_request_error"))
                    return
                status, reply, headers = fresh.answer(body)
                with contextlib.suppress(OSError):  # the client gave up (a hang past its timeout)
                    self._send(status, reply, headers)

            def _send(
                self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None
            ) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._stopping.clear()
        self.serve(Handler, self.port)

    def stop(self) -> None:
        self._stopping.set()
        super().stop()


def _error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def fetch_log(base_url: str, *, requests: bool = True) -> list[dict[str, Any]]:
    """The record of a fresh-model server in another process (its ``GET /_log``); without the
    request bodies when ``requests`` is False (``GET /_log?requests=0``)."""
    import urllib.request

    root = base_url.rstrip("/").removesuffix("/v1")
    query = "" if requests else "?requests=0"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{root}/_log{query}", timeout=30) as response:
        return list(json.loads(response.read())["calls"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--fault", action="append", default=[], help="KIND@once, KIND@K or KIND#N")
    parser.add_argument("--hang-seconds", type=float, default=15.0)
    args = parser.parse_args()
    server = FreshModelServer(
        port=args.port,
        faults=tuple(Fault.parse(f) for f in args.fault),
        hang_seconds=args.hang_seconds,
    )
    server.start()
    print(server.base_url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
