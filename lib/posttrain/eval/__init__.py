"""Evaluators that produce versioned metric tables (held-out loss, generation samples)."""
