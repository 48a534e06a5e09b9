"""Adapters: the ports of ``apomesh.core.ports`` implemented on real infrastructure (NATS
JetStream, LMDB, the embedded nats-server) and as in-memory twins for unit tests."""
