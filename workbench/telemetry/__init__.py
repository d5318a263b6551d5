"""Telemetry: what ranks measure, the records that carry it, and the notebook-side store."""
