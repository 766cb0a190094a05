"""The engine's serving layer: HTTP routes, the step thread, and wire <-> core conversion."""
