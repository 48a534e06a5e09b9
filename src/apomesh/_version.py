"""The installed apomesh version (one place; imported without loading the package's SDK)."""

__version__ = "0.1.0"
