"""The runtime: the daemon's orchestrator (sessions, coordinator driver, dispatch, liveness,
recovery), the worker and the agent loop, and the daemon's configuration."""
