"""Fuzzing the real daemon's API: schemathesis generates requests from the served OpenAPI document
(valid ones and deliberately invalid ones) for every operation, and hypothesis throws arbitrary
JSON and raw bytes at every POST and PUT. Whatever arrives, the answer is never a 5xx, and every
error is the JSON error body with a stable code. Bounded to a few hundred requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from tests.e2e.api_support import ECHO, start, start_mesh, stop_mesh

from apomesh.testing import Mesh

EXAMPLES_PER_OPERATION = 6
RAW_EXAMPLES_PER_ROUTE = 25
STREAMING = "/v1/sessions/{session_id}/events"

FUZZ_SETTINGS = settings(
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A daemon with one worker: generated sessions that happen to be valid may run."""
    mesh = start_mesh(tmp_path_factory.mktemp("fuzz"), workers=1)
    try:
        yield mesh
    finally:
        stop_mesh(mesh)


@pytest.fixture(scope="module")
def document(system: Mesh) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{system.url}/openapi.json").json()
    return body


def check_answer(method: str, path: str, status: int, content_type: str, text: str) -> None:
    where = f"{method} {path} -> {status}: {text[:300]}"
    assert status < 500, where
    if status >= 400 and method != "HEAD":
        assert content_type.startswith("application/json"), where
        body = json.loads(text)
        assert isinstance(body.get("error"), str) and body["error"], where
        assert isinstance(body.get("message"), str), where


def fuzz_operation(
    client: httpx.Client,
    base_url: str,
    operation: Any,
    mode: GenerationMode,
    sent: dict[str, int],
) -> None:
    """Send generated requests (valid or invalid by ``mode``) to one operation."""
    label = f"{operation.method.upper()} {operation.path}"

    @settings(FUZZ_SETTINGS, max_examples=EXAMPLES_PER_OPERATION)
    @given(case=operation.as_strategy(generation_mode=mode))
    def call(case: schemathesis.Case) -> None:
        kwargs = case.as_transport_kwargs(base_url=base_url)
        method, url = kwargs.pop("method"), kwargs.pop("url")
        options: dict[str, Any] = {
            "params": kwargs.get("params"),
            "headers": {
                k: v
                for k, v in (kwargs.get("headers") or {}).items()
                if k.lower() not in ("content-length", "host")
            },
        }
        if "json" in kwargs:
            options["json"] = kwargs["json"]
        elif kwargs.get("data") is not None:
            options["content"] = kwargs["data"]
        try:
            if operation.path == STREAMING:
                with client.stream(method, url, **options) as response:
                    if response.status_code == 200:
                        return  # a real session: the stream works; do not wait for its end
                    response.read()
            else:
                response = client.request(method, url, **options)
        except httpx.LocalProtocolError:
            return  # a header no HTTP client may send (e.g. "Bearer " and nothing)
        sent[label] = sent.get(label, 0) + 1
        check_answer(
            method,
            operation.path,
            response.status_code,
            response.headers.get("content-type", ""),
            response.text,
        )

    try:
        call()
    except Unsatisfiable:
        # Nothing to make invalid (no parameters, no body): only valid requests exist.
        assert mode is GenerationMode.NEGATIVE, label


def test_generated_requests_to_every_operation_never_get_a_5xx(
    system: Mesh, document: dict[str, Any]
) -> None:
    schema = schemathesis.openapi.from_dict(document)
    sent: dict[str, int] = {}
    with httpx.Client(base_url=system.url, timeout=httpx.Timeout(20, read=5)) as client:
        for result in schema.get_all_operations():
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                fuzz_operation(client, system.url, result.ok(), mode, sent)
    assert len(sent) >= 20, sent
    assert sum(sent.values()) >= 100


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "goal",
                    "agent",
                    "definition",
                    "answer",
                    "confirm",
                    "migrate_pins",
                    "body",
                    "name",
                    "version",
                    "model",
                    "coordination",
                    "tools",
                    "roles",
                    "budget",
                    "x",
                ]
            )
            | st.text(max_size=8),
            children,
            max_size=5,
        )
    ),
    max_leaves=12,
)

RAW_BODIES = st.one_of(
    JSON_VALUES.map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    st.builds(
        lambda goal, definition: json.dumps({"goal": goal, "definition": definition}).encode(),
        st.text(max_size=30),
        JSON_VALUES,
    ),
)


@pytest.fixture(scope="module")
def paused(system: Mesh) -> str:
    """A session id with a real, open pause path to aim answers at."""
    return start(system.url, "fuzz target", ECHO)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/sessions"),
        ("POST", "/v1/sessions/{sid}/hitl/p-1"),
        ("POST", "/v1/sessions/{sid}/resume"),
        ("POST", "/v1/sessions/{sid}/cancel"),
        ("PUT", "/v1/skills/fuzzed"),
        ("POST", "/v1/agents"),
    ],
)
def test_arbitrary_bodies_to_every_post_and_put_never_get_a_5xx(
    system: Mesh, paused: str, method: str, path: str
) -> None:
    url = path.replace("{sid}", paused)
    content_types = st.sampled_from(["application/json", "text/plain", "application/x-www-form"])
    with httpx.Client(base_url=system.url, timeout=20) as client:

        @settings(FUZZ_SETTINGS, max_examples=RAW_EXAMPLES_PER_ROUTE)
        @given(body=RAW_BODIES, content_type=content_types)
        def send(body: bytes, content_type: str) -> None:
            response = client.request(
                method, url, content=body, headers={"content-type": content_type}
            )
            check_answer(
                method,
                path,
                response.status_code,
                response.headers.get("content-type", ""),
                response.text,
            )

        send()
