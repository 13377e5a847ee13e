"""The instruments of a capture, each one observer of the run (graphviz_core.capture.instrument)."""
