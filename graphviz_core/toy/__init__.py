"""Scalar expressions whose backward pass is stepped through value by value."""
