"""``python -m apomesh`` and the ``apomesh`` command: the command line, its modules imported with
the garbage collector off.

The command line's own imports (asyncio and the standard library's modules it needs) allocate
tens of thousands of objects that live as long as the process: with the collector on, CPython
walked them some forty times while they were imported (about 7 ms of every start of ``apomesh``).
They are kept out of its walks for good (``gc.freeze``), as ``serve`` and ``worker`` then do with
the runtime they import (``cli._runtime_import``)."""

from __future__ import annotations

import gc


def main() -> int:
    gc.disable()
    try:
        from apomesh.cli import main as run
    finally:
        gc.freeze()
        gc.enable()
    return run()


if __name__ == "__main__":
    raise SystemExit(main())
