"""The pure core: event types, the envelope codec, session state and its fold, agent definitions,
journal keys and recovery decisions. Nothing here does I/O, reads a clock or draws randomness; time
and ids arrive as arguments, so folding a log is deterministic by construction."""
