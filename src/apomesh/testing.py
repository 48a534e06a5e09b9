"""pytest fixtures for testing apomesh and apomesh plugins against real parts.

Installed as the pytest plugin ``apomesh`` (entry point ``pytest11``), so a plugin package's tests
can ask for these fixtures by name. Every server is a real ``nats-server`` process on free
127.0.0.1 ports with its store in a temporary directory, stopped at teardown.

NATS servers:
    ``nats_server``        one JetStream node shared by a test module (a ``NatsServer``)
    ``nats_url``           its client URL, started again first if an earlier test killed it
    ``fresh_nats_server``  a node of the test's own, empty, that it may kill and restart
    ``nats_cluster``       three JetStream peers shared by a module, ready for R3 streams
                           (a ``NatsCluster``: a list of ``NatsServer`` with ``.urls``)
    ``nats_hub_leaf``      a JetStream hub and a leaf node linked to it, ``(hub, leaf)``

Daemons and workers (real processes):
    ``mesh``               a fresh nats-server, an ``apomesh serve`` process and two
                           ``apomesh worker`` processes, registered (a ``Mesh``); tests may
                           SIGKILL, freeze or restart any of them
    ``bare_mesh``          the same system with only its nats-server running: the test
                           configures the daemon, then starts it and its workers
    ``shared_mesh``        the same system shared by a test module, for tests that only start
                           and read sessions of their own (they may kill or add nothing)
    ``DaemonProcess``, ``WorkerProcess``  the same parts, to build other shapes (a cluster,
                           a leaf node)

Coordination kinds, in-process:
    ``ScriptedCoordinator``  a ``CoordinatorContext`` with scripted root answers and child results
                           and the daemon's replay rules (answers by loop position, batches by
                           name, ``Nondeterminism`` on a changed batch or ask), so a kind can be
                           unit-tested without a daemon, a restart at every step included
                           (``crash_after``, ``replay``)

Plugin packages:
    ``install_plugin_package(project_dir)``  installs a plugin package (editable, no
                           dependencies) unless it is installed at its version already, so a
                           plugin's own session-scoped fixture lets ``python -m pytest`` run in a
                           fresh environment; the daemon and worker processes then load it

Importing this module stays cheap (pytest loads it in every run where apomesh is installed): the
server machinery is imported inside the fixtures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import pytest

from apomesh.core.errors import DefinitionError, Nondeterminism
from apomesh.plugins.api import (
    BATCH_DONE_EARLY,
    ROOT_PURPOSES,
    Checkpoint,
    ChildResult,
    CoordinationKind,
    DoneWhen,
    RootAnswer,
)

if TYPE_CHECKING:
    from apomesh.adapters.natsserver import NatsCluster, NatsServer

__all__ = [
    "Crash",
    "DaemonProcess",
    "Mesh",
    "ScriptedCoordinator",
    "WorkerProcess",
    "bare_mesh",
    "fresh_nats_server",
    "install_plugin_package",
    "mesh",
    "nats_cluster",
    "nats_hub_leaf",
    "nats_server",
    "nats_url",
    "shared_mesh",
]

_T = TypeVar("_T")


def _run_in_own_loop(coroutine_function: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine from a synchronous fixture, on an event loop in a thread of its own (the
    test's thread may hold anyio's test runner, which forbids a second loop there)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(asyncio.run, coroutine_function()).result()


# --------------------------------------------------------------------------------------------
# NATS servers


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A single JetStream node shared by the test module. A test that kills it should start it
    again (``nats_server.start()``) or use ``fresh_nats_server`` instead."""
    from apomesh.adapters.natsserver import NatsServer, single_node

    server = NatsServer(single_node(tmp_path_factory.mktemp("nats")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    """The module's ``nats_server`` URL, the server running (started again on the same store if
    an earlier test left it killed)."""
    if not nats_server.running:
        nats_server.start()
    return nats_server.url


@pytest.fixture
def fresh_nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A single JetStream node of the test's own with an empty store; the test may kill it and
    start it again on the same ports and store."""
    from apomesh.adapters.natsserver import NatsServer, single_node

    server = NatsServer(single_node(tmp_path_factory.mktemp("fresh-nats")))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def nats_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """Three JetStream peers routed to each other, shared by the test module, ready for
    three-replica streams: a list of ``NatsServer`` with ``.urls``."""
    from apomesh.adapters.natsserver import cluster, start_cluster, wait_jetstream_ready

    servers = start_cluster(cluster(tmp_path_factory.mktemp("nats-cluster"), 3))
    try:
        _run_in_own_loop(lambda: wait_jetstream_ready(servers.urls, replicas=3))
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def nats_hub_leaf(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[NatsServer, NatsServer]]:
    """``(hub, leaf)``: a JetStream hub (JetStream domain ``hub``) and a leaf node without
    JetStream linked to it. Core NATS publishes, subscriptions and request/reply cross the link."""
    from apomesh.adapters.natsserver import NatsServer, hub_and_leaf

    hub_spec, leaf_spec = hub_and_leaf(tmp_path_factory.mktemp("nats-hub-leaf"))
    hub = NatsServer(hub_spec)
    leaf = NatsServer(leaf_spec)
    try:
        hub.start()
        leaf.start()
        leaf.wait_leafnode_connected()
        hub.wait_leafnode_connected()
        yield hub, leaf
    finally:
        leaf.stop()
        hub.stop()


# --------------------------------------------------------------------------------------------
# Daemon (to come: an `apomesh serve` node and workers on top of the servers above)


class DaemonProcess:
    """An ``apomesh serve`` process on a given NATS (its embedded server when ``nats_urls`` is
    empty: then worker processes join with the credential files it writes under
    ``<data_dir>/credentials``), with its HTTP API on a free loopback port. ``kill()`` is SIGKILL;
    ``start()`` again reuses the same data dir and port, which is how tests restart a daemon.

    Its API asks for no token (``[http] auth = "off"``) unless ``auth=True``, so a test of
    something else can call it bare; ``auth=None`` leaves the daemon's own default (on). With auth
    on, ``token`` is the operator token the daemon wrote into its data dir at its first start."""

    def __init__(
        self,
        nats_urls: list[str],
        data_dir: Any,
        *,
        workers: int = 0,
        heartbeat_interval: float = 0.3,
        missed_beats: int = 3,
        env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
        auth: bool | None = False,
    ) -> None:
        from pathlib import Path

        from apomesh.adapters.natsserver import free_port

        self.nats_urls = list(nats_urls)
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.workspace = self.data_dir / "workspace"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = workers
        self.extra_args = extra_args
        self.log_file = self.data_dir / "serve.log"
        self.env = {
            "APOMESH_LIVENESS_HEARTBEAT_INTERVAL": str(heartbeat_interval),
            "APOMESH_LIVENESS_MISSED_BEATS": str(missed_beats),
            **({} if auth is None else {"APOMESH_HTTP_AUTH": "on" if auth else "off"}),
            **(env or {}),
        }
        self.auth = self.env.get("APOMESH_HTTP_AUTH", "on") != "off"
        self.proc: Any = None

    @property
    def token(self) -> str:
        """The operator token the daemon wrote at its first start (``auth=True`` only)."""
        from apomesh.runtime.config import FIRST_TOKEN_FILE

        return (self.data_dir / FIRST_TOKEN_FILE).read_text(encoding="utf-8").strip()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def daemon_id(self) -> str:
        """The daemon's stable id, which its data dir keeps (once it has started): workers
        register with it and report to it on ``apomesh.ctl.<daemon_id>.<verb>.<worker_id>``."""
        return (self.data_dir / "daemon.id").read_text(encoding="utf-8").strip()

    def start(self, timeout: float = 30.0) -> None:
        """Start the process and wait until it answers ``/healthz``."""
        self.launch()
        self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the process without waiting for it (``wait_ready`` waits)."""
        import os
        import subprocess
        import sys

        args = [
            sys.executable,
            "-m",
            "apomesh",
            "serve",
            *(["--nats", ",".join(self.nats_urls)] if self.nats_urls else []),
            "--data",
            str(self.data_dir),
            "--workspace",
            str(self.workspace),
            "--http",
            f"127.0.0.1:{self.port}",
            "--workers",
            str(self.workers),
            *self.extra_args,
        ]
        env = {**os.environ, **self.env}
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the launched process answers ``/healthz`` (it is killed if it does not)."""
        import time
        import urllib.request

        deadline = time.monotonic() + timeout
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"apomesh serve exited {self.proc.returncode}:\n{self.output_tail()}"
                )
            try:
                with opener.open(f"{self.url}/healthz", timeout=1.0) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.005)  # a refused connection costs little; a restart's figure is to 5 ms
        self.kill()
        raise RuntimeError(
            f"apomesh serve did not answer /healthz within {timeout} s:\n{self.output_tail()}"
        )

    def output_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, grace: float = 10.0) -> None:
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (Linux ``/proc``; True elsewhere)."""
    import os

    tasks = f"/proc/{pid}/task"
    if not os.path.isdir(tasks):
        return True
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("T", "t"):
            return False
    return True


class WorkerProcess:
    """An ``apomesh worker`` process; ``kill()`` is SIGKILL, ``freeze()``/``thaw()`` SIGSTOP/SIGCONT.
    ``config`` is a config file it reads (``--config``): its NATS credentials, its model
    providers' credentials; ``extra_args`` more flags (``--max-agents 1``)."""

    def __init__(
        self,
        nats_urls: list[str],
        workspace: Any,
        name: str,
        env: dict[str, str] | None = None,
        *,
        config: Any = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        from pathlib import Path

        self.nats_urls = list(nats_urls)
        self.workspace = Path(workspace)
        self.name = name
        self.env = env or {}
        self.config = Path(config) if config is not None else None
        self.extra_args = extra_args
        self.log_file = self.workspace.parent / f"worker-{name}.log"
        self.proc: Any = None

    def start(self) -> None:
        import os
        import subprocess
        import sys

        self.workspace.mkdir(parents=True, exist_ok=True)
        args = [
            sys.executable,
            "-m",
            "apomesh",
            "worker",
            "--nats",
            ",".join(self.nats_urls),
            "--name",
            self.name,
            "--workspace",
            str(self.workspace),
            *(["--config", str(self.config)] if self.config is not None else []),
            *self.extra_args,
        ]
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
            )

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def freeze(self) -> None:
        """SIGSTOP, returning once every thread of the process has stopped (a signal is delivered
        after ``kill`` returns: without the wait, the process could still take a lock or send a
        message the test believes it can no longer send)."""
        import os
        import signal
        import time

        os.kill(self.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not _all_threads_stopped(self.pid) and time.monotonic() < deadline:
            time.sleep(0.005)

    def thaw(self) -> None:
        import os
        import signal

        os.kill(self.pid, signal.SIGCONT)

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM, thawed first) without waiting for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.thaw()
            self.proc.terminate()

    def stop(self) -> None:
        import subprocess

        if self.proc is not None and self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Mesh:
    """A whole system for a test: its own nats-server, an ``apomesh serve`` process and worker
    processes. ``worker()`` starts one more; everything stops at teardown."""

    def __init__(
        self,
        server: NatsServer,
        base: Any,
        *,
        daemon_workers: int = 0,
        env: dict[str, str] | None = None,
        auth: bool | None = False,
    ) -> None:
        self.server = server
        self.base = base
        self.env = env or {}
        self.daemon = DaemonProcess(
            [server.url], base / "daemon", workers=daemon_workers, env=self.env, auth=auth
        )
        self.workers: list[WorkerProcess] = []

    @property
    def url(self) -> str:
        return self.daemon.url

    @property
    def nats_url(self) -> str:
        return self.server.url

    def worker(
        self, name: str | None = None, *, env: dict[str, str] | None = None, config: Any = None
    ) -> WorkerProcess:
        worker = WorkerProcess(
            [self.server.url],
            self.daemon.workspace,
            name or f"w{len(self.workers)}",
            env={**self.env, **(env or {})},
            config=config,
        )
        worker.start()
        self.workers.append(worker)
        return worker

    def wait_workers(self, count: int, timeout: float = 30.0) -> None:
        """Until the daemon lists ``count`` live workers."""
        import json
        import time
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            request = urllib.request.Request(f"{self.url}/v1/workers")
            if self.daemon.auth:
                request.add_header("Authorization", f"Bearer {self.daemon.token}")
            try:
                with opener.open(request, timeout=2.0) as response:
                    body = json.loads(response.read())
                    rows = body["workers"] if isinstance(body, dict) else body
                    if sum(1 for w in rows if w.get("alive", True)) >= count:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{count} workers did not register within {timeout} s")

    def start(self, workers: int = 2, *, config: Any = None) -> None:
        """Start the daemon and ``workers`` worker processes (reading ``config``) at once (a
        worker beats until the daemon hears it and asks it to register), then wait until the
        daemon lists them."""
        self.daemon.launch()
        for _ in range(workers):
            self.worker(config=config)
        self.daemon.wait_ready()
        if workers:
            self.wait_workers(workers)

    def close(self) -> None:
        for worker in self.workers:
            worker.terminate()  # all of them at once, then each waited for
        for worker in self.workers:
            worker.stop()
        self.daemon.stop()


@contextlib.contextmanager
def _running_mesh(base: Any) -> Iterator[Mesh]:
    """A system in ``base``: a nats-server, a daemon and two registered workers, stopped after."""
    from apomesh.adapters.natsserver import NatsServer, single_node

    server = NatsServer(single_node(base, name="nats"))
    server.start()
    system = Mesh(server, base)
    try:
        system.start(workers=2)
        yield system
    finally:
        system.close()
        server.stop()


@pytest.fixture
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A fresh system: its own nats-server, an ``apomesh serve`` process (no local workers) and
    two worker processes, registered. Heartbeats every 0.3 s, lost after 3 missed beats."""
    with _running_mesh(tmp_path_factory.mktemp("mesh")) as system:
        yield system


@pytest.fixture
def bare_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The ``mesh`` system with only its nats-server running, for a test that configures the
    daemon first (``daemon.extra_args``, ``daemon.env``): it starts the daemon and its workers
    itself (``start()``, or ``daemon.start()`` and ``worker()``); everything stops at teardown."""
    from apomesh.adapters.natsserver import NatsServer, single_node

    base = tmp_path_factory.mktemp("mesh")
    server = NatsServer(single_node(base, name="nats"))
    server.start()
    system = Mesh(server, base)
    try:
        yield system
    finally:
        system.close()
        server.stop()


@pytest.fixture(scope="module")
def _module_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    with _running_mesh(tmp_path_factory.mktemp("shared-mesh")) as system:
        yield system


@pytest.fixture
def shared_mesh(_module_mesh: Mesh) -> Iterator[Mesh]:
    """The ``mesh`` system shared by the test module, for tests that only start sessions of
    their own and read them: such a test must kill, freeze, stop or add nothing (that is what
    ``mesh`` is for). After each test its daemon and both workers must still be running."""
    yield _module_mesh
    daemon_alive = _module_mesh.daemon.pid is not None
    workers_alive = [w.proc.poll() is None for w in _module_mesh.workers]
    assert daemon_alive and workers_alive == [True, True], (
        "a test on shared_mesh stopped a part of it, or added one: use the mesh fixture"
    )


# --------------------------------------------------------------------------------------------
# Coordination kinds, in-process


class Crash(Exception):
    """Raised by ``ScriptedCoordinator`` at the step ``crash_after`` names: the daemon died there."""


@dataclass
class _Ask:
    position: str
    purpose: str
    prompt_digest: str
    answer: RootAnswer


@dataclass
class ScriptedCoordinator:
    """A ``CoordinatorContext`` for unit tests of a coordination kind, in-process.

    ``root`` answers each ``ask_root`` in turn: a list of ``RootAnswer`` (or a function of
    ``(purpose, prompt)``). ``child`` answers each sub-agent: a function of ``(role, task)`` that
    answers its output (a ``str``), or a ``ChildResult`` (e.g. a failure). What the kind did is
    kept as the daemon's log would keep it (``asks``, ``batches``, ``checkpoints``), and the
    daemon's replay rules apply: ``replay()`` answers a new context over the same log, as the
    daemon's after a restart, so ``await kind.run(ctx.replay())`` is a recovery; a replayed ask
    gets its answer back by its position in the loop, a replayed batch its results by its name,
    and either one changed raises ``Nondeterminism``. ``crash_after=n`` raises ``Crash`` right
    after the n-th step (an answered ask, a finished child, a saved checkpoint).

        ctx = ScriptedCoordinator(goal="g", params=kind.fold_params({}), root=[...], child=...)
        for n in range(1, 20):            # a crash after every step recovers to the same output
            crashed = ctx.fresh(crash_after=n)
            with contextlib.suppress(Crash):
                await kind.run(crashed)
            assert await kind.run(crashed.replay()) == expected
    """

    goal: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    root: list[RootAnswer] | Callable[[str, str], RootAnswer] = field(default_factory=list)
    child: Callable[[str, str], str | ChildResult] = lambda role, task: f"done: {task}"
    roles: tuple[str, ...] = ("worker",)
    crash_after: int | None = None
    asks: list[_Ask] = field(default_factory=list)
    """Every root answer, in order (``position`` is ``<checkpoint index>:<n>``)."""
    batches: dict[str, list[ChildResult]] = field(default_factory=dict)
    """Every batch by name: one result per task that ended (a crash may leave some out)."""
    checkpoints: list[Checkpoint] = field(default_factory=list)
    root_calls: int = 0
    """How many times the root was really asked (a replayed answer does not count)."""
    child_runs: list[tuple[str, str]] = field(default_factory=list)
    """(role, task) of every sub-agent really run."""
    _steps: int = 0
    _cursor: int = -1
    _asked: int = 0
    _replaying: bool = False
    _saved: bool = False

    def fresh(self, **changes: Any) -> ScriptedCoordinator:
        """A context with the same script and an empty log."""
        base = {
            "goal": self.goal,
            "params": dict(self.params),
            "root": self.root,
            "child": self.child,
            "roles": self.roles,
            "crash_after": self.crash_after,
        }
        return ScriptedCoordinator(**{**base, **changes})

    def replay(self) -> ScriptedCoordinator:
        """A context over this one's log, as a restarted daemon gives it: no crash, the loop at
        the latest checkpoint, everything logged answered from the log."""
        again = self.fresh(crash_after=None)
        again.asks = list(self.asks)
        again.batches = {name: list(results) for name, results in self.batches.items()}
        again.checkpoints = list(self.checkpoints)
        again._cursor = len(self.checkpoints) - 1
        again._replaying = bool(self.checkpoints)
        return again

    def _step(self) -> None:
        self._steps += 1
        if self.crash_after is not None and self._steps >= self.crash_after:
            raise Crash(f"crashed after step {self._steps}")

    # --- CoordinatorContext ---------------------------------------------------------------------

    @property
    def checkpoint(self) -> Checkpoint | None:
        return self.checkpoints[-1] if self.checkpoints else None

    async def save_checkpoint(self, position: str, state: bytes) -> None:
        if self._replaying:
            bounds = [self._cursor] if self._saved else [self._cursor, -1]
            for bound in bounds:
                for index, logged in enumerate(self.checkpoints):
                    if index > bound and logged == Checkpoint(position, state):
                        self._cursor, self._asked, self._saved = index, 0, True
                        return
            self._replaying = False
        self._saved = True
        self.checkpoints.append(Checkpoint(position, state))
        self._cursor, self._asked = len(self.checkpoints) - 1, 0
        self._step()

    async def ask_root(self, purpose: str, prompt: str) -> RootAnswer:
        if purpose not in ROOT_PURPOSES:
            raise DefinitionError(
                f"ask_root purpose {purpose!r} is not one of {', '.join(ROOT_PURPOSES)}",
                where="coordination kind",
            )
        self._asked += 1
        position = f"{self._cursor}:{self._asked}"
        digest = hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:16]
        for logged in self.asks:
            if logged.position == position:
                if (logged.purpose, logged.prompt_digest) != (purpose, digest):
                    raise Nondeterminism(
                        "the replayed loop asks the root something else here",
                        where=f"ask_root at {position}",
                        logged=f"{logged.purpose} {logged.prompt_digest}",
                        now=f"{purpose} {digest}",
                    )
                return logged.answer
        if callable(self.root):
            answer = self.root(purpose, prompt)
        else:
            played = len(self.asks)  # the root's script goes on where the log left it
            if played >= len(self.root):
                raise AssertionError(f"the root was asked {played + 1} times: {prompt!r}")
            answer = self.root[played]
        self.root_calls += 1
        self.asks.append(_Ask(position, purpose, digest, answer))
        self._step()
        return answer

    async def run_children(
        self,
        batch: str,
        tasks: list[str],
        *,
        role: str = "worker",
        max_parallel: int = 4,
        done_when: DoneWhen | None = None,
    ) -> list[ChildResult]:
        if role not in self.roles:
            raise DefinitionError(f"the session has no role {role!r}", where="coordination kind")
        logged = {r.index: r for r in self.batches.get(batch, [])}
        for index, result in sorted(logged.items()):
            if index >= len(tasks) or result.task != tasks[index]:
                raise Nondeterminism(
                    "a replayed batch differs from the logged one",
                    where=f"batch {batch!r} task {index}",
                    logged=result.task,
                    now=tasks[index] if index < len(tasks) else "(no such task)",
                )
        results = dict(logged)
        kept = self.batches.setdefault(batch, [])

        def finished() -> list[ChildResult]:
            return [results[i] for i in sorted(results)]

        for index, task in enumerate(tasks):
            if index in results:
                continue
            if done_when is not None and results and done_when(finished()):
                break
            self.child_runs.append((role, task))
            answered = self.child(role, task)
            ref = f"root/{len(self.child_runs) - 1}"
            result = (
                msgspec.structs.replace(answered, ref=ref, task=task, index=index)
                if isinstance(answered, ChildResult)
                else ChildResult(ref, task, index, True, answered)
            )
            results[index] = result
            kept.append(result)
            self._step()
        for index, task in enumerate(tasks):
            if index not in results:
                results[index] = ChildResult("", task, index, False, reason=BATCH_DONE_EARLY)
                kept.append(results[index])
        return finished()

    async def run(self, kind: CoordinationKind) -> str:
        """``kind.run(self)``: the kind's output."""
        return await kind.run(self)


# --------------------------------------------------------------------------------------------
# Plugin packages


def install_plugin_package(project_dir: Any) -> str:
    """Install the plugin package in ``project_dir`` (a directory with a ``pyproject.toml``) into
    this Python environment, editable and without dependencies, unless its distribution is
    installed at the project's version already; answer the distribution name.

    Its ``src`` directory is also put on this process's ``sys.path``: an editable install is
    picked up by new processes (the ``mesh`` daemon and workers), not by the running one.
    Concurrent calls from several test runs are serialised by a lock file.
    """
    import fcntl
    import importlib
    import subprocess
    import sys
    import tempfile
    import tomllib
    from importlib import metadata
    from pathlib import Path

    project = Path(project_dir).resolve()
    meta = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    name, version = str(meta["name"]), str(meta["version"])

    def installed() -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    lock_path = Path(tempfile.gettempdir()) / "apomesh-plugin-install.lock"
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if installed() != version:
            pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
            # Without build isolation when the environment can build (fast, offline); otherwise
            # pip fetches the build backend.
            attempts = [
                [*pip, "--no-build-isolation", "-e", str(project)],
                [*pip, "-e", str(project)],
            ]
            failures = []
            for command in attempts:
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode == 0:
                    break
                failures.append(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}")
            else:
                raise RuntimeError(f"cannot install {project}:\n" + "\n".join(failures))
            importlib.invalidate_caches()
    src = project / "src"
    if src.is_dir() and str(src) not in sys.path:
        sys.path.insert(0, str(src))
        importlib.invalidate_caches()
    return name
