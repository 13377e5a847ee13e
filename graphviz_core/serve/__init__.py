"""Serving many sessions from one process: the shared capture cache."""
