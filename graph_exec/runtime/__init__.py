"""runtime layer (see docs)."""
