"""Every error apomesh raises on purpose, in one tree.

ApomeshError                       base; ``retryable`` says whether trying again can help
├── CodecError                     bytes that are not a valid envelope (session_id, index)
│   ├── MalformedEnvelope          not msgpack, or the wrong shape
│   └── UnknownEventKind           an event tag this build does not know
├── FoldError                      a log that cannot be folded whole (session_id, index)
│   ├── IndexGap                   an index is missing
│   ├── DuplicateIndex             an index appears twice or goes backwards
│   └── InvalidLog                 an event that contradicts the log before it
├── DefinitionError                an agent definition, script or config that is wrong (where)
├── PinError                       a pinned shape that cannot be satisfied (pin)
│   ├── CorruptPin                 the pin itself cannot be decoded
│   ├── PluginPinMismatch          a pinned plugin is missing or at another version
│   └── MissingSkill               a skill named by a bundle is not in it
├── MigrationRefused               an operator's migration of a session cannot be done as asked
├── LogError                       the event log adapter failed
│   ├── LogUnavailable             NATS cannot be reached (retryable)
│   └── AppendConflict             another writer appended to the session
├── StoreError                     the LMDB store failed
│   ├── StoreFull                  the LMDB map is full
│   └── StoreUnavailable           the replicated state store did not confirm a write (retryable)
├── CatalogError                   the skill catalog or agent registry refused (name)
│   └── PublishConflict            a published (name, version) exists with other content
├── NotFound                       an unknown session, agent, skill or worker (what)
├── Fenced                         a message carried a stale fencing epoch
├── CommandRefused                 a duplicate or stale command a session's state refuses
├── IdempotencyConflict            an Idempotency-Key already used for another request
├── OwnedElsewhere                 a write to a session another daemon drives (owner, url)
├── DaemonDraining                 this daemon is draining: it takes no new session
├── SessionNotCompleted            a session run to its end did not complete (session_id, status)
├── Nondeterminism                 a replayed coordinator loop asked for other work than the log holds
├── PayloadTooLarge                an input over its configured limit (what, size, limit)
├── ToolError                      a tool call failed in a way the model should see
│   └── OutcomeUnknown             a side effect whose result was never recorded
├── BudgetExhausted                an agent ran out of steps, tool calls, tokens or time
└── PluginError                    a plugin failed to load, collided or broke its contract
"""

from __future__ import annotations


class ApomeshError(Exception):
    """Base of every deliberate apomesh error."""

    retryable = False
    code = "apomesh_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class CodecError(ApomeshError):
    code = "codec_error"

    def __init__(
        self, message: str, *, session_id: str | None = None, index: int | None = None
    ) -> None:
        where = f"session {session_id or '?'} index {index if index is not None else '?'}"
        super().__init__(f"{where}: {message}")
        self.session_id = session_id
        self.index = index


class MalformedEnvelope(CodecError):
    code = "malformed_envelope"


class UnknownEventKind(CodecError):
    code = "unknown_event_kind"


class FoldError(ApomeshError):
    code = "fold_error"

    def __init__(
        self, message: str, *, session_id: str | None = None, index: int | None = None
    ) -> None:
        super().__init__(f"session {session_id or '?'} index {index}: {message}")
        self.session_id = session_id
        self.index = index


class IndexGap(FoldError):
    code = "index_gap"


class DuplicateIndex(FoldError):
    code = "duplicate_index"


class InvalidLog(FoldError):
    code = "invalid_log"


class DefinitionError(ApomeshError):
    code = "invalid_definition"

    def __init__(self, message: str, *, where: str = "") -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where


class PinError(ApomeshError):
    code = "pin_error"

    def __init__(self, message: str, *, pin: str) -> None:
        super().__init__(f"pin {pin!r}: {message}")
        self.pin = pin


class CorruptPin(PinError):
    code = "corrupt_pin"


class PluginPinMismatch(PinError):
    code = "plugin_pin_mismatch"


class MissingSkill(PinError):
    code = "missing_skill"


class MigrationRefused(ApomeshError):
    """A session cannot be moved to another agent version as asked (not stranded, not started
    from a published agent, or the new version changes its coordination kind)."""

    code = "migration_refused"


class LogError(ApomeshError):
    code = "log_error"


class LogUnavailable(LogError):
    code = "log_unavailable"
    retryable = True


class AppendConflict(LogError):
    code = "append_conflict"


class StoreError(ApomeshError):
    code = "store_error"


class StoreFull(StoreError):
    code = "store_full"


class StoreUnavailable(StoreError):
    """The replicated state store (JetStream) could not be reached or did not confirm a write
    in time: the write is not acknowledged."""

    code = "store_unavailable"
    retryable = True


class CatalogError(ApomeshError):
    code = "catalog_error"


class PublishConflict(CatalogError):
    code = "publish_conflict"


class NotFound(ApomeshError):
    code = "not_found"

    def __init__(self, what: str) -> None:
        super().__init__(f"not found: {what}")
        self.what = what


class Fenced(ApomeshError):
    code = "fenced"

    def __init__(
        self, message: str, *, agent: str = "", epoch: int = -1, current: int = -1
    ) -> None:
        super().__init__(message)
        self.agent = agent
        self.epoch = epoch
        self.current = current


class OwnedElsewhere(ApomeshError):
    """A write (answer, cancel, resume, an operator's action) sent to a daemon that does not own
    the session: its lease names another daemon, which alone may write it. Nothing was written;
    send the request to ``owner_url``."""

    code = "owned_by_another_daemon"

    def __init__(self, session_id: str, owner: str, owner_url: str = "") -> None:
        where = f" at {owner_url}" if owner_url else ""
        super().__init__(
            f"session {session_id} is owned by daemon {owner}{where}; send the request there"
        )
        self.session_id = session_id
        self.owner = owner
        self.owner_url = owner_url


class DaemonDraining(ApomeshError):
    """This daemon is draining for maintenance: it places no new session (send it to a peer)."""

    code = "daemon_draining"
    retryable = True


class SessionNotCompleted(ApomeshError):
    """A session a caller waits on (``LocalMesh.run``) ended other than completed, or stopped
    where only a person can move it on (a HITL question, an unknown outcome held, the
    recoverable list); ``status`` is its status then."""

    code = "session_not_completed"

    def __init__(self, message: str, *, session_id: str, status: str) -> None:
        super().__init__(message)
        self.session_id = session_id
        self.status = status


class CommandRefused(ApomeshError):
    """A command a session's folded state refuses (a second answer to one pause, an answer to a
    pause that is not open, a job started twice): it is a duplicate or stale, nothing was written."""

    code = "command_refused"


class IdempotencyConflict(ApomeshError):
    """An ``Idempotency-Key`` sent again with another request than the one it first came with:
    the first session stands, nothing was started."""

    code = "idempotency_conflict"


class Nondeterminism(ApomeshError):
    """A coordination kind, replayed after a restart, asked for other work than its log holds at
    that place in the loop (a batch with other tasks, an ask with another purpose or prompt): the
    loop is not deterministic given the log, so nothing is paired with the wrong result."""

    code = "nondeterminism"

    def __init__(self, message: str, *, where: str, logged: str, now: str) -> None:
        super().__init__(f"{where}: {message} (logged: {logged!r}; now: {now!r})")
        self.where = where
        self.logged = logged
        self.now = now


class PayloadTooLarge(ApomeshError):
    code = "payload_too_large"

    def __init__(self, what: str, size: int, limit: int) -> None:
        super().__init__(f"{what} is {size} bytes, over the limit of {limit}")
        self.what = what
        self.size = size
        self.limit = limit


class ToolError(ApomeshError):
    code = "tool_error"


class OutcomeUnknown(ToolError):
    code = "outcome_unknown"


class BudgetExhausted(ApomeshError):
    code = "budget_exhausted"


class PluginError(ApomeshError):
    code = "plugin_error"
