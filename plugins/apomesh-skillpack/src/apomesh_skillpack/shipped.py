"""A skill shipped as an entry point of the ``apomesh.skills`` group (``skillpack-checklist``).

apomesh's built-in ``entrypoint`` resolver loads the entry point and uses the string as the body.
"""

from __future__ import annotations

CHECKLIST = """Before you answer, check:
- the answer addresses the whole task;
- every file you were asked to write exists;
- nothing was done twice.
"""
