"""Runnable example models (installed as graph_exec.examples)."""
