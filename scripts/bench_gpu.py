"""GPU benchmark: SD v1.5-architecture models with random weights (no download), a fixed number of Diffusion-DPO
(LoRA and full) and DDPO steps at 512 px in bf16, and for each: steps/s, peak GPU memory and model FLOPs utilisation
(MFU) with the FLOPs COUNTED (torch.utils.flop_counter.FlopCounterMode on one step), not guessed.

    python scripts/bench_gpu.py                         # a CUDA GPU; under 5 minutes on an A100/H100
    python scripts/bench_gpu.py --peak_tflops 989       # a GPU not in the table below
    python scripts/bench_gpu.py --tiny                  # a tiny model at 32 px: runs anywhere (the test's size)
    python scripts/bench_gpu.py --count_forward         # FLOPs of one SD v1.5 UNet forward at 512 px, no compute

What runs is the project's own code: the trainers' Accelerator set-up (align.training.make_accelerator, bf16
autocast on the prepared UNet), align.pipeline's LoRA / frozen reference / disabled adapter, align.losses for
Diffusion-DPO, and for DDPO align.sampling.sample_with_logprob (the sampling phase) then align.ddpo's
train_micro_batch (the PPO update) on those samples. Diffusion-DPO's step reads cached latents and text embeddings
(as the trainer does after its first pass, or from the precomputed store), so its VAE and text encoder run once.

MFU = counted FLOPs per step x steps per second / the GPU's peak dense bf16 FLOP/s. The FLOP counter counts
matmuls and convolutions (and attention) forward and backward, including gradient checkpointing's recomputation:
it is the work the GPU did, so recomputation raises MFU without making training faster (said in the output).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Peak dense bf16 tensor FLOP/s (no sparsity), from the vendors' data sheets.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIE": 756.0,
    "H100": 756.0,  # an H100 we cannot tell apart: the PCIe figure (the lower, so MFU is not overstated)
    "A100": 312.0,
}

# SD v1.5's architecture (the configs in stable-diffusion-v1-5/stable-diffusion-v1-5).
SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32,
)
SD15_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
    sample_size=512, scaling_factor=0.18215,
)
SD15_TEXT = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
SD15_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                      clip_sample=False, set_alpha_to_one=False, steps_offset=1)

# A tiny model of the same classes (tests/tiny_sd.py's sizes): the CPU test runs the whole script at this size.
TINY_UNET = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=16, attention_head_dim=4, norm_num_groups=8,
)
TINY_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1, block_out_channels=(8, 16),
                down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=8,
                sample_size=32, scaling_factor=0.18215)
TINY_TEXT = dict(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=16, bos_token_id=98, eos_token_id=99,
                 pad_token_id=99)


def peak_tflops(device: torch.device, flag: float | None) -> tuple[float | None, str]:
    """The GPU's peak dense bf16 TFLOP/s: --peak_tflops, else the table by device name, else unknown (no MFU)."""
    if flag:
        return flag, "--peak_tflops"
    if device.type != "cuda":
        return None, "a CPU: no MFU"
    name = torch.cuda.get_device_name(device).upper()
    for key, value in PEAK_BF16_TFLOPS.items():  # most specific first
        if all(part in name for part in key.split()):
            return value, f"table: {key}"
    return None, f"{name} is not in the table: pass --peak_tflops"


class Models:
    """Random-weight SD v1.5-architecture models from their configs (seeded), plus the DDIM scheduler."""

    def __init__(self, tiny: bool, device: torch.device, seed: int = 0):
        from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
        from transformers import CLIPTextConfig, CLIPTextModel

        torch.manual_seed(seed)
        self.unet_config = TINY_UNET if tiny else SD15_UNET
        self.vae = AutoencoderKL(**(TINY_VAE if tiny else SD15_VAE)).to(device).eval().requires_grad_(False)
        self.text_encoder = CLIPTextModel(CLIPTextConfig(**(TINY_TEXT if tiny else SD15_TEXT))).to(device).eval()
        self.text_encoder.requires_grad_(False)
        self.scheduler = DDIMScheduler(**SD15_SCHEDULER)
        self.device, self.tiny = device, tiny
        self._unet_class = UNet2DConditionModel
        self.resolution = self.unet_config["sample_size"] * 2 ** (len(self.vae.config.block_out_channels) - 1)

    def fresh_unet(self, seed: int = 0):
        torch.manual_seed(seed)
        from align.training import keep_default_attention

        unet = self._unet_class(**self.unet_config).to(self.device)
        keep_default_attention(unet)  # SDPA, as the trainers run it
        return unet

    @torch.no_grad()
    def text_embeddings(self, batch: int, gen: torch.Generator) -> torch.Tensor:
        vocab = self.text_encoder.config.vocab_size
        ids = torch.randint(vocab, (batch, 77), generator=gen).to(self.device)
        return self.text_encoder(ids)[0]

    @torch.no_grad()
    def latents(self, batch: int, gen: torch.Generator) -> torch.Tensor:
        pixels = torch.rand((batch, 3, self.resolution, self.resolution), generator=gen).to(self.device) * 2 - 1
        return self.vae.encode(pixels).latent_dist.mean * self.vae.config.scaling_factor


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_flops(step) -> int:
    """FLOPs of one call of ``step`` (forward, backward, recomputation), counted by torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return int(counter.get_total_flops())


def unet_forward_flops(models: Models, batch: int) -> int:
    """Counted FLOPs of one UNet forward on ``batch`` latents (a yardstick for the steps' counts)."""
    unet = models.fresh_unet()
    size, channels = models.unet_config["sample_size"], models.unet_config["in_channels"]
    latents = torch.zeros((batch, channels, size, size), device=models.device)
    text = torch.zeros((batch, 77, models.unet_config["cross_attention_dim"]), device=models.device)
    with torch.no_grad():
        return count_flops(lambda: unet(latents, torch.full((batch,), 500, device=models.device), text))


def sd15_forward_gflop_on_meta(resolution: int = 512) -> float:
    """Counted GFLOP of one SD v1.5 UNet forward on one image, on the meta device: no weights, no compute, any
    machine (the figure the one-GPU recipes' time estimates start from)."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**SD15_UNET)
    size = resolution // 8
    latents = torch.zeros((1, 4, size, size), device="meta")
    text = torch.zeros((1, 77, SD15_UNET["cross_attention_dim"]), device="meta")
    with torch.no_grad():
        return count_flops(lambda: unet(latents, torch.full((1,), 500, device="meta"), text)) / 1e9


def measure(name: str, step, steps: int, warmup: int, device: torch.device, peak: float | None, work: str) -> dict:
    """Warm up, count one step's FLOPs, time ``steps`` steps, read the peak memory."""
    for _ in range(warmup):
        step()
    flops = count_flops(step)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    seconds = time.perf_counter() - start
    result = {"bench": name, "work_per_step": work, "steps": steps, "steps_per_s": steps / seconds,
              "flops_per_step": flops, "achieved_tflops": flops * steps / seconds / 1e12}
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    if peak:
        result["mfu"] = result["achieved_tflops"] / peak
    return result


def dpo_bench(models: Models, accelerator, finetune: str, pairs: int, checkpointing: bool, lora_rank: int):
    """One Diffusion-DPO optimiser step on ``pairs`` pairs, as align/dpo.py's loop computes it."""
    from align.losses import diffusion_dpo_loss, per_sample_mse
    from align.pipeline import add_lora, disabled_adapter, frozen_copy

    unet = models.fresh_unet()
    if finetune == "lora":
        add_lora(unet, rank=lora_rank)
        reference = None
    else:
        unet.requires_grad_(True)
        reference = frozen_copy(unet)
    if checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    gen = torch.Generator().manual_seed(1)
    x0 = models.latents(2 * pairs, gen)  # winners then losers, cached as the trainer caches them
    text = models.text_embeddings(pairs, gen).repeat(2, 1, 1)
    scheduler = models.scheduler

    def step():
        noise = torch.randn(x0[:pairs].shape, generator=gen).to(x0.device).repeat(2, 1, 1, 1)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (pairs,), generator=gen).to(x0.device).repeat(2)
        noisy = scheduler.add_noise(x0, noise, t)
        model_err = per_sample_mse(unet(noisy, t, text).sample, noise)
        with torch.no_grad(), accelerator.autocast():
            if reference is None:
                with disabled_adapter(accelerator.unwrap_model(unet)) as ref_unet:
                    ref_pred = ref_unet(noisy, t, text).sample
            else:
                ref_pred = reference(noisy, t, text).sample
        ref_err = per_sample_mse(ref_pred, noise)
        loss, _ = diffusion_dpo_loss(*model_err.chunk(2), *ref_err.chunk(2), beta=5000.0)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, unet, optimizer


def ddpo_bench(models: Models, accelerator, samples: int, inference_steps: int, checkpointing: bool, lora_rank: int):
    """One DDPO step: sample ``samples`` images with per-step log-probabilities (CFG 5, eta 1, LoRA), decode them,
    then one PPO update on every sampled timestep through align.ddpo.train_micro_batch."""
    from types import SimpleNamespace

    from align.ddpo import train_micro_batch
    from align.pipeline import add_lora, disabled_adapter
    from align.sampling import sample_with_logprob

    unet = models.fresh_unet()
    add_lora(unet, rank=lora_rank)
    if checkpointing:
        unet.enable_gradient_checkpointing()
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-4)
    train_unet, optimizer = accelerator.prepare(unet, optimizer)
    config = SimpleNamespace(timestep_batch=1, guidance_scale=5.0, eta=1.0, clip_range=1e-4, adv_clip_max=5.0, kl_coef=0.0)
    gen = torch.Generator().manual_seed(2)
    embeds = models.text_embeddings(samples, gen)
    negative = models.text_embeddings(1, gen)
    channels, size = models.unet_config["in_channels"], models.unet_config["sample_size"]

    def step():
        unet.eval()
        with torch.no_grad(), accelerator.autocast():
            noise = torch.randn((samples, channels, size, size), generator=gen).to(embeds.device, embeds.dtype)
            trajectory = sample_with_logprob(unet, models.scheduler, embeds, negative.expand(samples, -1, -1),
                                             num_inference_steps=inference_steps, guidance_scale=5.0, eta=1.0,
                                             latents=noise, generator=gen)
            models.vae.decode(trajectory.final_latents / models.vae.config.scaling_factor)  # the images a judge scores
        unet.train()
        batch = {"embeds": embeds, "all_latents": trajectory.all_latents, "timesteps": trajectory.timesteps,
                 "log_probs": trajectory.log_probs, "advantages": torch.randn(samples, generator=gen).to(embeds.device)}
        order = torch.stack([torch.randperm(inference_steps, generator=gen) for _ in range(samples)])
        stats: dict = {}
        for i in range(samples):  # one sample per micro-batch, every timestep: the paper's update
            train_micro_batch(config, accelerator, train_unet, unet, None, models.scheduler, batch, negative, stats,
                              disabled_adapter, torch.tensor([i]), order, per_update=samples,
                              last_of_update=i == samples - 1)
        accelerator.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, train_unet, optimizer


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model at 32 px (any CPU; what the test runs)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per benchmark (default: 10 on a GPU, 2 tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 2 on a GPU, 1 tiny)")
    parser.add_argument("--pairs", type=int, default=4, help="DPO pairs per step (8 images through the UNet)")
    parser.add_argument("--ddpo_samples", type=int, default=4, help="DDPO images sampled and trained per step")
    parser.add_argument("--ddpo_inference_steps", type=int, default=10, help="DDIM steps per DDPO sample (paper: 50)")
    parser.add_argument("--lora_rank", type=int, default=8)
    parser.add_argument("--no_gradient_checkpointing", action="store_true", help="keep activations (more memory)")
    parser.add_argument("--peak_tflops", type=float, default=None, help="the GPU's peak dense bf16 TFLOP/s (else the table)")
    parser.add_argument("--only", default="dpo_lora,dpo_full,ddpo_lora", help="comma-separated benchmarks to run")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--count_forward", action="store_true",
                        help="only count one SD v1.5 UNet forward at 512 px on the meta device (any machine) and exit")
    args = parser.parse_args(argv)
    if args.count_forward:
        gflop = sd15_forward_gflop_on_meta()
        print(f"[bench] SD v1.5 UNet forward at 512 px: {gflop:.1f} GFLOP per image (counted, meta device)")
        return [{"bench": "sd15_unet_forward", "flops_per_step": gflop * 1e9}]

    from align.training import make_accelerator

    if not args.tiny and not torch.cuda.is_available():
        print("error: no CUDA GPU here; run with --tiny for the CPU-sized check", file=sys.stderr)
        raise SystemExit(2)
    steps = args.steps or (2 if args.tiny else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    accelerator, precision = make_accelerator("bf16", "bench")
    device = accelerator.device
    peak, peak_source = peak_tflops(device, args.peak_tflops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    models = Models(args.tiny, device)
    checkpointing = not args.no_gradient_checkpointing
    print(f"[bench] {name} | peak bf16 {peak or 'unknown'} TFLOP/s ({peak_source}) | {models.resolution} px | "
          f"precision {precision} | gradient checkpointing {'on' if checkpointing else 'off'} | torch {torch.__version__}",
          flush=True)

    results = []
    for bench in [b.strip() for b in args.only.split(",") if b.strip()]:
        if bench in ("dpo_lora", "dpo_full"):
            step, *held = dpo_bench(models, accelerator, bench.split("_")[1], args.pairs, checkpointing, args.lora_rank)
            work = f"{args.pairs} pairs (policy fwd+bwd and reference fwd on {2 * args.pairs} images)"
        elif bench == "ddpo_lora":
            step, *held = ddpo_bench(models, accelerator, args.ddpo_samples, args.ddpo_inference_steps, checkpointing,
                                     args.lora_rank)
            work = (f"{args.ddpo_samples} images x {args.ddpo_inference_steps} DDIM steps sampled with CFG, decoded, "
                    "then trained on every step")
        else:
            parser.error(f"--only: unknown benchmark {bench!r}; valid: dpo_lora, dpo_full, ddpo_lora")
        result = measure(bench, step, steps, warmup, device, peak, work)
        results.append(result)
        mfu = f" | MFU {100 * result['mfu']:.1f}%" if "mfu" in result else ""
        memory = f" | peak memory {result['peak_memory_gb']:.1f} GiB" if "peak_memory_gb" in result else ""
        print(f"[bench] {bench}: {result['steps_per_s']:.3f} steps/s | {result['flops_per_step'] / 1e9:,.4g} GFLOP per step "
              f"(counted) | {result['achieved_tflops']:.4g} TFLOP/s{memory}{mfu} | step = {work}", flush=True)
        del step, held
        accelerator.free_memory()
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
    if checkpointing:
        print("[bench] the FLOPs include gradient checkpointing's recomputed forward (work done, not useful work)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "peak_tflops": peak, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
