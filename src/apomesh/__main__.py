"""``python -m apomesh`` runs the command line."""

from apomesh.cli import main

raise SystemExit(main())
