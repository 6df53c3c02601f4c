"""The command line's own refusal: what it asks for is refused (exit code 2)."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """The command line asks for something the command refuses to do (exit code 2)."""
