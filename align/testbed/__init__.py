"""The shapes testbed: a tiny world with exact ground truth for text-to-image alignment."""
