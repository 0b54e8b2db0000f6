"""Placeholder: filled in by the CNN-ops work (issue 6)."""
