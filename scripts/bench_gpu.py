"""GPU benchmark: SD v1.5-architecture models with random weights (no download), a fixed number of Diffusion-DPO
(LoRA and full) and DDPO steps at 512 px in bf16, and for each: steps/s, peak GPU memory, model FLOPs utilisation
(MFU) and hardware FLOPs utilisation (HFU) with the FLOPs COUNTED (torch.utils.flop_counter.FlopCounterMode on one
step), not guessed.

    python scripts/bench_gpu.py                         # a CUDA GPU; under 5 minutes on an A100/H100
    python scripts/bench_gpu.py --peak_tflops 989       # a GPU not in the table below
    python scripts/bench_gpu.py --tiny                  # a tiny model at 32 px: runs anywhere (the test's size)
    python scripts/bench_gpu.py --count_forward         # FLOPs of one SD v1.5 UNet forward at 512 px, no compute

What runs is the project's own code: the trainers' Accelerator set-up (align.train.accelerator.make_accelerator, bf16
autocast on the prepared UNet), align.pipeline's LoRA / frozen reference / disabled adapter, align.train.losses for
Diffusion-DPO, and for the online-RL steps (DDPO, Flow-GRPO, DiffusionNFT) the online-RL trainer's own parts: its
sampler (align/sampling/registry.py: DDIMSampler / FlowSampler / ODESampler), its objective (align/train/objectives/:
PolicyGradient or DiffusionNFT), PolicyModels (trained, adapter-off reference, old policy), and plan_epoch +
train_epoch (align/train/online_update.py) on a Rollout of the sampled batch, set up as align.train.ddpo sets it up
(frozen weights in the compute dtype, LoRA in float32). Diffusion-DPO's step reads cached latents and text embeddings
(as the trainer does after its first pass, or from the precomputed store), so its VAE and text encoder run once.

SDXL, SD3.5 Medium and FLUX.1-dev steps (DPO LoRA; Flow-GRPO on the flow models; DiffusionNFT on SD3.5 Medium) run
the same way from their real configs: docs/scale.md ("GPU benchmark") lists them.

FLOPs, three ways, from one counted step (StepFlops):
- counted: every matmul, convolution and attention FlopCounterMode saw, forward and backward, gradient
  checkpointing's recomputation included (a LoRA backward skips the frozen weights' gradients, so it counts less);
- model FLOPs (MFU): a forward without gradient once, a trained forward three times (forward + backward = 3x forward,
  the usual convention), no recomputation: the counted FLOPs outside the backward calls plus 2x the trained forwards;
- hardware FLOPs (HFU): the model FLOPs plus the trained forwards once more when gradient checkpointing recomputes them.
MFU = model FLOPs per step x steps per second / the GPU's peak dense bf16 FLOP/s; HFU the same with hardware FLOPs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import sys
import tempfile
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

from align.families.base import cat_conditioning, expand_conditioning, guided_prediction
from align.families.flux import Flux
from align.families.sd import StableDiffusion
from align.families.sd3 import StableDiffusion3
from align.families.sdxl import StableDiffusionXL
from align.pipeline import add_lora, disabled_adapter, frozen_copy
from align.sampling.registry import sampler_entry
from align.testing.sd15 import SD15_UNET
from align.train.accelerator import adamw_class, make_accelerator
from align.train.ddpo_config import DDPOConfig
from align.train.ddpo_order import SAMPLE, epoch_generator
from align.train.losses import diffusion_dpo_loss, per_sample_mse
from align.train.memory_model import PipelineParts, plan_parts
from align.train.memory_plan import GIB, ddp_plan, total
from align.train.objectives import algorithm
from align.train.old_policy import OldPolicy
from align.train.online_update import Epoch, Update, plan_epoch, train_epoch
from align.train.policy_models import PolicyModels, sampling_merges_lora
from align.train.quantization import (
    CHOICES,
    NONE,
    SCHEMES,
    cast_inputs_to,
    keep_dequantized_weights_out_of_autograd,
    quantize_linear_weights,
)
from align.train.rollout import Rollout

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
        StableDiffusion().set_training_attention(unet)  # SDPA, as the trainers run it
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


@dataclass(frozen=True)
class StepFlops:
    """One step's counted FLOPs and the two parts that turn them into model and hardware FLOPs."""

    counted: int  # everything FlopCounterMode saw
    backward: int  # of which inside the backward calls: the gradients and gradient checkpointing's recomputation
    trained_forward: int  # the trained model's forward calls with gradient, each counted whole

    @property
    def model(self) -> int:
        """Model FLOPs: what ran outside the backward (a no-grad forward once, a trained forward once) plus a backward
        of two forwards for each trained forward (3x forward in all), whatever the backward really computed."""
        return self.counted - self.backward + 2 * self.trained_forward

    def hardware(self, checkpointing: bool) -> int:
        """Model FLOPs plus gradient checkpointing's recomputed forward of each trained forward."""
        return self.model + (self.trained_forward if checkpointing else 0)


def count_step_flops(step, accelerator, trained: torch.nn.Module) -> StepFlops:
    """Run ``step`` once under FlopCounterMode, noting the FLOPs counted inside ``accelerator.backward`` (every step's
    backward goes through it) and inside ``trained``'s forward calls made with gradient enabled (its hooks; the
    recomputation under checkpointing calls its blocks, not the model, so it is not among them)."""
    counter = FlopCounterMode(display=False)
    parts = {"backward": 0, "trained_forward": 0}
    starts: list[int | None] = []

    def before_forward(module, args):
        starts.append(counter.get_total_flops() if torch.is_grad_enabled() else None)

    def after_forward(module, args, output):
        start = starts.pop()
        if start is not None:
            parts["trained_forward"] += counter.get_total_flops() - start

    backward = accelerator.backward

    def counted_backward(loss, **kwargs):
        start = counter.get_total_flops()
        backward(loss, **kwargs)
        parts["backward"] += counter.get_total_flops() - start

    hooks = [trained.register_forward_pre_hook(before_forward), trained.register_forward_hook(after_forward)]
    accelerator.backward = counted_backward  # this instance only, for this one step
    try:
        with counter:
            step()
    finally:
        del accelerator.backward
        for hook in hooks:
            hook.remove()
    return StepFlops(int(counter.get_total_flops()), parts["backward"], parts["trained_forward"])


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

        StableDiffusion().set_training_attention(model)  # SDPA, as the trainers run it
    return model


def quantized_base(model: torch.nn.Module, scheme: str, dtype: torch.dtype) -> torch.nn.Module:
    """The frozen base of a LoRA benchmark as --quantize_base loads it: its weights in the compute dtype, every
    nn.Linear weight quantized with the scheme's config (torchao's quantize_, which diffusers' TorchAoConfig applies at
    load; NF4: the model saved and loaded back through diffusers' BitsAndBytesConfig, which quantizes on a GPU only),
    and the trainers' backward for quantized linears (align/train/quantization.py). Call it before the LoRA is added."""
    if scheme == NONE:
        return model
    model = cast(model, dtype)
    if SCHEMES[scheme].backend == "torchao":
        quantize_linear_weights(model, scheme, dtype)
        keep_dequantized_weights_out_of_autograd(model)
        cast_inputs_to(model, dtype)
        return model
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        device = next(model.parameters()).device
        model = type(model).from_pretrained(folder, quantization_config=SCHEMES[scheme].config_object("diffusers", dtype),
                                            torch_dtype=dtype).to(device)
    cast_inputs_to(model, dtype)
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
                     resolution: int | None, quantize: str = NONE):
    """One Diffusion-DPO LoRA step on ``pairs`` cached-latent pairs of an SDXL / SD3-architecture denoiser: the policy's
    error on winner and loser at the same noise and time, the reference's (adapter off) under the same autocast, and
    align.train.losses' loss; epsilon-prediction for the UNet, the velocity target eps - x0 for SD3 (flow-matching DPO)."""
    device = accelerator.device
    model = quantized_base(build_denoiser(arch, tiny, device), quantize, torch.bfloat16)
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


# ----------------------------------------------------------------------------------------------
# Online RL (DDPO, Flow-GRPO, DiffusionNFT): one epoch of align.train.ddpo on one sampling batch

# The schedulers of the real models (scheduler/scheduler_config.json): SD3.5 a static shift of 3; FLUX.1-dev a shift
# from the image's token count (its pipeline's calculate_shift, which the trainer's flow_sigmas applies).
SD3_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)
FLUX_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                      base_image_seq_len=256, max_image_seq_len=4096)

# The authors' recipes, as the trainer's options. Flow-GRPO (flow_grpo's SD3.5 and FLUX.1-dev configs): SD3 samples
# with classifier-free guidance 4.5 and trains with a KL to the reference, 9 of 10 steps; FLUX.1-dev embeds guidance
# 3.5 (one forward a step) and has no KL. DiffusionNFT (NVlabs/DiffusionNFT config/nft.py, SD3.5 Medium): no CFG
# (guidance 1), the ODE from the old policy, beta 1, KL 1e-4 to the reference, 9 of 10 steps. LoRA alpha 2 x rank.
ONLINE_RL_RECIPES = {
    "sd3_grpo": dict(options=dict(algorithm="ppo", guidance_scale=4.5, eta=0.7, kl_coef=0.04, timestep_fraction=0.99),
                     lora_rank=32, vae=SD3_VAE, scheduler=SD3_SCHEDULER),
    "flux_grpo": dict(options=dict(algorithm="ppo", guidance_scale=3.5, eta=0.9, kl_coef=0.0, timestep_fraction=0.99),
                      lora_rank=64, vae=FLUX_VAE, scheduler=FLUX_SCHEDULER),
    "sd3_nft": dict(options=dict(algorithm="nft", guidance_scale=1.0, kl_coef=1e-4, nft_beta=1.0, adv_clip_max=5.0,
                                 old_policy_decay="linear-0.5", timestep_fraction=0.99),
                    lora_rank=32, vae=SD3_VAE, scheduler=SD3_SCHEDULER),
}
# The DDPO paper's (ddpo-pytorch): DDIM eta 1, CFG 5, PPO clip 1e-4, no KL, every step trained.
DDPO_OPTIONS = dict(algorithm="ppo", guidance_scale=5.0, eta=1.0, clip_range=1e-4, adv_clip_max=5.0, kl_coef=0.0)


def online_rl_config(samples: int, inference_steps: int, precision: str, lora_rank: int, lora_alpha: float | None,
                     quantize: str = NONE, **options) -> DDPOConfig:
    """The trainer's options for an epoch of one sampling batch of ``samples`` images trained in one optimiser step,
    one sample per micro-batch and one timestep per model call (the trainer's least memory)."""
    return DDPOConfig(prompts="bench", mixed_precision=precision, samples_per_epoch=samples, sample_batch_size=samples,
                      train_batch_size=1, gradient_accumulation_steps=samples, timestep_batch=1,
                      num_inference_steps=inference_steps, lora_rank=lora_rank, lora_alpha=lora_alpha,
                      quantize_base=quantize, **options)


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the online-RL trainer loads a LoRA run's frozen weights in."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)


def cast(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module``'s weights in ``dtype``, as from_pretrained(torch_dtype=...) loads them for the trainer (torch's own
    ``to``: diffusers' warns on every cast, even with no module to keep in float32)."""
    return torch.nn.Module.to(module, dtype)


def in_dtype(cond: dict, dtype: torch.dtype) -> dict:
    """Conditioning as the text encoders give it in ``dtype`` (the trainer's encoders run in the compute dtype)."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in cond.items()}


def trainer_pipe(scheduler, vae, denoiser) -> SimpleNamespace:
    """The pipeline attributes the trainer's sampler (its registry entry's build, the family's flow_sigmas) and decoder (the
    family's decode_latents) read; no text encoders: the conditioning is given."""
    return SimpleNamespace(scheduler=scheduler, vae=vae, vae_scale_factor=8, unet=denoiser, transformer=denoiser)


class OnlineRLStep:
    """One epoch of align.train.ddpo on one sampling batch, set up as ddpo.train sets it up: the denoiser's frozen
    weights in the compute dtype and a LoRA in float32, gradient checkpointing, the old policy where the objective keeps
    one, AdamW through accelerate; the registries' sampler and objective, PolicyModels and online_update.Update.

    A call: sample the batch with the sampler (from the old policy where the objective samples with it, as
    collect_rollouts), decode it (the images a judge scores), draw random advantages, then plan_epoch and
    train_epoch (the objective's loss on each trained step, backward, gradient clipping, AdamW) and the old
    policy's update."""

    def __init__(self, family, denoiser, config: DDPOConfig, accelerator, pipe, cond: dict, negative: dict,
                 latent_shape: tuple[int, int, int], checkpointing: bool, resolution: int):
        config.resolve_for_family(family.is_flow)
        device = accelerator.device
        denoiser = quantized_base(cast(denoiser, compute_dtype(config.mixed_precision)), config.quantize_base,
                                  compute_dtype(config.mixed_precision))
        pipe.unet = pipe.transformer = denoiser
        self.sampler = sampler_entry(config.sampler, family.is_flow).build(config, family, pipe, resolution, device)
        entry = algorithm(config.algorithm)
        self.objective = entry.objective.from_config(self.sampler, config)
        add_lora(denoiser, rank=config.lora_rank, alpha=config.lora_alpha, target_modules=family.lora_targets)
        for p in denoiser.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        if checkpointing:
            denoiser.enable_gradient_checkpointing()
        params = [p for p in denoiser.parameters() if p.requires_grad]
        self.old_policy = OldPolicy(params) if entry.objective.keeps_old_policy(config) else None
        optimizer = adamw_class(config.use_8bit_adam)(params, lr=config.learning_rate, weight_decay=config.adam_weight_decay)
        self.trained, self.optimizer = accelerator.prepare(denoiser, optimizer)
        self.models = PolicyModels(family, denoiser, self.trained, None, self.old_policy, config.guidance_scale,
                                   accelerator.autocast, self.objective.samples_with_old_policy,
                                   merge_lora=sampling_merges_lora(config))
        self.update = Update(config, accelerator, self.models, self.objective, self.optimizer, params, negative)
        self.family, self.denoiser, self.config, self.accelerator, self.pipe = family, denoiser, config, accelerator, pipe
        self.cond, self.negative, self.latent_shape = cond, negative, latent_shape
        self.epoch, self.global_step = 0, 0

    def __call__(self) -> None:
        config, accelerator, family = self.config, self.accelerator, self.family
        samples = config.sample_batch_size
        gen = epoch_generator(config.seed, self.epoch, SAMPLE, 0, 0)
        embeds = self.cond["prompt_embeds"]
        self.denoiser.eval()
        with torch.no_grad(), accelerator.autocast(), self.models.sampling() as denoiser:
            noise = torch.randn((samples, *self.latent_shape), generator=gen).to(embeds.device, embeds.dtype)
            uncond = expand_conditioning(self.negative, samples)

            def predict(x, t):
                return guided_prediction(family, denoiser, x, t, self.cond, uncond, config.guidance_scale)

            steps = self.sampler.run(predict, noise, gen)
            images = family.decode_latents(self.pipe, steps["final_latents"]).cpu()  # the images a judge scores
        rollout = Rollout(prompts=["bench"] * samples, cond=self.cond, images=images, **steps)
        self.denoiser.train()
        advantages = torch.randn(samples, generator=gen).to(accelerator.device)
        plan = plan_epoch(config, rollout, self.epoch, 0, 1, 1, self.objective.needs_forward_noise)
        self.global_step += train_epoch(self.update, Epoch(rollout, advantages, plan), {})
        if self.old_policy is not None:
            self.old_policy.update(self.objective.old_policy_decay(self.global_step))
        self.epoch += 1


def flow_rl_bench(recipe_name: str, arch: Arch, accelerator, precision: str, tiny: bool, samples: int,
                  inference_steps: int, checkpointing: bool, resolution: int | None, quantize: str = NONE):
    """One online-RL epoch of an SD3 / FLUX-architecture denoiser with the authors' recipe (ONLINE_RL_RECIPES):
    Flow-GRPO (the SDE sampler, PPO with the step log-probabilities; SD3: CFG with both halves differentiated and the
    KL to the adapter-off reference; FLUX: the guidance embedding) or DiffusionNFT (the ODE from the old policy, the
    trained, old and reference predictions at the forward process's x_t). LoRA rank as the recipe, 4 when tiny."""
    recipe = ONLINE_RL_RECIPES[recipe_name]
    device = accelerator.device
    model = build_denoiser(arch, tiny, device)
    family = family_of_arch(arch, model)
    rank = 4 if tiny else recipe["lora_rank"]
    config = online_rl_config(samples, inference_steps, precision, rank, 2 * rank, quantize, **recipe["options"])
    dtype = compute_dtype(precision)
    with torch.device(device):
        vae = cast(AutoencoderKL(**(TINY_SD3_VAE if tiny else recipe["vae"])), dtype).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(2)
    side = latent_side(arch, tiny, resolution)
    cond = in_dtype(random_conditioning(arch, model, samples, side, tiny, device, gen), dtype)
    negative = in_dtype(random_conditioning(arch, model, 1, side, tiny, device, gen), dtype)
    pipe = trainer_pipe(FlowMatchEulerDiscreteScheduler(**recipe["scheduler"]), vae, model)
    step = OnlineRLStep(family, model, config, accelerator, pipe, cond, negative,
                        (latent_channels(arch, model), side, side), checkpointing, side * 8)
    return step, step.trained, step.optimizer, vae


# ----------------------------------------------------------------------------------------------
# The memory planner's figure for each benchmark (align/train/memory_plan.py, the --dry_run arithmetic)


def on_meta(model_class, config: dict) -> torch.nn.Module:
    with torch.device("meta"):
        return model_class(**config) if model_class is not CLIPTextModel else model_class(CLIPTextConfig(**config))


def planned_gib(family, denoiser: torch.nn.Module, vae_config: dict, others: list, text_tokens: int, settings) -> float:
    """What the planner puts in one process for this benchmark's model, adapter, optimiser, frozen parts and activations
    (``settings``: the trainer options it reads); the conditioning is given (no text encoders) unless ``others`` holds
    them as the benchmark does."""
    parts = PipelineParts(family, denoiser, vae_config, others, text_tokens)
    return total(ddp_plan(plan_parts(parts, settings).shape, 1)) / GIB


def plan_settings(finetune: str, rank: int, pairs_or_batch: int, resolution: int, checkpointing: bool, quantize: str,
                  online=None) -> SimpleNamespace:
    """The options plan_parts reads: a Diffusion-DPO step's, or an online-RL config's (``online``) with the bench's."""
    base = dict(model="bench", finetune=finetune, lora_rank=rank, lora_alpha=None, mixed_precision="bf16",
                use_8bit_adam=False, train_batch_size=pairs_or_batch, quantize_text_encoders=NONE, offload=False)
    if online is not None:
        base = {**vars(online), **{k: v for k, v in base.items() if k not in vars(online)}}
    return SimpleNamespace(**{**base, "gradient_checkpointing": checkpointing, "resolution": resolution,
                              "quantize_base": quantize})


def bench_plan(bench: str, args, tiny: bool, checkpointing: bool, online=None) -> float:
    """The planner's GiB for one benchmark as main() sets it up."""
    quantize = NONE if bench == "dpo_full" else args.quantized_base
    if bench in ("dpo_lora", "dpo_full", "ddpo_lora"):  # SD v1.5: Models keeps its VAE and text encoder resident
        unet, vae = (TINY_UNET, TINY_VAE) if tiny else (SD15_UNET, SD15_VAE)
        others = [on_meta(AutoencoderKL, vae), on_meta(CLIPTextModel, TINY_TEXT if tiny else SD15_TEXT)]
        resolution = unet["sample_size"] * 2 ** (len(vae["block_out_channels"]) - 1)
        settings = plan_settings(bench.split("_")[1], args.lora_rank, args.pairs, resolution, checkpointing, quantize,
                                 online)
        return planned_gib(StableDiffusion(), on_meta(UNet2DConditionModel, unet), vae, others, 77, settings)
    arch = ARCHS[{"sdxl_dpo_lora": "sdxl", "sd35m_dpo_lora": "sd35m", "flux_grpo_lora": "flux-dev"}.get(bench, "sd35m")]
    model = build_denoiser(arch, tiny, "meta")
    side = latent_side(arch, tiny, args.resolution or (None if "dpo" in bench else 512))
    vae = TINY_SD3_VAE if tiny else (SD15_VAE if arch.kind == "unet" else SD3_VAE)  # what sets the latent side: 8x
    vae_config = {**vae, "block_out_channels": (1, 2, 3, 4)}  # planner's downsampling 8 (tiny latents: side x 8 pixels)
    others = [] if online is None else [on_meta(AutoencoderKL, vae)]
    settings = plan_settings("lora", online.lora_rank if online is not None else args.lora_rank, args.pairs, side * 8,
                             checkpointing, quantize, online)
    tokens = arch.tiny_text_tokens if tiny else arch.text_tokens
    return planned_gib(family_of_arch(arch, model), model, vae_config, others, tokens, settings)


def measure(name: str, step, steps: int, warmup: int, device: torch.device, peak: float | None, work: str,
            accelerator, trained: torch.nn.Module, checkpointing: bool) -> dict:
    """Warm up, count one step's FLOPs (StepFlops), time ``steps`` steps, read the peak memory."""
    for _ in range(warmup):
        step()
    flops = count_step_flops(step, accelerator, trained)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(device)
    seconds = time.perf_counter() - start
    per_s = steps / seconds
    hardware = flops.hardware(checkpointing)
    result = {"bench": name, "work_per_step": work, "steps": steps, "steps_per_s": per_s,
              "flops_per_step": flops.counted, "backward_flops_per_step": flops.backward,
              "trained_forward_flops_per_step": flops.trained_forward, "model_flops_per_step": flops.model,
              "hardware_flops_per_step": hardware, "achieved_tflops": flops.counted * per_s / 1e12,
              "model_tflops": flops.model * per_s / 1e12, "hardware_tflops": hardware * per_s / 1e12}
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    if peak:
        result["mfu"] = result["model_tflops"] / peak
        result["hfu"] = result["hardware_tflops"] / peak
    return result


def dpo_bench(models: Models, accelerator, finetune: str, pairs: int, checkpointing: bool, lora_rank: int,
              quantize: str = NONE):
    """One Diffusion-DPO optimiser step on ``pairs`` pairs, as align/dpo.py's loop computes it."""
    unet = models.fresh_unet()
    if finetune == "lora":
        unet = quantized_base(unet, quantize, torch.bfloat16)
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


def ddpo_bench(models: Models, accelerator, precision: str, samples: int, inference_steps: int, checkpointing: bool,
               lora_rank: int, quantize: str = NONE):
    """One DDPO epoch (OnlineRLStep): sample ``samples`` images with stochastic DDIM (CFG 5, eta 1, LoRA), decode them,
    then one PPO update on every sampled timestep (both halves of the guided prediction differentiated)."""
    unet = models.fresh_unet()
    config = online_rl_config(samples, inference_steps, precision, lora_rank, None, quantize, **DDPO_OPTIONS)
    dtype = compute_dtype(precision)
    vae = cast(copy.deepcopy(models.vae), dtype)  # the trainer's VAE is in the compute dtype; the DPO benches keep theirs
    gen = torch.Generator().manual_seed(2)
    cond = {"prompt_embeds": models.text_embeddings(samples, gen).to(dtype)}
    negative = {"prompt_embeds": models.text_embeddings(1, gen).to(dtype)}
    channels, size = models.unet_config["in_channels"], models.unet_config["sample_size"]
    step = OnlineRLStep(StableDiffusion(), unet, config, accelerator, trainer_pipe(models.scheduler, vae, unet), cond,
                        negative, (channels, size, size), checkpointing, models.resolution)
    return step, step.trained, step.optimizer, vae


BENCHES = ("dpo_lora", "dpo_full", "ddpo_lora", "sdxl_dpo_lora", "sd35m_dpo_lora", "sd35m_grpo_lora", "sd35m_nft_lora",
           "flux_grpo_lora")
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
                        help="pixels for the SDXL / SD3.5 / FLUX benchmarks (default: 1024 for DPO, 512 for Flow-GRPO and "
                             "DiffusionNFT as the authors' recipes; SD v1.5's benchmarks stay at 512)")
    parser.add_argument("--grpo_samples", type=int, default=4, help="Flow-GRPO images sampled and trained per step")
    parser.add_argument("--grpo_inference_steps", type=int, default=10, help="SDE steps per Flow-GRPO sample (authors: 10)")
    parser.add_argument("--nft_samples", type=int, default=4, help="DiffusionNFT images sampled and trained per step")
    parser.add_argument("--nft_inference_steps", type=int, default=10, help="ODE steps per DiffusionNFT sample (authors: 10)")
    parser.add_argument("--quantized_base", choices=CHOICES, default=NONE,
                        help="the LoRA benchmarks' frozen base quantized as --quantize_base loads it (int8, float8: torchao; "
                             "nf4: bitsandbytes, a CUDA GPU); the planner's peak beside the measured one either way")
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
                                           args.resolution, args.quantized_base)
            side = latent_side(arch, args.tiny, args.resolution)
            work = (f"{args.pairs} pairs at {side}x{side} latents (policy fwd+bwd and reference fwd on {2 * args.pairs} "
                    "images, cached latents)")
        elif bench in ("sd35m_grpo_lora", "flux_grpo_lora"):
            arch = ARCHS["sd35m" if bench == "sd35m_grpo_lora" else "flux-dev"]
            recipe = "sd3_grpo" if arch.kind == "sd3" else "flux_grpo"
            step, *held = flow_rl_bench(recipe, arch, accelerator, precision, args.tiny, args.grpo_samples,
                                        args.grpo_inference_steps, checkpointing, args.resolution or 512,
                                        args.quantized_base)
            side = latent_side(arch, args.tiny, args.resolution or 512)
            how = ("with CFG", "policy with CFG, both halves with gradient, + adapter-off reference for the KL") \
                if arch.kind == "sd3" else ("with the guidance embedding", "policy only: no CFG, no KL")
            work = (f"{args.grpo_samples} images x {args.grpo_inference_steps} SDE steps at {side}x{side} latents sampled "
                    f"{how[0]}, decoded, then trained on {max(1, int(args.grpo_inference_steps * 0.99))} steps each "
                    f"({how[1]})")
        elif bench == "sd35m_nft_lora":
            arch = ARCHS["sd35m"]
            step, *held = flow_rl_bench("sd3_nft", arch, accelerator, precision, args.tiny, args.nft_samples,
                                        args.nft_inference_steps, checkpointing, args.resolution or 512,
                                        args.quantized_base)
            side = latent_side(arch, args.tiny, args.resolution or 512)
            work = (f"{args.nft_samples} images x {args.nft_inference_steps} ODE steps at {side}x{side} latents sampled by "
                    f"the old policy (no CFG), decoded, then trained on {max(1, int(args.nft_inference_steps * 0.99))} "
                    "steps each (policy fwd+bwd, old-policy and adapter-off reference fwd at the noised final latents)")
        elif bench in ("dpo_lora", "dpo_full"):
            step, *held = dpo_bench(models, accelerator, bench.split("_")[1], args.pairs, checkpointing, args.lora_rank,
                                    args.quantized_base)
            work = f"{args.pairs} pairs (policy fwd+bwd and reference fwd on {2 * args.pairs} images)"
        elif bench == "ddpo_lora":
            step, *held = ddpo_bench(models, accelerator, precision, args.ddpo_samples, args.ddpo_inference_steps,
                                     checkpointing, args.lora_rank, args.quantized_base)
            work = (f"{args.ddpo_samples} images x {args.ddpo_inference_steps} DDIM steps sampled with CFG, decoded, "
                    "then trained on every step (CFG, both halves with gradient)")
        trained = accelerator.unwrap_model(held[0])
        result = measure(bench, step, steps, warmup, device, peak, work, accelerator, trained, checkpointing)
        result["quantized_base"] = NONE if bench == "dpo_full" else args.quantized_base
        result["planned_memory_gb"] = bench_plan(bench, args, args.tiny, checkpointing, getattr(step, "config", None))
        results.append(result)
        utilisation = f" | MFU {100 * result['mfu']:.1f}% | HFU {100 * result['hfu']:.1f}%" if "mfu" in result else ""
        memory = f" | planned peak {result['planned_memory_gb']:.3g} GiB"
        if "peak_memory_gb" in result:
            memory += (f", measured {result['peak_memory_gb']:.3g} GiB "
                       f"({result['peak_memory_gb'] / result['planned_memory_gb']:.2f}x the plan)")
        print(f"[bench] {bench}{'' if result['quantized_base'] == NONE else ' (' + result['quantized_base'] + ' base)'}: {result['steps_per_s']:.3f} steps/s | GFLOP per step: {result['model_flops_per_step'] / 1e9:,.4g} "
              f"model, {result['hardware_flops_per_step'] / 1e9:,.4g} hardware, {result['flops_per_step'] / 1e9:,.4g} counted "
              f"| {result['model_tflops']:.4g} model TFLOP/s{memory}{utilisation} | step = {work}", flush=True)
        del step, held, trained
        accelerator.free_memory()
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
    print("[bench] model FLOPs (MFU): a trained forward x3 (forward + backward), a forward without gradient x1; hardware "
          f"FLOPs (HFU): {'plus gradient checkpointing recomputing each trained forward' if checkpointing else 'the same (no gradient checkpointing)'}; "
          "counted: what FlopCounterMode saw (a LoRA backward skips the frozen weights' gradients)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "peak_tflops": peak, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
