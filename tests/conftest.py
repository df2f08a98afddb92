"""Shared test settings. Lock masters come from the package's own pytest plugin
(``redlock_masters``, ``redlock_master_urls``, ``redlock``): real servers on free loopback ports."""
