"""The Python SDK: ``Client`` (async) and ``SyncClient`` (blocking) for a running apomesh daemon,
the records they return and the errors they raise. The view types (``SessionView`` and the rest)
live in ``apomesh.core.views`` and are re-exported here."""

from __future__ import annotations

from apomesh.core.views import (
    AgentConversation,
    AgentRecordView,
    AgentSummary,
    ConversationEntry,
    RecoverableView,
    SessionSummary,
    SessionView,
    SkillView,
    WorkerView,
)
from apomesh.sdk.client import (
    DEFAULT_URL,
    ApiError,
    Client,
    ConfirmationRequired,
    ConflictError,
    EventRecord,
    ForbiddenError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    Published,
    RateLimitedError,
    ServerUnavailable,
    SyncClient,
    UnauthorizedError,
)

__all__ = [
    "DEFAULT_URL",
    "AgentConversation",
    "AgentRecordView",
    "AgentSummary",
    "ApiError",
    "Client",
    "ConfirmationRequired",
    "ConflictError",
    "ConversationEntry",
    "EventRecord",
    "ForbiddenError",
    "InvalidRequestError",
    "NotFoundError",
    "PayloadTooLargeError",
    "Published",
    "RateLimitedError",
    "RecoverableView",
    "ServerUnavailable",
    "SessionSummary",
    "SessionView",
    "SkillView",
    "SyncClient",
    "UnauthorizedError",
    "WorkerView",
]
