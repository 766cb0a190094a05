"""The database schema's Alembic migrations (``env.py``, ``versions/``), shipped in the wheel as a package.

``tern migrate`` finds this folder with :mod:`importlib.resources` (``gateway.db.migrations_dir``), so
it works from an installed wheel as well as from a checkout; ``alembic.ini`` at the repository root
points the ``alembic`` command here too.
"""
