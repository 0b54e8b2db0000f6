"""Ring attention (placeholder: filled in by the attention work)."""
