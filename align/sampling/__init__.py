"""Samplers that record what the trainers need: DDIM with per-step log-probabilities, and the flow-matching
SDE/ODE sampler (Flow-GRPO)."""
