"""Captured graphs written out: JSON, GraphML, DOT, SVG, PNG and the HTML renderer."""
