"""GPU benchmark: SD v1.5-architecture models with random weights (no download), a fixed number of Diffusion-DPO
(LoRA and full) and DDPO steps at 512 px in bf16, and for each: steps/s, peak GPU memory and model FLOPs utilisation
(MFU) with the FLOPs COUNTED (torch.utils.flop_counter.FlopCounterMode on one step), not guessed.

    python scripts/bench_gpu.py                         # a CUDA GPU; under 5 minutes on an A100/H100
    python scripts/bench_gpu.py --peak_tflops 989       # a GPU not in the table below
    python scripts/bench_gpu.py --tiny                  # a tiny model at 32 px: runs anywhere (the test's size)
    python scripts/bench_gpu.py --count_forward         # FLOPs of one SD v1.5 UNet forward at 512 px, no compute

What runs is the project's own code: the trainers' Accelerator set-up (align.train.accelerator.make_accelerator, bf16
autocast on the prepared UNet), align.pipeline's LoRA / frozen reference / disabled adapter, align.train.losses for
Diffusion-DPO, and for DDPO align.sampling.ddim.sample_with_logprob (the sampling phase) then align.train.ddpo's
train_micro_batch (the PPO update) on those samples. Diffusion-DPO's step reads cached latents and text embeddings
(as the trainer does after its first pass, or from the precomputed store), so its VAE and text encoder run once.

SDXL, SD3.5 Medium and FLUX.1-dev steps (DPO LoRA; Flow-GRPO on the flow models) run the same way from their real
configs: docs/scale.md ("GPU benchmark") lists them.

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
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
    SD3Transformer2DModel,
    UNet2DConditionModel,
)
from torch.utils.flop_counter import FlopCounterMode
from transformers import CLIPTextConfig, CLIPTextModel

from align.families.base import cat_conditioning, expand_conditioning, select_conditioning
from align.families.flux import Flux
from align.families.sd import StableDiffusion
from align.families.sd3 import StableDiffusion3
from align.families.sdxl import StableDiffusionXL
from align.pipeline import add_lora, disabled_adapter, frozen_copy
from align.sampling.ddim import sample_with_logprob
from align.sampling.flow import flow_grpo_kl, gaussian_log_prob, sample_flow_with_logprob, sde_step
from align.testing.sd15 import SD15_UNET
from align.train.accelerator import keep_default_attention, make_accelerator
from align.train.ddpo import train_micro_batch
from align.train.losses import ddpo_clipped_loss, diffusion_dpo_loss, per_sample_mse

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
SD15_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
    sample_size=512, scaling_factor=0.18215,
)
SD15_TEXT = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
SD15_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                      clip_sample=False, set_alpha_to_one=False, steps_offset=1)

# A tiny model of the same classes (align/testing/tiny_sd.py's sizes): the CPU test runs the whole script at this size.
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

# SDXL base 1.0 (stabilityai/stable-diffusion-xl-base-1.0/unet/config.json): text 77 x (768 + 1280) from its two CLIP
# encoders, micro-conditioning text_embeds (pooled, 1280) + time_ids (6 x 256 -> 2816 - 1280).
SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2, 10),
    attention_head_dim=(5, 10, 20), cross_attention_dim=2048, use_linear_projection=True, addition_embed_type="text_time",
    addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816, norm_num_groups=32,
)
# SD3.5 Medium / Large (stabilityai/stable-diffusion-3.5-{medium,large}/transformer/config.json): MMDiT on 16-channel
# latents in 2x2 patches; text = CLIP-L + CLIP-G (77 tokens, 2048 zero-padded to 4096) then T5 (256 tokens).
SD35M_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=384, qk_norm="rms_norm", dual_attention_layers=tuple(range(13)),
)
SD35L_TRANSFORMER = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38, attention_head_dim=64,
    num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048,
    pos_embed_max_size=192, qk_norm="rms_norm",
)
SD3_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
    sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False,
)
# FLUX.1-dev (black-forest-labs/FLUX.1-dev/transformer/config.json): 16-channel latents packed 2x2 into 64-channel
# tokens, T5 512 tokens, CLIP-L pooled 768, a guidance embedding. Its VAE is SD3's architecture with its own scaling.
FLUX_DEV_TRANSFORMER = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)
FLUX_VAE = {**SD3_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
TINY_SDXL_UNET = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2), attention_head_dim=(2, 4), cross_attention_dim=32, use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=64, norm_num_groups=8,
)
TINY_SD3_TRANSFORMER = dict(
    sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
    joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=32, qk_norm="rms_norm",
    dual_attention_layers=(0,),
)
TINY_SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, layers_per_block=1, block_out_channels=(8, 16),
                    down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                    norm_num_groups=8, sample_size=32, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
                    use_post_quant_conv=False)
TINY_FLUX_TRANSFORMER = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=8,
                             num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
                             axes_dims_rope=(2, 2, 4))

# LoRA targets: the attention projections (diffusers' train_dreambooth_lora_sdxl/sd3.py defaults); for SD3 the joint
# attention's context projections too (Flow-GRPO's 8 projections).
UNET_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
SD3_LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out")


@dataclass(frozen=True)
class Arch:
    """A denoiser architecture: its config (full and tiny), its text tokens and native resolution."""
    name: str
    kind: str  # "unet" (epsilon prediction, DDPM noise) | "sd3" | "flux" (flow matching: velocity, x = (1-s) x0 + s eps)
    config: dict
    tiny_config: dict
    text_tokens: int
    tiny_text_tokens: int
    resolution: int  # pixels at full size (tiny: sample_size x 8 / 4 of the latents below)
    lora_targets: tuple = UNET_LORA_TARGETS


ARCHS = {
    "sd15": Arch("sd15", "unet", SD15_UNET, TINY_UNET, 77, 77, 512),
    "sdxl": Arch("sdxl", "unet", SDXL_UNET, TINY_SDXL_UNET, 77, 77, 1024),
    "sd35m": Arch("sd35m", "sd3", SD35M_TRANSFORMER, TINY_SD3_TRANSFORMER, 77 + 256, 12, 1024, SD3_LORA_TARGETS),
    "sd35l": Arch("sd35l", "sd3", SD35L_TRANSFORMER, TINY_SD3_TRANSFORMER, 77 + 256, 12, 1024, SD3_LORA_TARGETS),
    "flux-dev": Arch("flux-dev", "flux", FLUX_DEV_TRANSFORMER, TINY_FLUX_TRANSFORMER, 512, 12, 1024),
}


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


TINY_LATENT = 8  # latent side of the tiny SDXL / SD3 / FLUX benchmarks (a few seconds on a CPU)


def latent_side(arch: Arch, tiny: bool, resolution: int | None) -> int:
    return TINY_LATENT if tiny else (resolution or arch.resolution) // 8


def build_denoiser(arch: Arch, tiny: bool, device):
    """The architecture's denoiser with random weights, initialised on ``device`` (fast on a GPU; "meta": no memory)."""
    model_class = {"unet": UNet2DConditionModel, "sd3": SD3Transformer2DModel, "flux": FluxTransformer2DModel}[arch.kind]
    with torch.device(device):
        model = model_class(**(arch.tiny_config if tiny else arch.config))
    if arch.kind == "unet":

        keep_default_attention(model)  # SDPA, as the trainers run it
    return model


def family_of_arch(arch: Arch, model):
    """The model family (align.families) whose ``predict`` calls this denoiser."""
    if arch.kind == "unet":
        return StableDiffusionXL() if model.config.addition_embed_type == "text_time" else StableDiffusion()
    return StableDiffusion3() if arch.kind == "sd3" else Flux()


def random_conditioning(arch: Arch, model, batch: int, side: int, tiny: bool, device, gen: torch.Generator | None = None) -> dict:
    """Text conditioning of the right shapes in the family's format (random values: the text encoders run once
    per prompt, not per step)."""
    config = model.config
    tokens = arch.tiny_text_tokens if tiny else arch.text_tokens

    def draw(*shape):
        return torch.randn(shape, generator=gen).to(device) if device != "meta" else torch.zeros(shape, device="meta")

    if arch.kind == "unet":
        cond = {"prompt_embeds": draw(batch, tokens, config.cross_attention_dim)}
        if config.addition_embed_type == "text_time":  # SDXL: pooled text + (original size, crop, target size)
            pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            pixels = side * 8
            time_ids = torch.tensor([pixels, pixels, 0, 0, pixels, pixels], dtype=torch.float32, device=device)
            cond.update(pooled_embeds=draw(batch, pooled), time_ids=time_ids.expand(batch, 6))
        return cond
    cond = {"prompt_embeds": draw(batch, tokens, config.joint_attention_dim),
            "pooled_embeds": draw(batch, config.pooled_projection_dim)}
    if arch.kind == "flux":
        cond["guidance"] = torch.full((batch,), 3.5, device=device)
    return cond


def predict(arch: Arch, model, latents: torch.Tensor, timesteps: torch.Tensor, cond: dict) -> torch.Tensor:
    """The denoiser's output on [B, C, H, W] latents, through its family: noise (UNet) or velocity (SD3, FLUX)."""
    return family_of_arch(arch, model).predict(model, latents, timesteps, cond)


def latent_channels(arch: Arch, model) -> int:
    """Channels of the [B, C, H, W] latents the family's ``predict`` takes (FLUX packs 2x2 of them into a token)."""
    return model.config.in_channels // 4 if arch.kind == "flux" else model.config.in_channels


def forward_gflop_on_meta(arch_name: str, resolution: int | None = None) -> float:
    """Counted GFLOP of one denoiser forward on one image at ``resolution`` (default: the model's native size), on
    the meta device: no weights, no compute, any machine (what the one-GPU recipes' time estimates start from)."""
    arch = ARCHS[arch_name]
    model = build_denoiser(arch, False, "meta")
    side = latent_side(arch, False, resolution)
    latents = torch.zeros((1, latent_channels(arch, model), side, side), device="meta")
    cond = random_conditioning(arch, model, 1, side, False, "meta")
    with torch.no_grad():
        return count_flops(lambda: predict(arch, model, latents, torch.full((1,), 500.0, device="meta"), cond)) / 1e9


def sd15_forward_gflop_on_meta(resolution: int = 512) -> float:
    return forward_gflop_on_meta("sd15", resolution)


def prepare_training(accelerator, model, checkpointing: bool, lr: float):
    """(trainable parameters, the prepared model, its prepared AdamW) of a denoiser whose trainable weights are set,
    with gradient checkpointing as asked: the trainers' setup."""
    if checkpointing:
        model.enable_gradient_checkpointing()
    params = [p for p in model.parameters() if p.requires_grad]
    train_model, optimizer = accelerator.prepare(model, torch.optim.AdamW(params, lr=lr))
    return params, train_model, optimizer


def optimiser_step(accelerator, params, optimizer) -> None:
    """Clip the gradient norm to 1 (the trainers' default), step, clear the gradients."""
    accelerator.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def family_dpo_bench(arch: Arch, accelerator, tiny: bool, pairs: int, checkpointing: bool, lora_rank: int,
                     resolution: int | None):
    """One Diffusion-DPO LoRA step on ``pairs`` cached-latent pairs of an SDXL / SD3-architecture denoiser: the policy's
    error on winner and loser at the same noise and time, the reference's (adapter off) under the same autocast, and
    align.train.losses' loss; epsilon-prediction for the UNet, the velocity target eps - x0 for SD3 (flow-matching DPO)."""
    device = accelerator.device
    model = build_denoiser(arch, tiny, device)
    add_lora(model, rank=lora_rank, target_modules=arch.lora_targets)
    model.train()
    params, train_model, optimizer = prepare_training(accelerator, model, checkpointing, lr=1e-6)
    gen = torch.Generator().manual_seed(1)
    side = latent_side(arch, tiny, resolution)
    x0 = torch.randn((2 * pairs, model.config.in_channels, side, side), generator=gen).to(device)  # winners, losers
    cond = random_conditioning(arch, model, pairs, side, tiny, device, gen)
    cond = cat_conditioning([cond, cond])  # winners then losers
    family = family_of_arch(arch, model)
    scheduler = DDIMScheduler(**SD15_SCHEDULER) if arch.kind == "unet" else FlowMatchEulerDiscreteScheduler(shift=3.0)

    def step():
        noise = torch.randn(x0[:pairs].shape, generator=gen).to(device).repeat(2, 1, 1, 1)
        # the family's training draw and target, as align/dpo.py (SD3: logit-normal σ, velocity ε - x0)
        t = family.draw_training_timesteps(scheduler, pairs, gen).to(device).repeat(2)
        noisy, target = family.noisy_and_target(scheduler, x0, noise, t)
        model_err = per_sample_mse(predict(arch, train_model, noisy, t, cond), target)
        with torch.no_grad(), accelerator.autocast(), disabled_adapter(accelerator.unwrap_model(train_model)) as ref:
            ref_err = per_sample_mse(predict(arch, ref, noisy, t, cond), target)
        loss, _ = diffusion_dpo_loss(*model_err.chunk(2), *ref_err.chunk(2), beta=5000.0 if arch.kind == "unet" else 100.0)
        accelerator.backward(loss)
        optimiser_step(accelerator, params, optimizer)

    return step, train_model, optimizer


# The authors' Flow-GRPO recipes (flow_grpo's SD3.5 and FLUX.1-dev configs): SD3 samples with classifier-free
# guidance 4.5 and trains with a KL to the reference; FLUX.1-dev embeds guidance 3.5 (one forward a step) and has no KL.
FLOW_GRPO_RECIPES = {
    "sd3": dict(guidance=4.5, noise_level=0.7, kl_coef=0.04, lora_rank=32, vae=SD3_VAE),
    "flux": dict(guidance=3.5, noise_level=0.9, kl_coef=0.0, lora_rank=64, vae=FLUX_VAE),
}


def flow_grpo_bench(arch: Arch, accelerator, tiny: bool, samples: int, inference_steps: int, checkpointing: bool,
                    resolution: int | None):
    """One Flow-GRPO step as the authors' SD3 / FLUX recipe (FLOW_GRPO_RECIPES): sample ``samples`` images with the
    SDE sampler (align.sampling.flow, σ shift 3), decode them, then train every SDE step but the last
    (timestep_fraction 0.99): the policy's step log-probability (SD3: CFG with the unconditional branch without
    gradient; FLUX: the guidance embedding), the clipped ratio (align.train.losses.ddpo_clipped_loss) and, for SD3, the
    KL to the adapter-off reference. LoRA on the family's targets (align.families), rank 4 when tiny."""
    recipe = FLOW_GRPO_RECIPES[arch.kind]
    device = accelerator.device
    model = build_denoiser(arch, tiny, device)
    rank = 4 if tiny else recipe["lora_rank"]
    add_lora(model, rank=rank, alpha=2 * rank, target_modules=family_of_arch(arch, model).lora_targets)  # alpha 2r
    params, train_model, optimizer = prepare_training(accelerator, model, checkpointing, lr=3e-4)
    with torch.device(device):
        vae = AutoencoderKL(**(TINY_SD3_VAE if tiny else recipe["vae"])).eval().requires_grad_(False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(inference_steps)
    sigmas = scheduler.sigmas.to(device)
    gen = torch.Generator().manual_seed(2)
    side = latent_side(arch, tiny, resolution)
    cond = random_conditioning(arch, model, samples, side, tiny, device, gen)
    if arch.kind == "flux":
        cond["guidance"] = torch.full((samples,), recipe["guidance"], device=device)
    uncond = random_conditioning(arch, model, 1, side, tiny, device, gen)
    trained = max(1, int(inference_steps * 0.99))
    noise_level, kl_coef = recipe["noise_level"], recipe["kl_coef"]

    def guided(net, x, t, rows, grad: bool):
        if arch.kind == "flux":  # guidance-distilled: one conditional forward
            with torch.set_grad_enabled(grad):
                return predict(arch, net, x, t, select_conditioning(cond, rows)).float()
        with torch.no_grad():  # the unconditional branch carries no gradient (the authors' train_sd3.py)
            v_u = predict(arch, net, x, t, expand_conditioning(uncond, len(x)))
        with torch.set_grad_enabled(grad):
            v_c = predict(arch, net, x, t, select_conditioning(cond, rows))
        return v_u.float() + recipe["guidance"] * (v_c.float() - v_u.float())

    def step():
        model.eval()
        with torch.no_grad(), accelerator.autocast():
            all_rows = torch.arange(samples)
            noise = torch.randn((samples, latent_channels(arch, model), side, side), generator=gen).to(device)
            trajectory = sample_flow_with_logprob(lambda x, t: guided(model, x, t, all_rows, False), noise, sigmas,
                                                  window=None, noise_level=noise_level, generator=None)
            latents = trajectory.final_latents / vae.config.scaling_factor + vae.config.shift_factor
            vae.decode(latents.to(next(vae.parameters()).dtype))  # the images a judge scores
        model.train()
        advantages = torch.randn(samples, generator=gen).to(device)
        for i in range(samples):
            for j in range(trained):
                x, x_next = trajectory.latents[i : i + 1, j], trajectory.next_latents[i : i + 1, j]
                t = trajectory.timesteps[j].reshape(1)
                rows = torch.tensor([i])
                last = i == samples - 1 and j == trained - 1
                with contextlib.nullcontext() if last else accelerator.no_sync(train_model):
                    with accelerator.autocast():
                        velocity = guided(train_model, x, t, rows, True)
                    sde = sde_step(x, velocity, sigmas[j], sigmas[j + 1], float(sigmas[1]), noise_level)
                    log_prob = gaussian_log_prob(x_next, sde.mean, sde.std)
                    loss, _ = ddpo_clipped_loss(log_prob, trajectory.log_probs[i : i + 1, j], advantages[i : i + 1], 1e-4)
                    if kl_coef:
                        with torch.no_grad(), accelerator.autocast(), disabled_adapter(model) as ref:
                            ref_mean = sde_step(x, guided(ref, x, t, rows, False), sigmas[j], sigmas[j + 1],
                                                float(sigmas[1]), noise_level).mean
                        loss = loss + kl_coef * flow_grpo_kl(sde.mean, ref_mean, sde.sde_sigma).mean()
                    accelerator.backward(loss / (samples * trained))
        optimiser_step(accelerator, params, optimizer)

    return step, train_model, optimizer, vae


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
    unet = models.fresh_unet()
    if finetune == "lora":
        add_lora(unet, rank=lora_rank)
        reference = None
    else:
        unet.requires_grad_(True)
        reference = frozen_copy(unet)
    unet.train()
    params, unet, optimizer = prepare_training(accelerator, unet, checkpointing, lr=1e-6)
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
        optimiser_step(accelerator, params, optimizer)

    return step, unet, optimizer


def ddpo_bench(models: Models, accelerator, samples: int, inference_steps: int, checkpointing: bool, lora_rank: int):
    """One DDPO step: sample ``samples`` images with per-step log-probabilities (CFG 5, eta 1, LoRA), decode them,
    then one PPO update on every sampled timestep through align.train.ddpo.train_micro_batch."""
    unet = models.fresh_unet()
    add_lora(unet, rank=lora_rank)
    params, train_unet, optimizer = prepare_training(accelerator, unet, checkpointing, lr=3e-4)
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
        batch = {"cond": {"prompt_embeds": embeds}, "all_latents": trajectory.all_latents, "timesteps": trajectory.timesteps,
                 "log_probs": trajectory.log_probs, "advantages": torch.randn(samples, generator=gen).to(embeds.device)}
        order = torch.stack([torch.randperm(inference_steps, generator=gen) for _ in range(samples)])
        stats: dict = {}
        for i in range(samples):  # one sample per micro-batch, every timestep: the paper's update
            train_micro_batch(config, accelerator, train_unet, unet, None, models.scheduler, batch,
                              {"prompt_embeds": negative}, stats,
                              disabled_adapter, torch.tensor([i]), order, per_update=samples,
                              last_of_update=i == samples - 1)
        optimiser_step(accelerator, params, optimizer)

    return step, train_unet, optimizer


BENCHES = ("dpo_lora", "dpo_full", "ddpo_lora", "sdxl_dpo_lora", "sd35m_dpo_lora", "sd35m_grpo_lora", "flux_grpo_lora")
# The forwards the one-GPU recipes' estimates use (configs/*_1gpu.yaml, configs/sdxl_*, sd35_*, flux_*).
RECIPE_FORWARDS = "sd15:512,sdxl:1024,sd35m:512,sd35m:1024,sd35l:1024,flux-dev:512,flux-dev:1024"


def count_forwards(spec: str) -> list[dict]:
    """--count_forward: counted GFLOP of one forward per image for each ARCH:PX of ``spec``."""
    results = []
    for item in (RECIPE_FORWARDS if spec == "all" else spec).split(","):
        name, _, pixels = item.strip().partition(":")
        if name not in ARCHS:
            raise SystemExit(f"error: --count_forward: unknown architecture {name!r}; valid: {', '.join(ARCHS)}")
        resolution = int(pixels) if pixels else ARCHS[name].resolution
        gflop = forward_gflop_on_meta(name, resolution)
        print(f"[bench] {name} denoiser forward at {resolution} px: {gflop:.1f} GFLOP per image (counted, meta device)",
              flush=True)
        results.append({"bench": f"{name}_forward_{resolution}", "flops_per_step": gflop * 1e9})
    return results


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
    parser.add_argument("--only", default=",".join(BENCHES), help=f"comma-separated benchmarks to run, of {', '.join(BENCHES)}")
    parser.add_argument("--resolution", type=int, default=None,
                        help="pixels for the SDXL / SD3.5 / FLUX benchmarks (default: 1024 for DPO, 512 for Flow-GRPO as the "
                             "authors' recipe; SD v1.5's benchmarks stay at 512)")
    parser.add_argument("--grpo_samples", type=int, default=4, help="Flow-GRPO images sampled and trained per step")
    parser.add_argument("--grpo_inference_steps", type=int, default=10, help="SDE steps per Flow-GRPO sample (authors: 10)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--count_forward", nargs="?", const="sd15:512", default=None, metavar="ARCH:PX,...",
                        help="only count one denoiser forward per image on the meta device (any machine) and exit; "
                             f"architectures {', '.join(ARCHS)}; 'all' for every recipe's size (default: sd15:512)")
    args = parser.parse_args(argv)
    if args.count_forward:
        return count_forwards(args.count_forward)

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
        if bench not in BENCHES:
            parser.error(f"--only: unknown benchmark {bench!r}; valid: {', '.join(BENCHES)}")
        if bench in ("sdxl_dpo_lora", "sd35m_dpo_lora"):
            arch = ARCHS[bench.split("_")[0]]
            step, *held = family_dpo_bench(arch, accelerator, args.tiny, args.pairs, checkpointing, args.lora_rank,
                                           args.resolution)
            side = latent_side(arch, args.tiny, args.resolution)
            work = (f"{args.pairs} pairs at {side}x{side} latents (policy fwd+bwd and reference fwd on {2 * args.pairs} "
                    "images, cached latents)")
        elif bench in ("sd35m_grpo_lora", "flux_grpo_lora"):
            arch = ARCHS["sd35m" if bench == "sd35m_grpo_lora" else "flux-dev"]
            step, *held = flow_grpo_bench(arch, accelerator, args.tiny, args.grpo_samples, args.grpo_inference_steps,
                                          checkpointing, args.resolution or 512)
            side = latent_side(arch, args.tiny, args.resolution or 512)
            how = ("with CFG", "policy with CFG + adapter-off reference for the KL") if arch.kind == "sd3" else \
                  ("with the guidance embedding", "policy only: no CFG, no KL")
            work = (f"{args.grpo_samples} images x {args.grpo_inference_steps} SDE steps at {side}x{side} latents sampled "
                    f"{how[0]}, decoded, then trained on {max(1, int(args.grpo_inference_steps * 0.99))} steps each "
                    f"({how[1]})")
        elif bench in ("dpo_lora", "dpo_full"):
            step, *held = dpo_bench(models, accelerator, bench.split("_")[1], args.pairs, checkpointing, args.lora_rank)
            work = f"{args.pairs} pairs (policy fwd+bwd and reference fwd on {2 * args.pairs} images)"
        elif bench == "ddpo_lora":
            step, *held = ddpo_bench(models, accelerator, args.ddpo_samples, args.ddpo_inference_steps, checkpointing,
                                     args.lora_rank)
            work = (f"{args.ddpo_samples} images x {args.ddpo_inference_steps} DDIM steps sampled with CFG, decoded, "
                    "then trained on every step")
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
