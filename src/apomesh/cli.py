"""The ``apomesh`` command line: the one composition root.

Exit codes: 0 ok, 1 failure, 2 usage. Commands that talk to a running daemon take ``--url`` (env
``APOMESH_URL``, default ``http://127.0.0.1:8750``) and ``--token`` (env ``APOMESH_TOKEN``) and go
through the SDK; without a token, when the URL is a loopback address, they use the local daemon's
(``[http] token``, else the ``<data_dir>/http.token`` it wrote at its first start; ``--data`` /
``--config`` find it), so they work against a local ``apomesh serve`` with no flags. Credentials for NATS come from the config file or ``APOMESH_NATS_*`` variables,
never from the command line.

Output is for people and scripts alike: data (goals, reasons, questions, tool arguments) is printed
verbatim, never read as rich markup; tables never wrap or cut an id, whatever the width or in a
pipe; every listing and ``show`` take ``--output json``; times are local dates, not unix seconds.
A command that needs a confirmation asks on a terminal and, when stdin is not one, refuses unless
``--yes`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import io
import json
import logging
import os
import shlex
import signal
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apomesh._version import __version__
from apomesh.core.errors import ApomeshError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


@functools.cache
def out(stderr: bool = False) -> Console:
    """The console commands print on (stdout, or stderr with ``stderr``), made at its first use:
    ``serve`` and ``worker`` print their few lines without it, and start without importing rich.
    No markup, no highlighting, no wrapping of lines: what the daemon sends is data, printed as
    it is."""
    from rich.console import Console

    return Console(stderr=stderr, markup=False, highlight=False, soft_wrap=True)


def err() -> Console:
    return out(stderr=True)


DEFAULT_URL = "http://127.0.0.1:8750"


def _config(args: argparse.Namespace, overrides: dict[str, dict[str, Any]]) -> Any:
    from apomesh.runtime.config import load_config

    path = Path(args.config) if getattr(args, "config", None) else None
    return load_config(path, overrides=overrides)


def _observe(config: Any, service: str) -> None:
    """Log lines and traces of a long-running process, as its config says."""
    from apomesh.runtime import tracing
    from apomesh.runtime.logging_config import configure_logging

    configure_logging(config.daemon.log_level, config.log.format)
    tracing.configure(config.tracing, service=service)


def _announce(config: Any, text: str) -> None:
    """A line of ``serve`` or ``worker`` itself: printed, or with JSON logs one more log line (a
    log shipper then reads JSON only)."""
    if config.log.format == "json":
        logging.getLogger("apomesh.cli").info("%s", text)
    else:
        print(text, flush=True)


# --- serve / worker / demo ---------------------------------------------------------------------------


@contextlib.contextmanager
def _runtime_import() -> Iterator[None]:
    """A long-running command imports the runtime with the garbage collector off, then keeps
    what it imported out of the collector's walks (``gc.freeze``): hundreds of thousands of
    modules, classes and functions that live as long as the process. Collecting during the
    imports walked them dozens of times (about 20 ms of a daemon's start), and merely pausing
    left them all in the young generation, so the first collection after walked them at once
    (about 40 ms) and the next older ones again."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if collecting:
            gc.enable()


def _http_layer() -> Any:
    """The HTTP layer's starter (``Node`` imports it by this while its embedded server starts)."""
    with _runtime_import():
        from apomesh.api.server import serve_api
    return serve_api


def cmd_serve(args: argparse.Namespace) -> int:
    # The runtime, imported with the collector paused (under --supervise, with the HTTP layer,
    # once for every daemon the supervisor forks; ``_serve`` names what it uses).
    with _runtime_import():
        import apomesh.runtime.node

        if args.supervise:
            import apomesh.api.server  # noqa: F401

    overrides: dict[str, dict[str, Any]] = {
        "nats": {"urls": args.nats.split(",") if args.nats else None, "replicas": args.replicas},
        "daemon": {"data_dir": args.data, "workspace": args.workspace, "workers": args.workers},
        "http": {"listen": args.http},
        "plugins": {"tools": args.tools},
        "log": {"format": args.log_format},
    }
    config = _config(args, overrides)
    if args.supervise:
        return _supervise(lambda: _serve(config))
    return _serve(config)


def _serve(config: Any) -> int:
    """Run the daemon until SIGTERM or SIGINT (``serve``'s own work, or its forked child's)."""
    from apomesh.adapters.nats_connect import redact_urls
    from apomesh.runtime.node import Node

    _observe(config, "apomesh-daemon")

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with Node(config, http=_http_layer) as node:
            assert node.daemon is not None
            _announce(
                config,
                f"apomesh {__version__} serving on {node.http_url} (NATS {redact_urls(node.urls)},"
                f" data {config.daemon.data_path()}, {config.daemon.workers} local workers)",
            )
            _announce(config, f"boot scan: {node.daemon.boot_report}")
            await stop.wait()
            _announce(config, "shutting down")

    from apomesh.runtime import tracing

    try:
        asyncio.run(serve())
    finally:
        tracing.shutdown()
    return 0


SUPERVISED_QUICK_DEATH = 5.0
"""Seconds: a supervised daemon that dies this soon after its start, twice in a row, is not
started again (a start that cannot work, not a crash to ride out)."""


def _supervise(run: Callable[[], int]) -> int:
    """``serve --supervise``: this process keeps the runtime it imported and runs the daemon in a
    forked child. A child that dies of a signal this process did not pass on to it (a SIGKILL, an
    out-of-memory kill, a crash) is forked again at once: a warm start, with no interpreter to
    start and nothing to import (a cold start spends about a third of a second there). SIGTERM and
    SIGINT go to the child, which shuts down as ``serve`` always does, and its exit code is this
    process's. The child dies with this process (``die_with_parent``)."""
    from apomesh.adapters.natsserver import die_with_parent

    child = 0
    stopping = False

    def pass_on(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    arm = die_with_parent()  # made here: it checks the child's parent is this process
    quick_deaths = 0
    while True:
        started = time.monotonic()
        child = os.fork()
        if child == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if arm is not None:
                arm()
            code = 1
            try:
                code = _reported(run)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(child, 0)
        if stopping or not os.WIFSIGNALED(status):
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1
        quick = time.monotonic() - started < SUPERVISED_QUICK_DEATH
        quick_deaths = quick_deaths + 1 if quick else 0
        name = signal.Signals(os.WTERMSIG(status)).name
        if quick_deaths >= 2:
            err().print(
                f"the daemon (pid {child}) died of {name} twice within"
                f" {SUPERVISED_QUICK_DEATH:g} s of its start: not started again"
            )
            return 1
        err().print(f"the daemon (pid {child}) died of {name}; forking a new one")


def cmd_worker(args: argparse.Namespace) -> int:
    import socket

    with _runtime_import():
        from apomesh.adapters.nats_connect import connect, redact_urls
        from apomesh.runtime.nats_permissions import credential_identity
        from apomesh.runtime.node import make_plugin_host, nats_options, tune_collector
        from apomesh.runtime.protocol import check_worker_id, new_worker_id, worker_inbox_prefix
        from apomesh.runtime.worker import Worker

    config = _config(
        args,
        {
            "nats": {"urls": args.nats.split(",") if args.nats else None},
            "workers": {"max_agents": args.max_agents},
            "plugins": {"tools": args.tools},
            "log": {"format": args.log_format},
        },
    )
    _observe(config, "apomesh-worker")
    if not config.nats.urls:
        err().print("a worker needs NATS: --nats URL, [nats] urls or APOMESH_NATS_URLS")
        return 2
    workspace = Path(args.workspace or "workspace").absolute()
    # The id comes from the credentials unless given: NATS permissions name it, so a worker can
    # only beat, report and take dispatches as the identity it authenticated as.
    worker_id = args.id or credential_identity(config.nats)
    name = args.name or worker_id or socket.gethostname()
    if worker_id is not None:
        try:
            check_worker_id(worker_id)
        except ValueError as exc:
            _error(f"{exc}; give a usable one with --id")
            return 2
    else:
        worker_id = new_worker_id(name)
    # The daemon answers a worker only on its own inbox.
    connect_options = {**nats_options(config), "inbox_prefix": worker_inbox_prefix(worker_id)}

    async def work() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tune_collector()
        plugins = make_plugin_host(config)
        nc = await connect(
            config.nats.urls,
            name=f"apomesh-worker-{worker_id}",
            **connect_options,
        )
        worker = Worker(
            nc,
            tools=plugins.tools(),
            providers=plugins.model_providers(),
            supervisors=list(plugins.supervisor_policies().values()),
            plugin_versions=plugins.installed_versions(),
            workspace=workspace,
            name=name,
            worker_id=worker_id,
            heartbeat_interval=config.liveness.heartbeat_interval,
            max_agents=config.workers.max_agents,
            daemon_gone_after=config.workers.daemon_gone_after,
            mcp_servers=config.mcp.servers,
        )
        await worker.start()
        _announce(
            config,
            f"worker {worker.worker_id} on {redact_urls(config.nats.urls)}, workspace {workspace},"
            f" {worker.max_agents} agents at most",
        )
        await stop.wait()
        await worker.aclose()
        await nc.close()

    from apomesh.runtime import tracing

    try:
        asyncio.run(work())
    finally:
        tracing.shutdown()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from apomesh.demo import run_demo

    logging.basicConfig(level=logging.ERROR)
    # The demo styles its own fixed text with markup.
    return asyncio.run(run_demo(Console()))


# --- commands that talk to a daemon -----------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    from apomesh.sdk.client import SyncClient, local_token

    token = args.token or local_token(args.url, _config(args, {"daemon": {"data_dir": args.data}}))
    return SyncClient(args.url, token=token)


def _load_definition(path: str) -> dict[str, Any]:
    from apomesh.runtime.composition import load_definition_file

    return load_definition_file(Path(path))


def cmd_run(args: argparse.Namespace) -> int:
    from apomesh.builtin.agents import DEFAULT_AGENT

    client = _client(args)
    key = args.idempotency_key
    if args.agent:
        session_id = client.start_session(args.goal, agent=args.agent, idempotency_key=key)
    else:
        definition = _load_definition(args.definition) if args.definition else DEFAULT_AGENT
        session_id = client.start_session(args.goal, definition=definition, idempotency_key=key)
    out().print(f"session {session_id}")
    if not args.follow:
        return 0
    return _follow(client, session_id, _answer_options(args))


def _answer_options(args: argparse.Namespace) -> str:
    """The ``--url`` this command was given, when it is not the default, for the command shown to
    answer a pause: it works as it is pasted."""
    if args.url != os.environ.get("APOMESH_URL", DEFAULT_URL):
        return f" --url {shlex.quote(args.url)}"
    return ""


def _agent_line(agent: Any) -> str:
    """One agent of the spawn tree: ``root/0 running on w1 (resumed x1)``."""
    if agent.waiting_for:
        line = f"{agent.ref} waiting for {agent.waiting_for}"
    else:
        line = f"{agent.ref} {agent.phase}"
        if agent.worker:
            line += f" on {agent.worker}"
    if agent.resuming:
        line += " (resuming)"
    elif agent.resumes:
        line += f" (resumed x{agent.resumes})"
    return line


def _pause_lines(view: Any, options: str = "") -> list[str]:
    """What each open pause asks and the exact command that answers it (``options``: what the
    command needs after its arguments, such as ``--url``)."""
    lines: list[str] = []
    for pause in view.hitl_pending:
        lines.append(f"{pause.agent} asks ({pause.pause_id}): {pause.question}")
        lines.append(
            f"  answer with: apomesh hitl answer {view.session_id}"
            f" {shlex.quote(pause.pause_id)} 'ANSWER'{options}"
        )
    return lines


def _follow(client: Any, session_id: str, options: str) -> int:
    """Show the session until it ends: a live tree on a terminal; in a pipe, one line per
    change, each written as it happens."""
    if out().is_terminal:
        _follow_live(client, session_id, options)
    else:
        printed: set[str] = set()

        def show() -> None:
            view = client.get_session(session_id)
            lines = [f"{view.session_id} {view.status} — {view.goal}"]
            lines += [_agent_line(agent) for agent in view.agents]
            lines += _pause_lines(view, options)
            for line in lines:
                if line not in printed:
                    printed.add(line)
                    print(line, flush=True)

        show()
        for record in client.events(session_id):
            show()
            if record.kind == "SessionEnded":
                break
    view = client.get_session(session_id)
    print(f"{view.status}: {view.output or view.reason or ''}", flush=True)
    return 0 if view.status == "completed" else 1


def _follow_live(client: Any, session_id: str, options: str) -> None:
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text
    from rich.tree import Tree

    def render() -> Group:
        view = client.get_session(session_id)
        label = Text.assemble((view.session_id, "bold"), f" {view.status} — ", view.goal)
        label.overflow = "fold"  # the whole goal, over as many lines as it takes
        tree = Tree(label)
        nodes: dict[str, Any] = {}
        for agent in view.agents:
            style = "yellow" if agent.waiting_for else "cyan"
            parent = nodes.get(agent.parent or "", tree)
            nodes[agent.ref] = parent.add(Text(_agent_line(agent), style=style, overflow="fold"))
        pauses = [
            Text(line, style="magenta", overflow="fold") for line in _pause_lines(view, options)
        ]
        return Group(tree, *pauses)

    # A live region is redrawn in place: its lines wrap at the terminal's width instead.
    out().soft_wrap = False
    try:
        with Live(render(), console=out(), refresh_per_second=4) as live:
            for record in client.events(session_id):
                live.update(render())
                if record.kind == "SessionEnded":
                    break
    finally:
        out().soft_wrap = True


def cmd_sessions(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "list":
        page = client.list_sessions(
            status=args.status, query=args.query, limit=args.limit, cursor=args.cursor
        )
        if args.output == "json":
            _print_json(list(page))
        else:
            table = _table("session", "status", "goal", "events", "side effects", "updated")
            for s in page:
                table.add_row(
                    s.session_id,
                    s.status,
                    s.goal,
                    str(s.last_index + 1),
                    str(s.side_effects),
                    _when(s.updated_at),
                )
            _print_table(table)
        if page.next_cursor:
            err().print(f"more sessions: add --cursor {page.next_cursor}")
        return 0
    if args.action == "purge" and not args.id:
        return _purge_ended(client, args)
    if not args.id:
        err().print("a session id is needed")
        return 2
    if args.action == "show":
        view = client.get_session(args.id)
        if args.output == "json":
            _print_json(view)
        else:
            _print_session(view)
        return 0
    if args.action == "tail":
        # Every event whole, one per line, written as it comes: no wrapping, no cutting.
        for record in client.events(args.id, after=args.after):
            if args.output == "json":
                print(json.dumps(_builtins(record), default=str), flush=True)
            else:
                print(
                    f"{record.index:>5} {record.kind} {json.dumps(record.event, default=str)}",
                    flush=True,
                )
        return 0
    if args.action == "agent":
        return _print_conversation(client, args)
    if args.action == "verify":
        report = client.verify_session(args.id)
        _print_json(report)
        return 0 if report.get("ok") else 1
    if args.action == "cancel":
        view = client.get_session(args.id)
        out().print(f"{view.session_id} {view.status} — {view.goal}")
        if (refused := _refused(args, "cancel this session?", "cancel a session")) is not None:
            return refused
        client.cancel(args.id)
        out().print(f"cancelled {args.id}")
        return 0
    if args.action == "purge":
        view = client.get_session(args.id)
        out().print(f"{view.session_id} {view.status} — {view.goal}")
        if (
            refused := _refused(
                args, "purge this session (its events and records, for good)?", "purge a session"
            )
        ) is not None:
            return refused
        client.purge_session(args.id)
        out().print(f"purged {args.id}")
        return 0
    return 2


def _print_conversation(client: Any, args: argparse.Namespace) -> int:
    """``sessions agent ID REF``: the agent's conversation as plain text (or JSON with
    ``--output json``), printed as it is: nothing in it is read as markup."""
    if not args.ref:
        err().print("an agent ref is needed: apomesh sessions agent ID REF (e.g. root or root/0)")
        return 2
    talk = client.agent_conversation(args.id, args.ref)
    if getattr(args, "output", None) == "json":
        print(json.dumps(_builtins(talk), indent=2), flush=True)
        return 0
    agent = talk.agent
    lines = [
        f"agent {agent.ref} ({agent.name}{', role ' + agent.role if agent.role else ''}): "
        f"{agent.phase}, epoch {agent.epoch}, resumes {agent.resumes}"
    ]
    if agent.reason:
        lines.append(f"  why: {agent.reason}")
    labels = {
        "prompt": "prompt",
        "model": "model",
        "tool_call": "call",
        "tool_result": "result",
        "question": "asks",
        "answer": "answer",
        "unknown_outcome": "UNKNOWN",
        "plan": "plan",
        "output": "output",
        "ended": "ended",
    }
    for entry in talk.entries:
        where = f"#{entry.index} " if entry.index >= 0 else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S ", time.localtime(entry.at)) if entry.at else ""
        head = f"{where}{when}{labels.get(entry.kind, entry.kind)}"
        if entry.kind in ("tool_call", "unknown_outcome"):
            head += f" {entry.tool} {json.dumps(entry.args, ensure_ascii=False)}"
            if entry.key:
                head += f" key {entry.key}"
        elif entry.kind == "tool_result":
            head += f" {entry.tool} {entry.outcome}"
        elif entry.kind == "question" and entry.pause_id:
            head += f" (pause {entry.pause_id})"
        elif entry.kind == "answer" and entry.by:
            head += f" by {entry.by}"
        elif entry.kind == "ended":
            head += f" {entry.outcome}"
        text = entry.text.replace("\n", "\n    ")
        lines.append(f"{head}: {text}" if text else head)
    print("\n".join(lines), flush=True)
    return 0


def _purge_ended(client: Any, args: argparse.Namespace) -> int:
    from apomesh.runtime.config import parse_duration

    if not args.ended_before:
        err().print("give a session id, or --ended-before DURATION (30d, 12h) to purge by age")
        return 2
    try:
        seconds = parse_duration(args.ended_before)
    except ValueError as exc:
        _error(f"--ended-before: {exc}")
        return 2
    question = f"purge every session that ended more than {args.ended_before} ago, for good?"
    if (refused := _refused(args, question, "purge sessions")) is not None:
        return refused
    purged = client.purge_ended(seconds)
    if args.output == "json":
        _print_json(purged)
    else:
        for session_id in purged:
            out().print(f"purged {session_id}")
        out().print(f"{len(purged)} sessions purged")
    return 0


def _print_session(view: Any) -> None:
    """``sessions show`` for people: the session, then its agents as a table."""
    from rich.text import Text

    fields: list[tuple[str, str | None]] = [
        ("session", view.session_id),
        ("status", view.status),
        ("goal", view.goal),
        ("agent", view.agent),
        ("coordination", view.coordination or None),
        ("started", _when(view.started_at, ago=True)),
        ("updated", _when(view.updated_at, ago=True)),
        ("events", str(view.last_index + 1)),
        ("side effects", str(view.side_effects)),
        ("daemon", view.owner),
        ("recoveries", f"{view.recoveries}, resumes {view.resumes}" if view.recoveries else None),
        ("output", view.output),
        ("reason", view.reason),
    ]
    for label, value in fields:
        if value is not None:
            out().print(f"{label:<13}{value}")
    table = _table("agent", "role", "phase", "worker", "resumes", "task")
    for a in view.agents:
        phase = f"waiting for {a.waiting_for}" if a.waiting_for else a.phase
        table.add_row(a.ref, a.role or a.name, phase, a.worker or "-", str(a.resumes), a.task or "")
    _print_table(table)
    for u in view.unknown_outcomes:
        out().print(
            Text.assemble(
                ("outcome unknown: ", "yellow"), f"{u.agent} {u.tool} {json.dumps(u.args)}"
            )
        )
    for line in _pause_lines(view):
        out().print(line)


def cmd_workers(args: argparse.Namespace) -> int:
    workers = _client(args).list_workers(limit=args.limit)
    if args.output == "json":
        _print_json(list(workers))
        return 0
    table = _table("worker", "name", "alive", "agents", "last heartbeat", "providers", "tools")
    for w in workers:
        running = f"{len(w.agents)}/{w.max_agents}" if w.max_agents else str(len(w.agents))
        table.add_row(
            w.id,
            w.name,
            "yes" if w.alive else "lost",
            running,
            _when(w.last_heartbeat, ago=True),
            ", ".join(w.providers),
            ", ".join(w.tools),
        )
    _print_table(table)
    return 0


def cmd_daemons(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "list":
        daemons = client.list_daemons()
        if args.json or args.output == "json":
            _print_json(daemons)
            return 0
        table = _table(
            "daemon", "host", "state", "sessions", "stranded", "load", "lease age", "url"
        )
        for d in daemons:
            table.add_row(
                d.id + (" (this)" if d.this else ""),
                d.host,
                d.state,
                str(d.sessions),
                str(d.stranded),
                str(d.load),
                f"{d.lease_age:.1f}s",
                d.url,
            )
        _print_table(table)
        return 0
    if not args.id:
        err().print("a daemon id is needed")
        return 2
    client.drain_daemon(args.id)
    out().print(f"daemon {args.id} drains: its sessions move to the live peers")
    if args.wait:
        deadline = time.monotonic() + args.wait
        while time.monotonic() < deadline:
            row = next((d for d in client.list_daemons() if d.id == args.id), None)
            if row is None or row.state == "drained":
                out().print(f"daemon {args.id} drained")
                return 0
            time.sleep(0.2)
        err().print(f"daemon {args.id} did not finish draining within {args.wait:.0f} s")
        return 1
    return 0


FILTER_KEYS = ("category", "reason", "goal")


def _resume_all(client: Any, args: argparse.Namespace) -> int:
    """``recover resume --all [--filter KEY=VALUE ...]``: show every matching session and what
    resuming it faces, ask once, then resume exactly the sessions shown."""
    from rich.text import Text

    from apomesh.core.views import RecoverableFilter

    if args.id or args.migrate_pin:
        err().print("--all resumes by filter: no session id and no --migrate-pin with it")
        return 2
    wanted: dict[str, str] = {}
    for item in args.filter or []:
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in FILTER_KEYS or not value.strip():
            err().print(
                f"--filter wants one of {', '.join(FILTER_KEYS)} as KEY=VALUE, not {item!r}"
            )
            return 2
        wanted[key.strip()] = value.strip()
    which = RecoverableFilter(
        category=wanted.get("category"), reason=wanted.get("reason"), goal=wanted.get("goal")
    )
    chosen = [r for r in client.list_recoverable() if which.matches(r)]
    if not chosen:
        out().print("no recoverable session matches")
        return 0
    for r in chosen:
        out().print(f"{r.session_id}  {r.goal!r}  {r.category}: {r.reason}")
        for u in r.unknown_outcomes:
            out().print(
                Text.assemble(
                    ("  outcome unknown (not run again): ", "yellow"),
                    f"{u.agent} {u.tool} {json.dumps(u.args)}",
                )
            )
        for d in r.pin_diff:
            out().print(
                Text.assemble(
                    ("  pin differs: ", "yellow"),
                    f"{d.name}: {d.old} -> {d.new or 'not installed'}",
                )
            )
    if (
        refused := _refused(
            args, f"resume these {len(chosen)} sessions?", f"resume {len(chosen)} sessions"
        )
    ) is not None:
        return refused
    outcomes = client.resume_matching(
        category=which.category,
        reason=which.reason,
        goal=which.goal,
        session_ids=[r.session_id for r in chosen],
    )
    for o in outcomes:
        if o.outcome == "resumed":
            out().print(f"resumed {o.session_id}")
        else:
            err().print(f"refused {o.session_id}: {o.error}: {o.message}")
    return 0 if all(o.outcome == "resumed" for o in outcomes) else 1


def cmd_recover(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "list":
        rows = client.list_recoverable(limit=args.limit)
        if args.output == "json":
            _print_json(list(rows))
            return 0
        table = _table("session", "goal", "category", "reason", "side effects", "last event")
        for r in rows:
            table.add_row(
                r.session_id,
                r.goal,
                r.category,
                r.reason,
                str(r.side_effects),
                _when(r.last_event_at),
            )
        _print_table(table)
        return 0
    if args.all:
        return _resume_all(client, args)
    if args.filter:
        err().print("--filter goes with --all")
        return 2
    if not args.id:
        err().print("a session id is needed (or --all)")
        return 2
    migrate: dict[str, str] = {}
    for pin in args.migrate_pin or []:
        name, sep, version = pin.partition("=")
        if not sep or not name.strip() or not version.strip():
            err().print(f"--migrate-pin wants NAME=VERSION, not {pin!r}")
            return 2
        migrate[name.strip()] = version.strip()
    preview = client.recovery_preview(args.id, migrate_pins=migrate or None)
    out().print(f"{preview.session_id}  {preview.goal!r}  {preview.category}: {preview.reason}")
    if preview.unknown_outcomes:
        out().print(
            "side effects whose outcome is unknown (they will not be run again):", style="yellow"
        )
        for u in preview.unknown_outcomes:
            out().print(f"  {u.agent} {u.tool} {json.dumps(u.args)}")
    if preview.pin_diff:
        out().print("pins that differ from what is installed:", style="yellow")
        for d in preview.pin_diff:
            out().print(f"  {d.name}: {d.old} -> {d.new or 'not installed'}")
    agent = preview.agent_diff
    if agent is not None:
        out().print(f"moving the agent {agent.old} -> {agent.new}:", style="yellow")
        out().print(f"  definition digest {agent.old_digest[:12]} -> {agent.new_digest[:12]}")
        for skill in agent.skills:
            old_digest, new_digest = (skill.old or "none")[:12], (skill.new or "none")[:12]
            out().print(f"  skill {skill.name}: {old_digest} -> {new_digest}")
        if agent.coordination[0] != agent.coordination[1]:
            out().print(f"  coordination {agent.coordination[0]} -> {agent.coordination[1]}")
        if agent.coordination_params[0] != agent.coordination_params[1]:
            params = [json.dumps(p, sort_keys=True) for p in agent.coordination_params]
            out().print(f"  coordination params {params[0]} -> {params[1]}")
        for change in agent.plugins:
            out().print(f"  plugin {change.name}: {change.old or 'none'} -> {change.new or 'none'}")
        if agent.roles:
            out().print(f"  configs that change: {', '.join(agent.roles)}")
        if agent.problem:
            out().print(f"refused: {agent.problem}", style="red")
            return 1
    for name, version in migrate.items():
        if name == "agent" and agent is not None:
            old = agent.old.partition("@")[2]
        else:
            old = next((d.old for d in preview.pin_diff if d.name == name), "?")
        out().print(f"migrating pin {name}: {old} -> {version}")
    if (refused := _refused(args, "resume?", "resume a session")) is not None:
        return refused
    client.resume(args.id, migrate_pins=migrate or None, confirm=True)
    out().print(f"resumed {args.id}")
    return 0


def cmd_hitl(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "list":
        pauses = client.list_hitl(limit=args.limit)
        if args.output == "json":
            _print_json(list(pauses))
            return 0
        table = _table("session", "pause", "agent", "question", ids=("session", "pause"))
        for p in pauses:
            table.add_row(p.session_id, p.pause_id, p.agent, p.question)
        _print_table(table)
        if pauses:
            out().print("answer one with: apomesh hitl answer SESSION PAUSE 'ANSWER'")
        return 0
    if not (args.session and args.pause and args.text is not None):
        err().print("usage: apomesh hitl answer SESSION PAUSE TEXT (see `apomesh hitl list`)")
        return 2
    client.answer_hitl(args.session, args.pause, args.text)
    out().print("answered")
    return 0


def cmd_skills(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action == "put":
        if not args.name or not args.file:
            err().print("usage: apomesh skills put NAME FILE")
            return 2
        # Decoded from bytes: a text-mode read would turn CRLF into LF and store other bytes.
        view = client.put_skill(args.name, Path(args.file).read_bytes().decode("utf-8"))
        out().print(f"skill {view.name} revision {view.revision} digest {view.digest[:12]}")
    elif args.action == "list":
        skills = client.list_skills()
        if args.output == "json":
            _print_json(skills)
            return 0
        table = _table("skill", "revision", "digest")
        for s in skills:
            table.add_row(s.name, str(s.revision), s.digest[:12])
        _print_table(table)
    elif not args.name:
        err().print(f"usage: apomesh skills {args.action} NAME")
        return 2
    elif args.action == "get":
        # The exact body, byte for byte: no markup, no wrapping, no added newline.
        sys.stdout.write(client.get_skill(args.name).body)
        sys.stdout.flush()
    elif args.action == "history":
        history = client.skill_history(args.name)
        if args.output == "json":
            _print_json(history)
            return 0
        table = _table("skill", "revision", "digest", "first line")
        for s in history:
            table.add_row(s.name, str(s.revision), s.digest[:12], s.body.partition("\n")[0][:60])
        _print_table(table)
    elif args.action == "rm":
        client.delete_skill(args.name)
        out().print(f"deleted {args.name}")
    return 0


def cmd_agents(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.action in ("publish", "show") and not args.target:
        err().print(
            f"usage: apomesh agents {args.action} {'FILE' if args.action == 'publish' else 'NAME[@VERSION]'}"
        )
        return 2
    if args.action == "publish":
        created, record = client.publish_agent(_load_definition(args.target))
        out().print(
            f"{'published' if created else 'already published (same content)'} {record.name}@{record.version}"
        )
    elif args.action == "list":
        agents = client.list_agents()
        if args.output == "json":
            _print_json(agents)
            return 0
        table = _table("agent", "version", "digest", "skills")
        for a in agents:
            table.add_row(a.name, a.version, a.digest[:12], ", ".join(a.skills))
        _print_table(table)
    elif args.action == "show":
        name, _, version = args.target.partition("@")
        record = client.get_agent(name, version or None)
        if args.output == "json":
            _print_json(record)
            return 0
        out().print(f"agent   {record.name}@{record.version}")
        out().print(f"digest  {record.digest}")
        out().print(f"skills  {', '.join(record.skills) or '-'}")
        pins = ", ".join(f"{p.name} {p.version}" for p in record.plugins)
        out().print(f"plugins {pins or '-'}")
        print(json.dumps(record.definition, indent=2, ensure_ascii=False))
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from apomesh.plugins.manager import PluginHost

    host = PluginHost()
    plugins = host.plugins()
    if args.output == "json":
        _print_json(plugins)
        return 0
    table = _table("plugin", "version", "hooks", "provides")
    for info in plugins:
        table.add_row(info.name, info.version, "\n".join(info.hooks), "\n".join(info.registered))
    _print_table(table)
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from apomesh.runtime.config import sample_config

    sys.stdout.write(sample_config())
    return 0


def cmd_tokens(args: argparse.Namespace) -> int:
    from apomesh.api.tokens import TokenStore
    from apomesh.runtime.config import parse_duration

    data = Path(args.data).absolute() if args.data else _config(args, {}).daemon.data_path()
    store = TokenStore.in_dir(data)
    if args.action == "create":
        try:
            lifetime = parse_duration(args.expires_in) if args.expires_in else None
        except ValueError as exc:
            _error(f"--expires-in: {exc}")
            return 2
        token_id, secret = store.create(args.role, args.name or args.role, expires_in=lifetime)
        until = f", expires {_when(time.time() + lifetime)}" if lifetime else ""
        out().print(f"token {token_id} ({args.role}{until}); shown once:")
        print(secret)
    elif args.action == "list":
        tokens = store.list()
        if args.output == "json":
            _print_json(tokens)
            return 0
        table = _table("id", "name", "role", "created", "expires")
        now = time.time()
        for t in tokens:
            expires = _when(t.expires_at) if t.expires_at else "never"
            if t.expired(now):
                expires += " (expired)"
            table.add_row(t.token_id, t.name, t.role, _when(t.created_at), expires)
        _print_table(table)
    elif args.action == "revoke":
        if not args.id:
            err().print("usage: apomesh tokens revoke ID (see `apomesh tokens list`)")
            return 2
        if not store.revoke(args.id):
            _error(f"no token {args.id} in {store.path}")
            return 1
        out().print(f"revoked {args.id}")
    return 0


# --- output ------------------------------------------------------------------------------------------

ID_COLUMNS = ("session", "worker", "daemon", "id", "pause")
"""Table columns that hold ids: never wrapped or cut, so a row's id can be pasted."""


def _table(*columns: str, ids: Sequence[str] = ID_COLUMNS) -> Table:
    """A table whose cells wrap (folding a word longer than the column) but never lose a
    character, and whose id columns never wrap."""
    from rich.table import Table

    table = Table()
    for name in columns:
        table.add_column(name, no_wrap=name in ids, overflow="fold")
    return table


def _print_table(table: Table) -> None:
    """Print a table so that no id is ever cut: on a terminal at least as wide as its id columns
    need (past the terminal's width if it must; the other columns wrap), in a pipe at its natural
    width, one row a line whatever ``COLUMNS`` says (rich would take 80)."""
    from rich.measure import Measurement

    console = out()
    size = Measurement.get(console, console.options.update_width(1 << 16), table)
    width = console.width
    console.width = max(width, size.minimum) if console.is_terminal else size.maximum
    try:
        console.print(table)
    finally:
        console.width = width


def _print_json(data: Any) -> None:
    """JSON for scripts: the API's own fields and values (times in unix seconds)."""
    print(json.dumps(_builtins(data), indent=2, ensure_ascii=False, default=str))


def _refused(args: argparse.Namespace, question: str, what: str) -> int | None:
    """None to go on: with ``--yes``, or when the answer to ``question`` on a terminal is yes;
    else the exit code: 1 when the answer is no, 2 when there is no terminal to ask (a script, a
    pipe), saying how to confirm instead."""
    if args.yes:
        return None
    if not sys.stdin.isatty():
        err().print(f"refusing to {what} without a terminal to ask: pass --yes to confirm")
        return 2
    answer = out().input(f"{question} [y/N] ").strip().lower()
    return None if answer in ("y", "yes") else 1


def _error(message: str, code: str | None = None) -> None:
    from rich.text import Text

    label = f"error ({code})" if code else "error"
    err().print(Text.assemble((label, "red"), f": {message}"))


def _when(ts: float, *, ago: bool = False) -> str:
    """A unix time as local date and time to the second (``-`` for none); with ``ago``, also
    how long ago (``2026-03-01 14:02:11 (5m ago)``)."""
    import datetime

    if not ts:
        return "-"
    text = datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")
    if not ago:
        return text
    seconds = max(0, int(time.time() - ts))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{text} ({seconds // size}{unit} ago)"
    return f"{text} ({seconds}s ago)"


def _builtins(obj: Any) -> Any:
    import msgspec

    return msgspec.to_builtins(obj)


# --- parser ------------------------------------------------------------------------------------------


def _remote(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=os.environ.get("APOMESH_URL", DEFAULT_URL),
        help="the daemon's HTTP API (env APOMESH_URL)",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("APOMESH_TOKEN"),
        help="an API token (env APOMESH_TOKEN; default: [http] token, else the token the daemon"
        " wrote to <data_dir>/http.token)",
    )
    p.add_argument(
        "--data", help="the local daemon's data directory, where its first token is kept"
    )
    p.add_argument("--config", help="the local daemon's config file ([http] token, data_dir)")


def _log_format_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        help='log lines as text or one JSON object a line (default [log] format, "text")',
    )


def _output(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output",
        "-o",
        choices=["table", "json"],
        default="table",
        help="table for people (default), json for scripts",
    )


def _limit(p: argparse.ArgumentParser, default: int | None) -> None:
    p.add_argument(
        "--limit",
        type=int,
        default=default,
        help=f"list at most this many (1..1000; default {default or 'all'})",
    )


def _yes(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--yes",
        action="store_true",
        help=f"{what} without asking (needed when stdin is not a terminal: it refuses otherwise)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="apomesh", description="Durable agent sessions on NATS JetStream."
    )
    parser.add_argument("--version", action="version", version=f"apomesh {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the daemon (embedded NATS unless --nats is given)")
    p.add_argument("--nats", help="NATS URL(s), comma-separated; none starts an embedded server")
    p.add_argument("--replicas", type=int, help="stream and bucket replicas (3 in a cluster)")
    p.add_argument("--data", help="data directory (LMDB, embedded NATS store)")
    p.add_argument("--workspace", help="workspace directory of the local workers")
    p.add_argument("--http", help="HOST:PORT of the HTTP API (default 127.0.0.1:8750)")
    p.add_argument("--workers", type=int, help="local in-process workers (default 2; 0 allowed)")
    p.add_argument(
        "--tools",
        action="append",
        metavar="MODULE:OBJECT",
        help="serve the Python tools MODULE:OBJECT names (@apomesh.tool tools, a list of them or"
        " a ToolSet; repeatable; [plugins] tools)",
    )
    p.add_argument("--config", help="config file (see `apomesh config sample`)")
    p.add_argument(
        "--supervise",
        action="store_true",
        help="run the daemon in a child process, forked again at once (warm) if it is killed",
    )
    _log_format_option(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("worker", help="run a worker that connects to NATS")
    p.add_argument("--nats", help="NATS URL(s), comma-separated (or [nats] urls in --config)")
    p.add_argument("--name", help="a name shown in `GET /v1/workers`")
    p.add_argument(
        "--id",
        help="the worker id (default: the NATS user, NKey or creds name it authenticates as,"
        " else NAME-<random>); NATS permissions bind it to the credentials",
    )
    p.add_argument("--workspace", help="the directory file tools are confined to")
    p.add_argument(
        "--max-agents",
        type=int,
        help="how many agents it runs at once, for every daemon together (default 32;"
        " [workers] max_agents)",
    )
    p.add_argument(
        "--tools",
        action="append",
        metavar="MODULE:OBJECT",
        help="serve the Python tools MODULE:OBJECT names (@apomesh.tool tools, a list of them or"
        " a ToolSet; repeatable; [plugins] tools)",
    )
    p.add_argument(
        "--config",
        help="config file (credentials, TLS); secrets also come from APOMESH_NATS_* variables,"
        " never from the command line",
    )
    _log_format_option(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser(
        "demo", help="run a self-contained demo: a worker is killed mid-run and resumed"
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("run", help="start a session")
    p.add_argument("goal")
    p.add_argument("--agent", help="a published agent NAME[@VERSION]")
    p.add_argument("--definition", help="an agent definition TOML file")
    p.add_argument(
        "--follow",
        action="store_true",
        help="show the spawn tree until the session ends (in a pipe: one line per change), with"
        " each pause's question and the command that answers it",
    )
    p.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="run it again with the same KEY and the same goal: the first session is answered,"
        " no second one starts",
    )
    _remote(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "sessions",
        help="list, show, tail, verify, cancel or purge sessions, or show an agent's conversation",
    )
    p.add_argument("action", choices=["list", "show", "tail", "verify", "cancel", "purge", "agent"])
    p.add_argument("id", nargs="?")
    p.add_argument("ref", nargs="?", help="with `agent`: the agent's ref (root, root/0, ...)")
    p.add_argument("--status", help="list: keep one status (running, paused, completed, ...)")
    p.add_argument("--query", help="list: keep sessions whose goal or id contains this")
    _limit(p, 100)
    p.add_argument("--cursor", help="list: the page after this cursor (printed when more follow)")
    p.add_argument("--after", type=int, default=-1, help="tail: the events after this index")
    p.add_argument(
        "--ended-before",
        metavar="DURATION",
        help="purge without an id: every session that ended more than DURATION ago (30d, 12h)",
    )
    _output(p)
    _yes(p, "cancel or purge")
    _remote(p)
    p.set_defaults(func=cmd_sessions)

    p = sub.add_parser("workers", help="list the workers: alive or lost, what they run")
    p.add_argument("action", choices=["list"])
    _limit(p, None)
    _output(p)
    _remote(p)
    p.set_defaults(func=cmd_workers)

    p = sub.add_parser("daemons", help="list the live daemons, or drain one for maintenance")
    p.add_argument("action", choices=["list", "drain"])
    p.add_argument("id", nargs="?", help="the daemon to drain (an id from `daemons list`)")
    p.add_argument("--json", action="store_true", help="the same as --output json")
    _output(p)
    p.add_argument(
        "--wait", type=float, default=0.0, help="seconds to wait until the daemon has drained"
    )
    _remote(p)
    p.set_defaults(func=cmd_daemons)

    p = sub.add_parser(
        "recover",
        help="list recoverable sessions or resume one (or all that match a filter)",
        description="List sessions waiting for an operator, or resume one after seeing what "
        "resuming would face. --migrate-pin moves a stranded session first: PLUGIN=VERSION to "
        "the installed version of a plugin it pins, agent=VERSION to another published version "
        "of the agent it was started from (the coordination kind must stay the same). Both are "
        "logged as OperatorAction(migrate_pin).",
    )
    p.add_argument("action", choices=["list", "resume"])
    p.add_argument("id", nargs="?")
    p.add_argument(
        "--migrate-pin",
        action="append",
        metavar="NAME=VERSION",
        help="move a pin before resuming (repeatable): a plugin's distribution name, or `agent` "
        "for another published version of the session's agent; the difference is shown first",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="resume every recoverable session (that --filter keeps), after showing each one",
    )
    p.add_argument(
        "--filter",
        action="append",
        metavar="KEY=VALUE",
        help="with --all, keep only sessions whose category is VALUE (category=held), or whose "
        "reason or goal contains VALUE (reason=..., goal=...); repeatable, all must match",
    )
    _limit(p, None)
    _output(p)
    _yes(p, "resume")
    _remote(p)
    p.set_defaults(func=cmd_recover)

    p = sub.add_parser("hitl", help="list open human-in-the-loop pauses, or answer one")
    p.add_argument("action", choices=["list", "answer"])
    p.add_argument("session", nargs="?")
    p.add_argument("pause", nargs="?")
    p.add_argument("text", nargs="?")
    _limit(p, None)
    _output(p)
    _remote(p)
    p.set_defaults(func=cmd_hitl)

    p = sub.add_parser("skills", help="the skill catalog")
    p.add_argument("action", choices=["put", "get", "list", "history", "rm"])
    p.add_argument("name", nargs="?")
    p.add_argument("file", nargs="?")
    _output(p)
    _remote(p)
    p.set_defaults(func=cmd_skills)

    p = sub.add_parser("agents", help="published agents")
    p.add_argument("action", choices=["publish", "list", "show"])
    p.add_argument("target", nargs="?", help="FILE for publish, NAME[@VERSION] for show")
    _output(p)
    _remote(p)
    p.set_defaults(func=cmd_agents)

    p = sub.add_parser("plugins", help="installed plugins")
    p.add_argument("action", choices=["list"])
    _output(p)
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("config", help="configuration")
    p.add_argument("action", choices=["sample"])
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("tokens", help="API tokens (stored hashed in the data dir)")
    p.add_argument("action", choices=["create", "list", "revoke"])
    p.add_argument("id", nargs="?")
    p.add_argument("--role", choices=["read", "operator"], default="read")
    p.add_argument("--name")
    p.add_argument(
        "--expires-in",
        metavar="DURATION",
        help="lifetime of a new token: 90s, 15m, 12h, 30d (default: until revoked)",
    )
    p.add_argument(
        "--data", help="the daemon's data directory (default: [daemon] data_dir of --config)"
    )
    p.add_argument("--config", help="the daemon's config file, to find its data directory")
    _output(p)
    p.set_defaults(func=cmd_tokens)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "limit", None) is not None and not 1 <= args.limit <= 1000:
        parser.error("--limit must be between 1 and 1000")
    if not sys.stdout.isatty() and isinstance(sys.stdout, io.TextIOWrapper):
        # In a pipe every line goes out as it is written, not when a block fills.
        sys.stdout.reconfigure(line_buffering=True)
    return _reported(lambda: int(args.func(args)))


def _reported(command: Callable[[], int]) -> int:
    """Run ``command``; an error it raises is printed as ``error (code): message`` and answered
    exit status 1 (``main``'s, and a supervised daemon's in its forked child)."""
    try:
        return command()
    except ApomeshError as exc:
        _error(exc.message, exc.code)
        return 1
    except (OSError, tomllib.TOMLDecodeError) as exc:
        _error(str(exc))
        return 1
    except KeyboardInterrupt:
        return 1
    except Exception as exc:  # the SDK's typed errors and anything unexpected
        name = type(exc).__name__
        if name.endswith("Error") or name == "ServerUnavailable":
            _error(str(exc), name)
            if name == "UnauthorizedError":
                err().print(
                    "give a token with --token or APOMESH_TOKEN (`apomesh tokens create`), or"
                    " --data DIR of the daemon, whose first token is in DIR/http.token"
                )
            return 1
        raise
