"""The error every command reports as one line and exit status 2 (``align.cli.die``).

In a module of its own so that ``align.validation`` and ``align.cli`` can both use it without importing
each other; commands keep importing it as ``from align.cli import ConfigError``.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad value in a config; trainers raise it from their validate() before any expensive work."""
