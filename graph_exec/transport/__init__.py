"""transport layer (see docs)."""
