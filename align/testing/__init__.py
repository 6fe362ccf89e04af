"""Test fixtures for the package's users and its own tests: tiny pipelines of the real diffusers classes built from
configs and saved in the real layouts (SD, SDXL, SD3/FLUX), tiny judge checkpoints in each judge's layout (CLIP,
BLIP, HPS, ImageReward, VLMs), fake OpenAI/Anthropic/Gemini servers on 127.0.0.1 for the real SDK clients,
Pick-a-Pic-shaped pairs, and a two-process CPU launch. Nothing here downloads; nothing in the package imports this."""
