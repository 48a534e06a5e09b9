"""docs/deploy.md's threat model names, for every "cannot", the test that checks it: each named
test must exist, so the table cannot promise what nothing checks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def threat_model() -> str:
    text = (ROOT / "docs" / "deploy.md").read_text("utf-8")
    start = text.index("## 11. Threat model")
    return text[start:]


def named_tests(section: str) -> set[tuple[str, str]]:
    found = set()
    for path, name in re.findall(r"`((?:tests/[\w/]+/)?test_\w+\.py)::(test_\w+)`", section):
        found.add((path if path.startswith("tests/") else f"tests/e2e/{path}", name))
    return found


def test_every_cannot_in_the_threat_model_names_a_test_that_exists() -> None:
    section = threat_model()
    tests = named_tests(section)
    assert len(tests) >= 25
    missing = [
        f"{path}::{name}"
        for path, name in sorted(tests)
        if not re.search(rf"^(async )?def {name}\(", (ROOT / path).read_text("utf-8"), flags=re.M)
    ]
    assert not missing, f"the threat model names tests that do not exist: {missing}"


def test_every_row_of_the_threat_model_tables_names_a_test() -> None:
    rows = [
        line
        for line in threat_model().splitlines()
        if line.startswith("| ") and not line.startswith("| identity") and "---" not in line
    ]
    rows = [r for r in rows if not r.startswith(("| credential", "| who "))]
    assert rows
    for row in rows:
        cannot = row.rstrip(" |").rsplit(" | ", 1)[-1]
        assert cannot == "—" or "test_" in cannot, f"a 'cannot' with no test: {row[:80]}"
