"""The default plugins that ship with apomesh: coordination kinds, checkpoint sources, the
built-in recovery classifier, skill resolvers, tools and model providers.

``apomesh.builtin.plugin`` wires them into the plugin host through the same ``register_*`` hooks a
third-party plugin implements; nothing here is special-cased by the host.
"""
