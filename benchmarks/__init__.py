"""Benchmarks that print figures (scripts/bench-* call them); not part of the product package."""
