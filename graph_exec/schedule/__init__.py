"""schedule layer (see docs)."""
