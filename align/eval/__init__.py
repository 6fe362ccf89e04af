"""Evaluation: ranking models by judges, win rate and FID, best-of-N, seeded generation with its cache, and the
HTML building blocks of every report."""
