"""The plugin system: hook specifications, the types plugins implement, the plugin manager with its
typed facade, and pinning of plugins by (name, version)."""
