"""Reliability tests (issue 9): bad inputs, property tests against the reference."""
