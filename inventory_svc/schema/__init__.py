"""The inventory's Alembic script directory: ``versions/`` holds its revisions, oldest first.

Run through ``accelmesh.runtime.database.migrate`` (the store does at open), which passes the
connection ``env.py`` migrates on; its version table is ``inventory_alembic_version``.
"""
