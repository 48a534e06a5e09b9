"""Non-streaming chat-completion answers of real OpenAI-compatible servers, for replay.

Each ``ServerShapes`` holds one server's answers as that server writes them, field for field: a
tool-call turn (calling ``fs__write``, the API name of ``fs.write``), a text answer, and its
error answers with their status and headers. They were transcribed from the answers of these
versions: the OpenAI API (``gpt-4o-mini-2024-07-18``, late 2024), vLLM 0.6 (its OpenAI-compatible
server with the ``hermes`` tool parser and ``--api-key``), Ollama 0.4 (``/v1/chat/completions``)
and llama.cpp server (build b4273, ``--jinja``). What differs between them is what a client must
cope with: ``content`` null or ``""`` beside tool calls, tool-call ids the server makes up (or
none in the shape llama.cpp used to give), a tool call's ``index``, ``usage`` fields in another
order or with extra details, extra top-level keys (``timings``, ``prompt_logprobs``,
``system_fingerprint``), and four shapes of error: OpenAI's ``{"error": {message, type, param,
code}}``, vLLM's ``{"object": "error", message, type, code}`` and its middleware's bare
``{"error": "Unauthorized"}``, llama.cpp's ``{"error": {code: <int>, message, type}}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

WRITE_ARGS = {"path": "notes.txt", "content": "hello"}
"""The arguments of every recorded tool call."""
FINAL_TEXT = "I wrote hello to notes.txt."
"""The text of every recorded answer."""


@dataclass(frozen=True)
class ErrorShape:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    message: str = ""
    """What of the server's own message a user must see."""


@dataclass(frozen=True)
class ServerShapes:
    name: str
    tool_call: dict[str, Any]
    final: dict[str, Any]
    usage: tuple[int, int]
    """(prompt, completion) tokens of the tool-call answer."""
    errors: dict[str, ErrorShape]


OPENAI = ServerShapes(
    name="openai",
    tool_call={
        "id": "chatcmpl-AZqK3m0pXkqA1fWcQv2b7YJ9nT4dE",
        "object": "chat.completion",
        "created": 1733000000,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_8PzGv0mU3kq2Vd1nY6sB4rXe",
                            "type": "function",
                            "function": {
                                "name": "fs__write",
                                "arguments": '{"path":"notes.txt","content":"hello"}',
                            },
                        }
                    ],
                    "refusal": None,
                },
                "logprobs": None,
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {
            "prompt_tokens": 82,
            "completion_tokens": 18,
            "total_tokens": 100,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
        "system_fingerprint": "fp_0ba0d124f1",
    },
    final={
        "id": "chatcmpl-AZqK4bH2nWq8sLx0cV1mR5tY7uI9o",
        "object": "chat.completion",
        "created": 1733000001,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": FINAL_TEXT, "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": 121,
            "completion_tokens": 9,
            "total_tokens": 130,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
        },
        "system_fingerprint": "fp_0ba0d124f1",
    },
    usage=(82, 18),
    errors={
        "unauthorized": ErrorShape(
            401,
            {
                "error": {
                    "message": "Incorrect API key provided: sk-proj-****************************"
                    "************************************************************Qx3A. You can"
                    " find your API key at https://platform.openai.com/account/api-keys.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            },
            message="Incorrect API key provided",
        ),
        "rate_limited": ErrorShape(
            429,
            {
                "error": {
                    "message": "Rate limit reached for gpt-4o-mini in organization"
                    " org-Xz81pQ on requests per min (RPM): Limit 3, Used 3, Requested 1."
                    " Please try again in 20s.",
                    "type": "requests",
                    "param": None,
                    "code": "rate_limit_exceeded",
                }
            },
            headers={"retry-after": "1", "x-ratelimit-remaining-requests": "0"},
            message="Rate limit reached for gpt-4o-mini",
        ),
        "overloaded": ErrorShape(
            503,
            {
                "error": {
                    "message": "The engine is currently overloaded, please try again later.",
                    "type": "server_error",
                    "param": None,
                    "code": None,
                }
            },
            message="The engine is currently overloaded",
        ),
        "bad_request": ErrorShape(
            400,
            {
                "error": {
                    "message": "Invalid 'messages[2].tool_call_id': string too long.",
                    "type": "invalid_request_error",
                    "param": "messages[2].tool_call_id",
                    "code": "string_above_max_length",
                }
            },
            message="Invalid 'messages[2].tool_call_id'",
        ),
    },
)

VLLM = ServerShapes(
    name="vllm",
    tool_call={
        "id": "chatcmpl-5f0f3c2e9a4b4d1c8e7a6b5c4d3e2f1a",
        "object": "chat.completion",
        "created": 1733000000,
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "chatcmpl-tool-0e1d2c3b4a5f46e7",
                            "type": "function",
                            "function": {
                                "name": "fs__write",
                                "arguments": '{"path": "notes.txt", "content": "hello"}',
                            },
                        }
                    ],
                },
                "logprobs": None,
                "finish_reason": "tool_calls",
                "stop_reason": None,
            }
        ],
        "usage": {
            "prompt_tokens": 310,
            "total_tokens": 338,
            "completion_tokens": 28,
            "prompt_tokens_details": None,
        },
        "prompt_logprobs": None,
    },
    final={
        "id": "chatcmpl-9a8b7c6d5e4f40312a1b0c9d8e7f6a5b",
        "object": "chat.completion",
        "created": 1733000001,
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": FINAL_TEXT, "tool_calls": []},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 360, "total_tokens": 371, "completion_tokens": 11},
        "prompt_logprobs": None,
    },
    usage=(310, 28),
    errors={
        "unauthorized": ErrorShape(401, {"error": "Unauthorized"}, message="Unauthorized"),
        "bad_request": ErrorShape(
            400,
            {
                "object": "error",
                "message": "This model's maximum context length is 32768 tokens. However, you"
                " requested 40000 tokens (39000 in the messages, 1000 in the completion).",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            message="maximum context length is 32768 tokens",
        ),
        "not_found": ErrorShape(
            404,
            {
                "object": "error",
                "message": "The model `gpt-4o` does not exist.",
                "type": "NotFoundError",
                "param": None,
                "code": 404,
            },
            message="The model `gpt-4o` does not exist.",
        ),
    },
)

OLLAMA = ServerShapes(
    name="ollama",
    tool_call={
        "id": "chatcmpl-412",
        "object": "chat.completion",
        "created": 1733000000,
        "model": "llama3.1:8b",
        "system_fingerprint": "fp_ollama",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": "call_r3kq9x2m",
                            "index": 0,
                            "type": "function",
                            "function": {
                                "name": "fs__write",
                                "arguments": '{"content":"hello","path":"notes.txt"}',
                            },
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 190, "completion_tokens": 25, "total_tokens": 215},
    },
    final={
        "id": "chatcmpl-413",
        "object": "chat.completion",
        "created": 1733000001,
        "model": "llama3.1:8b",
        "system_fingerprint": "fp_ollama",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": FINAL_TEXT},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 230, "completion_tokens": 10, "total_tokens": 240},
    },
    usage=(190, 25),
    errors={
        "not_found": ErrorShape(
            404,
            {
                "error": {
                    "message": 'model "llama9" not found, try pulling it first',
                    "type": "api_error",
                    "param": None,
                    "code": None,
                }
            },
            message='model "llama9" not found, try pulling it first',
        ),
        "overloaded": ErrorShape(
            503,
            {
                "error": {
                    "message": "server busy, please try again.  maximum pending requests exceeded",
                    "type": "api_error",
                    "param": None,
                    "code": None,
                }
            },
            message="server busy, please try again.",
        ),
    },
)

LLAMA_CPP = ServerShapes(
    name="llama.cpp",
    tool_call={
        "choices": [
            {
                "finish_reason": "tool_calls",
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "type": "function",
                            "function": {
                                "name": "fs__write",
                                "arguments": '{"path":"notes.txt","content":"hello"}',
                            },
                            "id": "pQ7sT2vX9yZ1aB3cD5eF7gH9jK1mN3oP",
                        }
                    ],
                },
            }
        ],
        "created": 1733000000,
        "model": "gpt-3.5-turbo",
        "system_fingerprint": "b4273-7736837d",
        "object": "chat.completion",
        "usage": {"completion_tokens": 21, "prompt_tokens": 250, "total_tokens": 271},
        "id": "chatcmpl-q4kZ8nV2bX6mW0pR3tY7uE1iO5aS9dF",
        "timings": {
            "prompt_n": 250,
            "prompt_ms": 310.2,
            "prompt_per_token_ms": 1.24,
            "prompt_per_second": 805.9,
            "predicted_n": 21,
            "predicted_ms": 402.7,
            "predicted_per_token_ms": 19.17,
            "predicted_per_second": 52.1,
        },
    },
    final={
        "choices": [
            {
                "finish_reason": "stop",
                "index": 0,
                "message": {"role": "assistant", "content": FINAL_TEXT},
            }
        ],
        "created": 1733000001,
        "model": "gpt-3.5-turbo",
        "system_fingerprint": "b4273-7736837d",
        "object": "chat.completion",
        "usage": {"completion_tokens": 9, "prompt_tokens": 290, "total_tokens": 299},
        "id": "chatcmpl-w2eR4tY6uI8oP0aS2dF4gH6jK8lZ0xC",
    },
    usage=(250, 21),
    errors={
        "unauthorized": ErrorShape(
            401,
            {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}},
            message="Invalid API Key",
        ),
        "loading": ErrorShape(
            503,
            {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
            message="Loading model",
        ),
        "bad_request": ErrorShape(
            400,
            {
                "error": {
                    "code": 400,
                    "message": "the request exceeds the available context size, try increasing it",
                    "type": "exceed_context_size_error",
                }
            },
            message="the request exceeds the available context size",
        ),
    },
)

SERVERS: tuple[ServerShapes, ...] = (OPENAI, VLLM, OLLAMA, LLAMA_CPP)
