"""Planted bugs and the tests that must catch them: ``python -m tests.mutations.run``."""
