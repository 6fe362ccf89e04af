"""Every YAML in configs/ parses into the config class of the command its header names, and validates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from script_loader import load_script

from align.cli import parse_config
from align.eval.evaluate import EvalConfig
from align.judgebench.benchmark import JudgeBenchConfig
from align.train import ddpo, dpo
from align.train.ddpo import DDPOConfig
from align.train.dpo import DPOConfig
from align.train.reward_model import RewardTrainConfig
from experiments.plan_2026_models import one_pair_file, write_config_folder

ROOT = Path(__file__).resolve().parent.parent
CompareConfig = load_script("compare_judges").CompareConfig

CONFIG_CLASSES = {
    "dpo_sd15.yaml": DPOConfig,
    "dpo_sd15_lora_1gpu.yaml": DPOConfig,
    "dpo_sd15_full_1gpu.yaml": DPOConfig,
    "ddpo_sd15_lora_1gpu.yaml": DDPOConfig,
    "sdxl_dpo_lora_1gpu.yaml": DPOConfig,
    "sd35_grpo_lora_1gpu.yaml": DDPOConfig,
    "flux_grpo_lora_1gpu.yaml": DDPOConfig,
    "flux_dancegrpo_lora_1gpu.yaml": DDPOConfig,
    "sd35_dancegrpo_lora_1gpu.yaml": DDPOConfig,
    "sd35_grpo_guard_lora_1gpu.yaml": DDPOConfig,
    "flux_grpo_guard_lora_1gpu.yaml": DDPOConfig,
    "testbed_flow_grpo_guard.yaml": DDPOConfig,
    "testbed_flow_dancegrpo.yaml": DDPOConfig,
    "testbed_flow_mixgrpo.yaml": DDPOConfig,
    "testbed_flow_dgpo.yaml": DDPOConfig,
    "testbed_dgpo.yaml": DDPOConfig,
    "testbed_flow_gdpo.yaml": DDPOConfig,
    "testbed_gdpo.yaml": DDPOConfig,
    "sd35_mixgrpo_lora_1gpu.yaml": DDPOConfig,
    "flux_mixgrpo_lora_1gpu.yaml": DDPOConfig,
    "sd35_dgpo_lora_1gpu.yaml": DDPOConfig,
    "flux_dgpo_lora_1gpu.yaml": DDPOConfig,
    "testbed_dpo.yaml": DPOConfig,
    "testbed_flow_dpo.yaml": DPOConfig,
    "ddpo_sd15.yaml": DDPOConfig,
    "testbed_ddpo.yaml": DDPOConfig,
    "testbed_flow_grpo.yaml": DDPOConfig,
    "testbed_flow_nft.yaml": DDPOConfig,
    "testbed_flow_awm.yaml": DDPOConfig,
    "testbed_nft.yaml": DDPOConfig,
    "testbed_awm.yaml": DDPOConfig,
    "testbed_draft.yaml": DDPOConfig,
    "testbed_draft_lv.yaml": DDPOConfig,
    "testbed_alignprop.yaml": DDPOConfig,
    "testbed_refl.yaml": DDPOConfig,
    "alignprop_sd15_hps_lora_1gpu.yaml": DDPOConfig,
    "draft_sd15_pickscore_lora_1gpu.yaml": DDPOConfig,
    "refl_sdxl_hps_lora_1gpu.yaml": DDPOConfig,
    "draft_lv_flux_hps_lora_1gpu.yaml": DDPOConfig,
    "sd35_nft_lora_1gpu.yaml": DDPOConfig,
    "nft_sd15_lora_1gpu.yaml": DDPOConfig,
    "sdxl_dpo_full_8gpu.yaml": DPOConfig,
    "sd35_large_nft_full_8gpu.yaml": DDPOConfig,
    "flux_nft_full_8gpu.yaml": DDPOConfig,
    "qwenimage_grpo_lora_1gpu.yaml": DDPOConfig,
    "qwenimage_nft_full_8gpu.yaml": DDPOConfig,
    "qwenimage21_grpo_lora_1gpu.yaml": DDPOConfig,
    "qwenimage21_grpo_lora_24gb.yaml": DDPOConfig,
    "flux2_klein_grpo_lora_1gpu.yaml": DDPOConfig,
    "flux2_dev_grpo_lora_1gpu.yaml": DDPOConfig,
    "zimage_grpo_lora_1gpu.yaml": DDPOConfig,
    "kontext_dpo_lora_1gpu.yaml": DPOConfig,
    "qwen_image_edit_dpo_lora_1gpu.yaml": DPOConfig,
    "qwen_image_edit_plus_dpo_lora_1gpu.yaml": DPOConfig,
    "testbed_edit_dpo.yaml": DPOConfig,
    "testbed_edit_nft.yaml": DDPOConfig,
    "testbed_edit_dgpo.yaml": DDPOConfig,
    "sdxl_dpo_lora_24gb.yaml": DPOConfig,
    "sdxl_ddpo_lora_24gb.yaml": DDPOConfig,
    "sd35m_dpo_lora_24gb.yaml": DPOConfig,
    "sd35m_grpo_lora_24gb.yaml": DDPOConfig,
    "sd35m_nft_lora_24gb.yaml": DDPOConfig,
    "flux_dpo_lora_24gb.yaml": DPOConfig,
    "flux_grpo_lora_24gb.yaml": DDPOConfig,
    "flux_nft_lora_24gb.yaml": DDPOConfig,
    "testbed_eval.yaml": EvalConfig,
    "testbed_judgebench.yaml": JudgeBenchConfig,
    "testbed_reward.yaml": RewardTrainConfig,
    "testbed_compare.yaml": CompareConfig,
}


def test_every_shipped_config_is_listed():
    assert sorted(p.name for p in (ROOT / "configs").glob("*.yaml")) == sorted(CONFIG_CLASSES)


@pytest.mark.parametrize("name", sorted(CONFIG_CLASSES))
def test_shipped_config_parses_and_validates(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # configs name other configs relative to the repository root
    config = parse_config(CONFIG_CLASSES[name], ["--config", f"configs/{name}"])
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_accelerate_configs_load_and_use_only_supported_modes(path):
    config = load_config_from_file(str(path))
    assert config.mixed_precision == "bf16"
    kind = str(getattr(config.distributed_type, "value", config.distributed_type))
    assert kind in ("NO", "MULTI_GPU", "FSDP")  # no DeepSpeed
    if kind == "FSDP":  # FSDP2, activation checkpointing by the trainers' flag (align/train/sharding.py)
        assert str(config.fsdp_config["fsdp_version"]) == "2"
        assert not config.fsdp_config.get("fsdp_activation_checkpointing", False)


def test_one_gpu_recipes_name_an_accelerate_config_that_exists():
    for recipe in (ROOT / "configs").glob("*_1gpu.yaml"):
        named = [w for w in recipe.read_text().split() if w.startswith("configs/accelerate/")]
        assert named and all((ROOT / w).is_file() for w in named), recipe.name


def test_dry_run_of_the_qwen_image_edit_plus_recipe_from_the_real_config_files(tmp_path, capsys):
    """configs/qwen_image_edit_plus_dpo_lora_1gpu.yaml's --dry_run (seconds: meta-device parts) on Qwen-Image-Edit's
    config files (experiments/plan_2026_models.py) with model_index.json naming QwenImageEditPlusPipeline (2509 and 2511
    keep Qwen-Image's transformer, text encoder and VAE): the plan its header quotes. (The other 2026 recipes' dry runs:
    tests/test_memory_plan_2026.py.)"""
    folder = write_config_folder("qwen-image-edit", tmp_path)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "QwenImageEditPlusPipeline"}))
    dpo.main(["--config", str(ROOT / "configs" / "qwen_image_edit_plus_dpo_lora_1gpu.yaml"), "--model", str(folder),
              "--dry_run", "true", "--dataset", one_pair_file(tmp_path), "--output_dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "qwenimage-edit-plus (20,430,401,088 denoiser parameters" in out
    assert "56.2 GiB" in (ROOT / "configs" / "qwen_image_edit_plus_dpo_lora_1gpu.yaml").read_text()
    total = next(line for line in out.splitlines() if line.startswith("total"))
    assert float(total.split()[1]) == pytest.approx(56.2, abs=0.05)


@pytest.mark.parametrize("recipe, planned", [("qwenimage21_grpo_lora_1gpu.yaml", 32.7), ("qwenimage21_grpo_lora_24gb.yaml", 18.5)])
def test_dry_run_of_the_qwen_image_21_recipes_from_the_real_config_files(recipe, planned, tmp_path, capsys):
    """The Qwen-Image 2.1 recipes' --dry_run on its config files (experiments/plan_2026_models.py): the plan each
    header quotes."""
    folder = write_config_folder("qwen-image-2.1", tmp_path)
    ddpo.main(["--config", str(ROOT / "configs" / recipe), "--model", str(folder), "--dry_run", "true", "--prompts",
               "testbed:8:0", "--output_dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "qwenimage21 (7,115,124,736 denoiser parameters" in out
    assert f"one process: {planned} GiB" in (ROOT / "configs" / recipe).read_text()
    total = next(line for line in out.splitlines() if line.startswith("total"))
    assert float(total.split()[1]) == pytest.approx(planned, abs=0.05)
