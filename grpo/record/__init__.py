"""The run record (placeholder)."""
