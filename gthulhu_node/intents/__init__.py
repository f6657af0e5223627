"""Intents: what sources ask this node to do (model, store, sources)."""
