"""Alembic migrations for the conversation store (run by SqlConversationStore.init)."""
