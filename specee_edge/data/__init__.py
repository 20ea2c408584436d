"""Built-in prompt sets and held-out text (package data)."""
