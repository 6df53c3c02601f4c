"""Helpers for testing ortpass pipelines: reference models (torch is required)."""
