"""Evaluators that produce versioned metric tables (held-out loss, generation samples,
preference and reward metrics) and suites of them comparing a model with a baseline."""
