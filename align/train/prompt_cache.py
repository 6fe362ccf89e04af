"""--cache_prompt_embeddings: the online-RL trainer encodes each training prompt once.

The text encoders run only for prompts not seen before (one call for a batch's new prompts); every prompt's
conditioning is kept on the CPU, one row per prompt, and a batch's rows are moved to the device when it is sampled.
A prompt set is drawn from over and over (Flow-GRPO's: thousands of epochs over a few thousand prompts), so after
the first epochs the text encoders sit idle; with --offload they then stay on the CPU. What it costs: host memory
for the prompts drawn (FLUX: 512 T5 tokens x 4096 features in bf16, 4 MiB a prompt).
"""

from __future__ import annotations

from align.families.base import Conditioning, cat_conditioning, conditioning_to, select_conditioning


class PromptEmbeddingCache:
    def __init__(self, family, pipe, resolution: int):
        self.family, self.pipe, self.resolution = family, pipe, resolution
        self.rows: dict[str, Conditioning] = {}  # prompt -> its conditioning, one row, on the CPU

    def conditioning(self, prompts: list[str]) -> Conditioning:
        """The conditioning of ``prompts`` (repeats allowed), on the device the family encodes to."""
        new = list(dict.fromkeys(p for p in prompts if p not in self.rows))
        device = None
        if new:
            encoded = self.family.encode_prompts(self.pipe, new, self.resolution)
            device = next(iter(encoded.values())).device
            for i, prompt in enumerate(new):
                self.rows[prompt] = conditioning_to(select_conditioning(encoded, slice(i, i + 1)), device="cpu")
        batch = cat_conditioning([self.rows[p] for p in prompts])
        return conditioning_to(batch, device=device or self.device())

    def device(self):
        """Where the denoiser computes (the conditioning goes there)."""
        return next(self.family.denoiser(self.pipe).parameters()).device
