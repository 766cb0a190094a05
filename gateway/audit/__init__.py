"""Audit log: one row per admin mutation."""
