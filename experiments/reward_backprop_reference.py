"""Reference gradients for reward backpropagation (align/train/objectives/alignprop.py, draft.py, refl.py), computed by
the authors' own code on seeded inputs.

    python -m experiments.reward_backprop_reference [--out tests/data/reward_backprop_reference.json]

The authors' files are read with ``git show`` from local mirrors (``fetch`` of the repositories) and their pieces run
unchanged, exec'd with their free names bound:
  - AlignProp (mihirp1998/AlignProp @ b22918a, sd_pipeline.py): the whole ``pipeline_step_with_grad`` (random or fixed
    truncation, checkpointed UNet calls, classifier-free guidance, the DDIM step of trl's DDPO code, VAE decode,
    postprocess to [0, 1]); its ``scheduler_step`` and helpers from huggingface/trl @ 1d0b196 (the last commit that
    had trl/models/modeling_sd_base.py). The trainer's loss lines (alignprop_trainer.py ``step``: ``loss.mean() *
    loss_coeff``) are written out, with HPS's ``1 - score`` form on the pipeline's images (their loss_fn's second
    x/2 + 1/2 mapping is the documented difference, not reproduced). Its truncation draw (the ``while`` loop of
    "gaussian") runs with ``torch.distributions.Normal`` bound to a stand-in that returns mean + std x a given sequence.
  - ReFL (THUDM/ImageReward @ c1392c6, ImageReward/ReFL.py ``Trainer.train``): the lines from
    ``encoder_hidden_states = self.text_encoder(...)`` to ``loss = loss.mean() * args.grad_scale``: the DDPMScheduler
    chain of 40 steps under no_grad to the random step, that step's x0 prediction, decode, [0, 1], the reward model's
    preprocessing, relu(2 - reward), grad_scale. ``random.randint`` returns the pinned step; torchvision (not installed
    here) is bound to Resize/CenterCrop of the stand-in's 224 px images (the identity) and Normalize written out.
The networks are align/testing/tiny_backprop.py's float64 stand-ins; every draw of the authors' code (the starting
latents, each step's noise) is taken from a queue filled with the draws our sampler makes from a seeded generator, so
both sides see the same noise. Float64 throughout on their side, on CPU.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.utils.checkpoint
from diffusers import DDIMScheduler, DDPMScheduler
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg
from diffusers.schedulers import scheduling_ddpm as ddpm

from align.testing.tiny_backprop import (
    CLIP_MEAN,
    CLIP_STD,
    SD_SCHEDULE,
    TinyDecoder,
    TinyDenoiser,
    TinyJudge,
    gradient_vector,
    text_embeddings,
)

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "reward_backprop_reference.json"
ALIGNPROP = (Path("/work/.mirror/mihirp1998+AlignProp/repo"), "b22918a", "sd_pipeline.py")
TRL = (Path("/work/.mirror/huggingface+trl/repo"), "1d0b196", "trl/models/modeling_sd_base.py")
IMAGEREWARD = (Path("/work/.mirror/THUDM+ImageReward/repo"), "c1392c6", "ImageReward/ReFL.py")
BATCH, CHANNELS, SIZE = 2, 4, 64  # ReFL's block draws (batch, 4, 64, 64) latents
PROMPTS = ["a red circle", "two blue squares on the left"]

# (name, eta, guidance, steps, first step with gradient): AlignProp's own settings (eta 1, guidance 5) at two fixed
# truncations, and DRaFT-K's reading (DDIM eta 0, guidance 7.5) through AlignProp's "fixed" strategy.
ALIGNPROP_CASES = [("alignprop_k1", 1.0, 5.0, 10, 9), ("alignprop_k4", 1.0, 5.0, 10, 6), ("draft_k2", 0.0, 7.5, 10, 8)]
REFL_CASES = [("refl_step30", 30), ("refl_step37", 37)]
TRUNCATION_DRAWS = [(50, 42.0, 5.0, 11), (20, 16.8, 2.0, 12), (10, 8.4, 4.0, 13)]  # (steps, mean, std, seed)


def source(mirror: tuple[Path, str, str]) -> tuple[str, str]:
    repo, commit, path = mirror
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", commit], check=True, capture_output=True,
                         text=True).stdout.strip()
    text = subprocess.run(["git", "-C", str(repo), "show", f"{sha}:{path}"], check=True, capture_output=True,
                          text=True).stdout
    return sha, text


def definition(text: str, name: str) -> str:
    node = next(n for n in ast.parse(text).body if getattr(n, "name", None) == name)
    decorators = "".join(f"@{ast.get_source_segment(text, d)}\n" for d in getattr(node, "decorator_list", []))
    return decorators + ast.get_source_segment(text, node)


def block(text: str, start: str, end: str) -> str:
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if start in line)
    last = next(i for i in range(first, len(lines)) if end in lines[i])
    return textwrap.dedent("\n".join(lines[first:last + 1]))


class Queue:
    """Hands out prepared tensors in order: the authors' random draws, replaced by ours."""

    def __init__(self, items: list[torch.Tensor]):
        self.items = list(items)

    def pop(self, *args, **kwargs) -> torch.Tensor:
        dtype = kwargs.get("dtype") or torch.float64
        return self.items.pop(0).to(dtype)


def our_draws(seed: int, steps: int, extra: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the starting noise, each step's noise) as align/train/backprop_sampling.py draws them from ``seed``: the noise
    from the micro-batch's generator first, then one standard normal per step (float32)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((BATCH, CHANNELS, SIZE, SIZE), generator=g)
    return noise, [torch.randn((BATCH, CHANNELS, SIZE, SIZE), generator=g) for _ in range(steps + extra)]


# ---------------------------------------------------------------- AlignProp (and DRaFT-K through its fixed truncation)


class FakePipeline:
    """What ``pipeline_step_with_grad`` asks of a StableDiffusionPipeline, on the stand-in networks."""

    def __init__(self, unet, vae, scheduler, latents):
        self.unet, self.vae, self.scheduler, self.latents = unet, vae, scheduler, latents
        self.vae_scale_factor = 8
        self._execution_device = torch.device("cpu")
        self.image_processor = VaeImageProcessor(vae_scale_factor=8)

    def check_inputs(self, *args, **kwargs):
        pass

    def _encode_prompt(self, prompt, device, num_images, do_cfg, negative_prompt, prompt_embeds=None,
                       negative_prompt_embeds=None, lora_scale=None):
        return torch.cat([negative_prompt_embeds, prompt_embeds]) if do_cfg else prompt_embeds  # diffusers' order

    def prepare_latents(self, *args):
        return self.latents * self.scheduler.init_noise_sigma

    @contextlib.contextmanager
    def progress_bar(self, total):
        yield SimpleNamespace(update=lambda: None)

    def run_safety_checker(self, image, device, dtype):
        return image, None


def alignprop_namespace(trl_text: str, noise_queue: Queue) -> dict:
    namespace = {"torch": torch, "np": np, "Optional": Optional, "Union": Union, "Any": Any, "dataclass": dataclass,
                 "randn_tensor": noise_queue.pop}
    for name in ("DDPOPipelineOutput", "DDPOSchedulerOutput", "_left_broadcast", "_get_variance", "scheduler_step"):
        exec(compile(definition(trl_text, name), TRL[2], "exec"), namespace)
    return namespace


def alignprop_gradient(pipeline_text: str, trl_text: str, eta: float, guidance: float, steps: int, first: int,
                       seed: int = 0) -> dict:
    noise, step_noise = our_draws(seed, steps)
    namespace = alignprop_namespace(trl_text, Queue(step_noise))
    namespace.update(checkpoint=torch.utils.checkpoint, rescale_noise_cfg=rescale_noise_cfg,
                     DDPOPipelineOutput=namespace["DDPOPipelineOutput"], Dict=dict, List=list, Callable=object)
    exec(compile(definition(pipeline_text, "pipeline_step_with_grad"), ALIGNPROP[2], "exec"), namespace)
    unet, vae, judge = TinyDenoiser(CHANNELS), TinyDecoder(CHANNELS), TinyJudge()
    scheduler = DDIMScheduler(**SD_SCHEDULE)
    positive, negative = text_embeddings(BATCH)
    pipe = FakePipeline(unet, vae, scheduler, noise.to(torch.float64))
    with torch.enable_grad():
        output = namespace["pipeline_step_with_grad"](
            pipe, prompt_embeds=positive, negative_prompt_embeds=negative, num_inference_steps=steps,
            guidance_scale=guidance, eta=eta, backprop_strategy="fixed", backprop_kwargs={"value": first},
            output_type="pt")
        scores = judge.score_differentiable(PROMPTS, output.images)
        loss = (1.0 - scores).mean() * 0.01  # alignprop_trainer.py: loss.mean() * loss_coeff (0.01), HPS's 1 - score
        loss.backward()
    return {"eta": eta, "guidance": guidance, "steps": steps, "first_trained_step": first, "seed": seed,
            "loss": float(loss), "scores": scores.detach().tolist(), "gradient": gradient_vector(unet).tolist()}


def alignprop_truncation(pipeline_text: str, steps: int, mean: float, std: float, seed: int) -> dict:
    """The authors' truncation loop ("gaussian"), their Normal(mean, std).sample() = mean + std x our draws."""
    loop = block(definition(pipeline_text, "pipeline_step_with_grad"), "backprop_timestep = -1",
                 "backprop_timestep = int(backprop_kwargs['value'])")
    g = torch.Generator().manual_seed(seed)
    draws = [float(torch.randn((), generator=g)) for _ in range(200)]

    class Normal:
        def __init__(self, mu, sigma):
            self.mu, self.sigma = mu, sigma

        def sample(self):
            return torch.tensor(self.mu + self.sigma * draws.pop(0), dtype=torch.float64)

    namespace = {"torch": SimpleNamespace(distributions=SimpleNamespace(Normal=Normal)), "num_inference_steps": steps,
                 "backprop_strategy": "gaussian", "backprop_kwargs": {"mean": mean, "std": std}, "int": int}
    exec(compile(loop, ALIGNPROP[2] + ":truncation", "exec"), namespace)
    return {"steps": steps, "mean": mean, "std": std, "seed": seed, "first_trained_step": namespace["backprop_timestep"]}


# ---------------------------------------------------------------- ReFL


class TorchWithOurNoise:
    """``torch`` for ReFL's block, whose ``torch.randn`` (the starting latents) returns our noise."""

    def __init__(self, noise: torch.Tensor):
        self.noise = noise

    def randn(self, *args, **kwargs):
        return self.noise.to(torch.float64)

    def __getattr__(self, name):
        return getattr(torch, name)


def refl_gradient(refl_text: str, step: int, seed: int = 0) -> dict:
    noise, step_noise = our_draws(seed, step, extra=1)  # their step at the chosen timestep draws once more
    code = block(refl_text, 'encoder_hidden_states = self.text_encoder(batch["input_ids"])[0]',
                 "loss = loss.mean() * args.grad_scale")
    unet, vae, judge = TinyDenoiser(CHANNELS), TinyDecoder(CHANNELS), TinyJudge()
    positive, _ = text_embeddings(BATCH)
    lengths = torch.tensor([len(p) for p in PROMPTS])
    trainer = SimpleNamespace(
        text_encoder=lambda ids: (positive,), unet=unet, vae=vae, weight_dtype=torch.float64, reward_model=judge,
        noise_scheduler=DDPMScheduler(**{k: v for k, v in SD_SCHEDULE.items() if k != "set_alpha_to_one"}),
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x))
    namespace = {
        "self": trainer, "torch": TorchWithOurNoise(noise),
        "batch": {"input_ids": None, "rm_input_ids": lengths, "rm_attention_mask": torch.ones(BATCH, 35)},
        "args": SimpleNamespace(train_batch_size=BATCH, grad_scale=1e-3, gradient_accumulation_steps=1),
        "random": SimpleNamespace(randint=lambda low, high: step), "train_loss": 0.0, "F": torch.nn.functional,
        "BICUBIC": "bicubic", "Compose": lambda fs: (lambda x: _apply(fs, x)), "Resize": _same_size("Resize"),
        "CenterCrop": _same_size("CenterCrop"), "Normalize": _normalise}
    queue = Queue(step_noise)
    original = ddpm.randn_tensor
    ddpm.randn_tensor = queue.pop
    try:
        with torch.enable_grad():
            exec(compile(code, IMAGEREWARD[2] + ":reward_step", "exec"), namespace)
            namespace["loss"].backward()
    finally:
        ddpm.randn_tensor = original
    return {"step": step, "seed": seed, "loss": float(namespace["loss"]), "gradient": gradient_vector(unet).tolist()}


def _apply(functions, x):
    for f in functions:
        x = f(x)
    return x


def _same_size(name: str):
    def transform(size, interpolation=None):
        def apply(images):
            if tuple(images.shape[-2:]) != (size, size):
                raise ValueError(f"the stand-in {name} expects {size} px images (the identity), got {images.shape}")
            return images
        return apply
    return transform


def _normalise(mean, std):
    assert tuple(mean) == CLIP_MEAN and tuple(std) == CLIP_STD
    m = torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1)
    return lambda images: (images - m) / s


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    alignprop_sha, pipeline_text = source(ALIGNPROP)
    trl_sha, trl_text = source(TRL)
    refl_sha, refl_text = source(IMAGEREWARD)
    result = {
        "sources": {"alignprop": f"mihirp1998/AlignProp@{alignprop_sha}:{ALIGNPROP[2]}",
                    "trl": f"huggingface/trl@{trl_sha}:{TRL[2]}",
                    "refl": f"THUDM/ImageReward@{refl_sha}:{IMAGEREWARD[2]}"},
        "inputs": {"batch": BATCH, "channels": CHANNELS, "size": SIZE, "prompts": PROMPTS, "schedule": SD_SCHEDULE,
                   "loss_scale_alignprop": 0.01, "loss_scale_refl": 1e-3, "refl_ceiling": 2.0},
        "alignprop": {name: alignprop_gradient(pipeline_text, trl_text, eta, w, n, first)
                      for name, eta, w, n, first in ALIGNPROP_CASES},
        "alignprop_truncation": [alignprop_truncation(pipeline_text, *case) for case in TRUNCATION_DRAWS],
        "refl": {name: refl_gradient(refl_text, step) for name, step in REFL_CASES},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
