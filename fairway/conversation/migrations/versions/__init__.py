"""Alembic revisions (the folder is a package so it ships with the wheel)."""
