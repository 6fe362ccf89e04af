"""`--dry_run` of the 2026 families' configs from the real models' config files (no weights, no download).

    python -m experiments.plan_2026_models                 # every config below: the trainers' own --dry_run output
    python -m experiments.plan_2026_models --check         # only the parameter totals against the published ones
    python -m experiments.plan_2026_models --write DIR     # write the config-only pipeline folders to DIR and stop

The config.json values of Qwen-Image's, FLUX.2 [dev]'s, FLUX.2 [klein] 4B's and Z-Image-Turbo's transformers, their
text encoders (Qwen2.5-VL-7B-Instruct, Mistral-Small-3.1-24B-Instruct-2503, Qwen3-4B, and Qwen-Image 2.1's
Qwen3-VL-8B-Instruct) and VAEs are written out below
(FLUX.1 Kontext [dev] is FLUX.1 [dev]'s configs, from experiments/plan_big_models.py; Qwen-Image-Edit is Qwen-Image's
configs plus the processor that hands the source image to the text encoder)
(where diffusers' class defaults are the released model's config, the class is built with its defaults). Each model
becomes a pipeline folder of config files only (model_index.json and each component's config), and the trainer's own
`--dry_run` reads it as it would read the downloaded model's folder: the counts are those of the real classes. The
configs' headers quote the totals printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import diffusers
import pyarrow as pa
import pyarrow.parquet as pq
import transformers
from accelerate import init_empty_weights

from align.testbed.edit_world import sample_edit_prompts, target_scene_image
from align.train import ddpo, dpo
from align.train.memory_model import parameter_count
from experiments.plan_big_models import CLIP_L, FLUX_DEV_TRANSFORMER, T5_XXL
from rewards.images import encode_png

ROOT = Path(__file__).resolve().parent.parent

QWEN25_VL_7B = {
    "model_type": "qwen2_5_vl", "vocab_size": 152064, "hidden_size": 3584, "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen2_5_vl_text", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "rope_theta": 1000000.0,
                    "max_position_embeddings": 128000, "tie_word_embeddings": False,
                    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24], "rope_type": "default"}},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 3584,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "in_chans": 3},
}
MISTRAL_SMALL_31 = {
    "model_type": "mistral3", "image_token_index": 10, "spatial_merge_size": 2, "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu", "vision_feature_layer": -1,
    "text_config": {"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 32768, "num_hidden_layers": 40,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072,
                    "rope_theta": 1000000000.0, "max_position_embeddings": 131072, "sliding_window": None},
    "vision_config": {"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "head_dim": 64, "patch_size": 14, "image_size": 1540, "num_channels": 3},
}
QWEN3_VL_8B = {  # Qwen3-VL-8B-Instruct: 8,767,123,696 parameters built (its card: 8.77 B)
    "model_type": "qwen3_vl", "tie_word_embeddings": False,
    "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                    "rope_theta": 5000000, "max_position_embeddings": 262144},
    "vision_config": {"model_type": "qwen3_vl", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                      "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "deepstack_visual_indexes": [8, 16, 24]},
}
QWEN3_4B = {"model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": True, "max_position_embeddings": 40960, "rope_theta": 1000000}
FLUX2_KLEIN_4B = {"in_channels": 128, "num_layers": 5, "num_single_layers": 20, "attention_head_dim": 128,
                  "num_attention_heads": 24, "joint_attention_dim": 7680, "guidance_embeds": False}
VAE_FLUX1 = {"block_out_channels": [128, 256, 512, 512], "down_block_types": ["DownEncoderBlock2D"] * 4,
             "up_block_types": ["UpDecoderBlock2D"] * 4, "latent_channels": 16, "layers_per_block": 2, "sample_size": 1024,
             "use_quant_conv": False, "use_post_quant_conv": False, "shift_factor": 0.1159, "scaling_factor": 0.3611}
FLOW_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True}

# model -> (pipeline class, {component: (library, class, config)}); {} builds the class with its defaults
MODELS = {
    "qwen-image": ("QwenImagePipeline", {
        "transformer": ("diffusers", "QwenImageTransformer2DModel", {}),
        "vae": ("diffusers", "AutoencoderKLQwenImage", {}),
        "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B)}),
    "qwen-image-2.1": ("QwenImage21Pipeline", {  # diffusers' class defaults are the 7 B transformer and its VAE
        "transformer": ("diffusers", "QwenImage21Transformer2DModel", {}),
        "vae": ("diffusers", "AutoencoderKLQwenImage21", {}),
        "text_encoder": ("transformers", "Qwen3VLForConditionalGeneration", QWEN3_VL_8B)}),
    "qwen-image-edit": ("QwenImageEditPipeline", {  # Qwen-Image's transformer, text encoder and VAE, and a processor
        "transformer": ("diffusers", "QwenImageTransformer2DModel", {}),
        "vae": ("diffusers", "AutoencoderKLQwenImage", {}),
        "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration", QWEN25_VL_7B)}),
    "flux2-dev": ("Flux2Pipeline", {
        "transformer": ("diffusers", "Flux2Transformer2DModel", {}),
        "vae": ("diffusers", "AutoencoderKLFlux2", {}),
        "text_encoder": ("transformers", "Mistral3ForConditionalGeneration", MISTRAL_SMALL_31)}),
    "flux2-klein-4b": ("Flux2KleinPipeline", {
        "transformer": ("diffusers", "Flux2Transformer2DModel", FLUX2_KLEIN_4B),
        "vae": ("diffusers", "AutoencoderKLFlux2", {}),
        "text_encoder": ("transformers", "Qwen3ForCausalLM", QWEN3_4B)}),
    "flux1-kontext-dev": ("FluxKontextPipeline", {  # FLUX.1 [dev]'s transformer, text encoders and VAE
        "transformer": ("diffusers", "FluxTransformer2DModel", FLUX_DEV_TRANSFORMER),
        "vae": ("diffusers", "AutoencoderKL", VAE_FLUX1),
        "text_encoder": ("transformers", "CLIPTextModel", CLIP_L),
        "text_encoder_2": ("transformers", "T5EncoderModel", T5_XXL)}),
    "z-image-turbo": ("ZImagePipeline", {
        "transformer": ("diffusers", "ZImageTransformer2DModel", {}),
        "vae": ("diffusers", "AutoencoderKL", VAE_FLUX1),
        "text_encoder": ("transformers", "Qwen3Model", QWEN3_4B)}),
}
# Published sizes of the trained transformers (model cards; Qwen-Image 2.x's "7 billion" from third-party pages, no
# card of 2.1 being readable here): the check on the values above.
PUBLISHED = {"qwen-image": 20e9, "qwen-image-2.1": 7e9, "qwen-image-edit": 20e9, "flux2-dev": 32e9, "flux2-klein-4b": 4e9, "z-image-turbo": 6e9, "flux1-kontext-dev": 12e9}
# config file -> (trainer, model folder)
CONFIGS = {
    "qwenimage_grpo_lora_1gpu.yaml": (ddpo, "qwen-image"),
    "qwenimage_nft_full_8gpu.yaml": (ddpo, "qwen-image"),
    "qwenimage21_grpo_lora_1gpu.yaml": (ddpo, "qwen-image-2.1"),
    "qwenimage21_grpo_lora_24gb.yaml": (ddpo, "qwen-image-2.1"),
    "flux2_klein_grpo_lora_1gpu.yaml": (ddpo, "flux2-klein-4b"),
    "flux2_dev_grpo_lora_1gpu.yaml": (ddpo, "flux2-dev"),
    "zimage_grpo_lora_1gpu.yaml": (ddpo, "z-image-turbo"),
    "kontext_dpo_lora_1gpu.yaml": (dpo, "flux1-kontext-dev"),
    "qwen_image_edit_dpo_lora_1gpu.yaml": (dpo, "qwen-image-edit"),
}


def build(library: str, class_name: str, config: dict):
    with init_empty_weights(include_buffers=True):
        if library == "diffusers":
            return getattr(diffusers, class_name).from_config(config)
        cls = getattr(transformers, class_name)
        return cls(cls.config_class(**config))


def write_config_folder(name: str, out: Path) -> Path:
    """A pipeline folder of ``name``'s config files only: model_index.json and each component's config."""
    pipeline_class, parts = MODELS[name]
    folder = out / name
    index = {"_class_name": pipeline_class, "_diffusers_version": diffusers.__version__,
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "tokenizer": ["transformers", "Qwen2Tokenizer"]}
    for part, (library, class_name, config) in parts.items():
        module = build(library, class_name, config)
        (folder / part).mkdir(parents=True, exist_ok=True)
        if library == "diffusers":
            module.save_config(folder / part)
        else:
            module.config.save_pretrained(folder / part)
        index[part] = [library, class_name]
        if part == "text_encoder_2":  # FLUX's T5 comes with its own tokenizer
            (folder / "tokenizer_2").mkdir(exist_ok=True)
            index["tokenizer_2"] = ["transformers", "T5TokenizerFast"]
    (folder / "scheduler").mkdir(exist_ok=True)
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", **FLOW_SCHEDULER}))
    (folder / "tokenizer").mkdir(exist_ok=True)
    if pipeline_class == "QwenImageEditPipeline":  # the processor that hands the source image to the text encoder
        (folder / "processor").mkdir(exist_ok=True)
        index["processor"] = ["transformers", "Qwen2VLProcessor"]
    if pipeline_class == "QwenImage21Pipeline":  # its prompts go through a Qwen3-VL processor
        (folder / "processor").mkdir(exist_ok=True)
        index["processor"] = ["transformers", "Qwen3VLProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index, indent=1))
    return folder


def one_pair_file(folder: Path) -> str:
    """A one-pair Pick-a-Pic parquet (a DPO dry run checks its --dataset before planning)."""
    prompt = sample_edit_prompts(1, 0)[0]
    image = encode_png(target_scene_image(prompt))
    path = folder / "one_pair.parquet"
    pq.write_table(pa.Table.from_pylist([{"caption": prompt, "jpg_0": image, "jpg_1": image, "label_0": 1.0,
                                          "label_1": 0.0}]), path)
    return str(path)


def check_totals() -> None:
    for name, (_, parts) in MODELS.items():
        count = parameter_count(build(*parts["transformer"]))
        others = sum(parameter_count(build(*spec)) for p, spec in parts.items() if p != "transformer")
        print(f"{name}: transformer {count:,} parameters (published ~{PUBLISHED[name] / 1e9:.0f} B; "
              f"{count / PUBLISHED[name] - 1:+.1%}); text encoder + VAE {others:,}")
        if abs(count / PUBLISHED[name] - 1) > 0.05:
            sys.exit(f"{name}: {count:,} parameters is not the published ~{PUBLISHED[name]:,.0f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the parameter totals")
    parser.add_argument("--write", help="write the config-only pipeline folders here and stop")
    args = parser.parse_args(argv)
    check_totals()
    if args.check:
        return
    if args.write:
        for name in MODELS:
            print(write_config_folder(name, Path(args.write)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        for config_name, (trainer, name) in CONFIGS.items():
            folder = write_config_folder(name, Path(tmp))
            print(f"\nconfigs/{config_name} (--model: {name}'s config files)", flush=True)
            # the prompts / pairs do not change the plan; the configs' own (hpsv2, EditReward-Data) would be downloaded
            data = ["--prompts", "testbed:8:0"] if trainer is ddpo else ["--dataset", one_pair_file(Path(tmp))]
            trainer.main(["--config", str(ROOT / "configs" / config_name), "--model", str(folder), "--dry_run", "true",
                          *data, "--output_dir", str(Path(tmp) / "run")])


if __name__ == "__main__":
    main()
