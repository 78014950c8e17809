"""executors layer (see docs)."""
