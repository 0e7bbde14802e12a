"""Optional features that plug into the loop as callbacks (docs/architecture.md)."""
