"""Data: preference pairs in the Pick-a-Pic schema (one reader, streaming), the latent store, prompt sets and AI
feedback."""
