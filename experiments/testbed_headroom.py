"""How much room does a UNet-only trainer have on the shapes testbed? Oracle scores by fact category.

    python -m experiments.testbed_headroom                    # 200 held-out captions (seed 777), seeds 0..199
    python -m experiments.testbed_headroom --model runs/testbed-dpo      # a run folder

Three rows (four with --stochastic-eta), each the mean oracle score and the share of facts that hold per category (pooled over
captions): the true renders (1.0 by construction), the true renders encoded and decoded by the
pipeline's VAE (the best a trainer that only changes the UNet can hope for, if its latents were the
encoder's), and the model's own generations with the testbed's sampling settings. --stochastic-eta E
adds the generations of DDPO's training sampler: η = E on the noisiest --stochastic-steps steps, the
rest deterministic (`deterministic_tail`), from the same starting noise.
"""

from __future__ import annotations

import argparse
import os

import torch

import rewards
from align.data.prompt_sets import load_prompt_list
from align.eval.evaluate import EvalConfig
from align.eval.generation import sampling_settings
from align.pipeline import decode_latents, encode_images, encode_prompts, generate_images, load_trained
from align.sampling.ddim import sample_with_logprob
from align.testbed.scene import render
from rewards.images import to_tensor


def facts_held_by_category(details: list[dict]) -> dict[str, float]:
    """Pooled share of the facts that hold, per category, from the oracle's raw details."""
    held: dict[str, list[int]] = {}
    for detail in details:
        for category, counts in detail["by_category"].items():
            pair = held.setdefault(category, [0, 0])
            pair[0] += counts["held"]
            pair[1] += counts["checked"]
    return {category: h / c for category, (h, c) in held.items() if c}


@torch.no_grad()
def stochastic_generations(pipe, captions, seeds, settings, eta: float, stochastic_steps: int, batch_size: int = 50):
    """Images from DDPO's sampler: η on the first stochastic_steps steps, η = 0 after. The starting noise comes
    from each image's seed (as in generate_images); the steps' noise from one generator per batch."""
    negative = encode_prompts(pipe, [""])
    shape = (pipe.unet.config.in_channels, pipe.unet.config.sample_size, pipe.unet.config.sample_size)
    out = []
    for start in range(0, len(captions), batch_size):
        batch, batch_seeds = captions[start:start + batch_size], seeds[start:start + batch_size]
        noise = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in batch_seeds])
        step_noise = torch.Generator().manual_seed(batch_seeds[0])
        trajectory = sample_with_logprob(
            pipe.unet, pipe.scheduler, encode_prompts(pipe, batch), negative.expand(len(batch), -1, -1),
            num_inference_steps=settings["num_inference_steps"], guidance_scale=settings["guidance_scale"],
            eta=eta, latents=noise, generator=step_noise, stochastic_steps=stochastic_steps,
        )
        out.append(decode_latents(pipe, trajectory.final_latents))
    return torch.cat(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="testbed", help="testbed, a pipeline folder or a run's final/ folder")
    p.add_argument("--captions", default="testbed:200:777")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stochastic-eta", type=float, default=None,
                   help="also score DDPO's training sampler with this η (e.g. 0.7, configs/testbed_ddpo.yaml's)")
    p.add_argument("--stochastic-steps", type=int, default=10, help="its stochastic (noisiest) steps; the rest η = 0")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)

    pipe = load_trained(args.model)
    pipe.set_progress_bar_config(disable=True)
    oracle = rewards.load("shapes-oracle")
    captions = load_prompt_list(args.captions)
    seeds = list(range(len(captions)))
    size = pipe.unet.config.sample_size * pipe.vae_scale_factor
    renders = to_tensor([render(c, s, size=size) for c, s in zip(captions, seeds)])
    round_trip = decode_latents(pipe, encode_images(pipe, renders * 2 - 1))
    settings = sampling_settings(EvalConfig(), args.model)  # the (base) model's testbed.json
    generated = generate_images(pipe, captions, seeds, num_inference_steps=settings["num_inference_steps"],
                                guidance_scale=settings["guidance_scale"], batch_size=50)

    rows = [("true renders", renders), ("renders through the VAE", round_trip), ("model generations", generated)]
    if args.stochastic_eta is not None:
        stochastic = stochastic_generations(pipe, captions, seeds, settings, args.stochastic_eta, args.stochastic_steps)
        rows.append((f"eta {args.stochastic_eta:g}, {args.stochastic_steps} noisy steps", stochastic))
    categories = None
    for name, images in rows:
        scores, details = oracle.score_with_details(captions, images)
        by_category = facts_held_by_category(details)
        if categories is None:
            categories = sorted(by_category)
            print(f"{len(captions)} captions ({args.captions}), model {args.model}")
            print(f"{'images':<26}{'mean score':>11}" + "".join(f"{c:>11}" for c in categories))
        print(f"{name:<26}{float(scores.mean()):>11.3f}" + "".join(f"{by_category.get(c, float('nan')):>11.3f}" for c in categories),
              flush=True)


if __name__ == "__main__":
    main()
