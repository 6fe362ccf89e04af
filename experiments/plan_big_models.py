"""The memory plan of the 8-GPU full fine-tuning configs and of the one-GPU 24 GB recipes, from the real models'
config values (no download).

    python -m experiments.plan_big_models            # every configs/*_8gpu.yaml
    python -m experiments.plan_big_models --one_gpu  # every configs/*_24gb.yaml: one process, and each quantization choice
    python -m experiments.plan_big_models --check    # only the parameter totals against the published ones

The config.json values of SDXL base 1.0's UNet, SD3.5 Medium's and Large's and FLUX.1-dev's transformers, their text encoders
(CLIP ViT-L/14, OpenCLIP ViT-bigG/14, T5-v1.1-XXL's encoder) and VAEs are written out below; each part is built on
the meta device from them (align/train/memory_model.py), so the counts are those of the real classes. The plan
printed is what `--dry_run` prints for the config on a machine that can read the model's config files; the
configs' headers quote its totals.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import diffusers
import torch
import transformers
from accelerate import init_empty_weights

from align.cli import parse_config
from align.families import family_named
from align.train.ddpo_config import DDPOConfig
from align.train.dpo_config import DPOConfig
from align.train.memory_model import PipelineParts, parameter_count, plan_parts, scheme_quantization
from align.train.memory_plan import GIB, choices_table, ddp_plan, fsdp2_plan, plan_table, total
from align.train.quantization import CHOICES

ROOT = Path(__file__).resolve().parent.parent

SDXL_UNET = {
    "act_fn": "silu", "addition_embed_type": "text_time", "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280],
    "cross_attention_dim": 2048, "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "in_channels": 4, "layers_per_block": 2, "mid_block_type": "UNetMidBlock2DCrossAttn", "norm_num_groups": 32,
    "out_channels": 4, "projection_class_embeddings_input_dim": 2816, "sample_size": 128,
    "transformer_layers_per_block": [1, 2, 10], "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "use_linear_projection": True,
}
SD35_LARGE_TRANSFORMER = {
    "attention_head_dim": 64, "caption_projection_dim": 2432, "in_channels": 16, "joint_attention_dim": 4096,
    "num_attention_heads": 38, "num_layers": 38, "out_channels": 16, "patch_size": 2, "pooled_projection_dim": 2048,
    "pos_embed_max_size": 192, "qk_norm": "rms_norm", "sample_size": 128,
}
SD35_MEDIUM_TRANSFORMER = {
    "attention_head_dim": 64, "caption_projection_dim": 1536, "dual_attention_layers": list(range(13)), "in_channels": 16,
    "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 24, "out_channels": 16, "patch_size": 2,
    "pooled_projection_dim": 2048, "pos_embed_max_size": 384, "qk_norm": "rms_norm", "sample_size": 128,
}
FLUX_DEV_TRANSFORMER = {
    "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56], "guidance_embeds": True, "in_channels": 64,
    "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 19, "num_single_layers": 38,
    "patch_size": 1, "pooled_projection_dim": 768,
}
CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
          "projection_dim": 768, "hidden_act": "quick_gelu", "vocab_size": 49408, "max_position_embeddings": 77}
CLIP_BIG_G = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
              "projection_dim": 1280, "hidden_act": "gelu", "vocab_size": 49408, "max_position_embeddings": 77}
T5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
          "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32}
VAE_4 = {"block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
         "up_block_types": ["UpDecoderBlock2D"] * 4, "latent_channels": 4, "layers_per_block": 2, "sample_size": 1024}
VAE_16 = {**VAE_4, "latent_channels": 16, "use_quant_conv": False, "use_post_quant_conv": False}

# Published totals (model cards and papers), the check on the configs above.
PUBLISHED = {"sdxl": 2.57e9, "sd3": 8.1e9, "flux": 11.9e9}


def build(library: str, class_name: str, config: dict) -> torch.nn.Module:
    with init_empty_weights(include_buffers=True):
        if library == "diffusers":
            return getattr(diffusers, class_name).from_config(config)
        cls = getattr(transformers, class_name)
        return cls(cls.config_class(**config))


def sdxl_parts() -> PipelineParts:
    others = [build("transformers", "CLIPTextModel", CLIP_L), build("transformers", "CLIPTextModelWithProjection", CLIP_BIG_G),
              build("diffusers", "AutoencoderKL", VAE_4)]
    family = family_named("StableDiffusionXLPipeline")
    return PipelineParts(family, build("diffusers", "UNet2DConditionModel", SDXL_UNET), VAE_4, others, family.text_tokens())


def sd35_large_parts() -> PipelineParts:
    others = [build("transformers", "CLIPTextModelWithProjection", CLIP_L),
              build("transformers", "CLIPTextModelWithProjection", CLIP_BIG_G),
              build("transformers", "T5EncoderModel", T5_XXL), build("diffusers", "AutoencoderKL", VAE_16)]
    family = family_named("StableDiffusion3Pipeline")
    return PipelineParts(family, build("diffusers", "SD3Transformer2DModel", SD35_LARGE_TRANSFORMER), VAE_16, others,
                         family.text_tokens())


def sd35_medium_parts() -> PipelineParts:
    large = sd35_large_parts()
    return PipelineParts(large.family, build("diffusers", "SD3Transformer2DModel", SD35_MEDIUM_TRANSFORMER), VAE_16,
                         large.others, large.text_tokens)


def flux_dev_parts() -> PipelineParts:
    others = [build("transformers", "CLIPTextModel", CLIP_L), build("transformers", "T5EncoderModel", T5_XXL),
              build("diffusers", "AutoencoderKL", VAE_16)]
    family = family_named("FluxPipeline")
    return PipelineParts(family, build("diffusers", "FluxTransformer2DModel", FLUX_DEV_TRANSFORMER), VAE_16, others,
                         family.text_tokens())


CONFIGS = {
    "sdxl_dpo_full_8gpu.yaml": (DPOConfig, sdxl_parts),
    "sd35_large_nft_full_8gpu.yaml": (DDPOConfig, sd35_large_parts),
    "flux_nft_full_8gpu.yaml": (DDPOConfig, flux_dev_parts),
}


# The 24 GB recipes (a quantized frozen base, offloaded encoders): one process each.
ONE_GPU_CONFIGS = {
    "sdxl_dpo_lora_24gb.yaml": (DPOConfig, sdxl_parts),
    "sdxl_ddpo_lora_24gb.yaml": (DDPOConfig, sdxl_parts),
    "sd35m_dpo_lora_24gb.yaml": (DPOConfig, sd35_medium_parts),
    "sd35m_grpo_lora_24gb.yaml": (DDPOConfig, sd35_medium_parts),
    "sd35m_nft_lora_24gb.yaml": (DDPOConfig, sd35_medium_parts),
    "flux_dpo_lora_24gb.yaml": (DPOConfig, flux_dev_parts),
    "flux_grpo_lora_24gb.yaml": (DDPOConfig, flux_dev_parts),
    "flux_nft_lora_24gb.yaml": (DDPOConfig, flux_dev_parts),
}


def plan_config(name: str):
    """The planned run of ``configs/<name>`` (an 8-GPU or a 24 GB config) from the real config values."""
    config_class, parts = {**CONFIGS, **ONE_GPU_CONFIGS}[name]
    return plan_parts(parts(), parse_config(config_class, ["--config", str(ROOT / "configs" / name)]))


def one_gpu_total(name: str) -> float:
    """The planned GiB of the one process of a 24 GB config (what its header quotes)."""
    return total(ddp_plan(plan_config(name).shape, 1)) / GIB


def check_totals() -> None:
    # SD3.5 Medium is left out: its model card's "2.5 billion parameters" is not its transformer's count (2,243,171,520
    # from the config above, as diffusers builds it)
    for parts in (sdxl_parts(), sd35_large_parts(), flux_dev_parts()):
        count = parameter_count(parts.denoiser)
        published = PUBLISHED[parts.family.name]
        print(f"{parts.family.name}: denoiser {count:,} parameters (published ~{published / 1e9:.2f} B; "
              f"{count / published - 1:+.1%}); text encoders + VAE {sum(parameter_count(m) for m in parts.others):,}")
        if abs(count / published - 1) > 0.02:
            sys.exit(f"{parts.family.name}: {count:,} parameters is not the published ~{published:,.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the parameter totals")
    parser.add_argument("--one_gpu", action="store_true", help="the 24 GB recipes instead of the 8-GPU configs")
    args = parser.parse_args(argv)
    check_totals()
    if args.check:
        return
    if args.one_gpu:
        for name in ONE_GPU_CONFIGS:
            planned = plan_config(name)
            print(f"\nconfigs/{name}: {planned.summary}")
            print(plan_table(planned.shape, [1], sharded=False))
            print(f"one process: {total(ddp_plan(planned.shape, 1)) / GIB:.1f} GiB; by --quantize_base (and "
                  "--quantize_text_encoders) and --offload, the rest as configured:")
            print(choices_table(planned.shape, {scheme: scheme_quantization(scheme) for scheme in CHOICES}))
        return
    for name in CONFIGS:
        planned = plan_config(name)
        print(f"\nconfigs/{name}: {planned.summary}")
        print(plan_table(planned.shape, [1, 2, 4, 8]))
        print(f"per process at 8 processes: DDP {total(ddp_plan(planned.shape, 8)) / GIB:.1f} GiB, "
              f"FSDP2 {total(fsdp2_plan(planned.shape, 8)) / GIB:.1f} GiB")


if __name__ == "__main__":
    main()
