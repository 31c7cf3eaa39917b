"""Helpers for testing dgemma against references (transformers: `dgemma.testing.hf`, imported on demand)."""
