"""Save and load strategies, one backend per module, registered by (action, backend, version)."""
