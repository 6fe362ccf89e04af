"""Generate, train and evaluate: Diffusion-DPO, DDPO, evaluation, best-of-N, judge benchmarks."""
