"""Exceptions shared by modules that must not import each other (cohort.config and cohort.presets)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key, the value and the fix."""
