"""Alembic revisions, one module each (Alembic skips this ``__init__``)."""
