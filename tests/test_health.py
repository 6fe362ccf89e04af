"""Health checks (align/health.py): NaN/inf in a loss, in trainable weights or in generated images stops
training with the last good checkpoint kept; evaluations mark degenerate images instead of scoring them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_ddpo_train import small_config as ddpo_config
from test_dpo import pair_parquet, prompt_file, small_config  # noqa: F401  (fixtures)

import align.train.heldout
from align.cli import ConfigError
from align.eval import evaluate as ev
from align.pipeline import save_full_unet
from align.testbed.models import build_pipeline
from align.testbed.tokenizer import testbed_tokenizer
from align.train import ddpo, dpo, dpo_feedback, online_rollouts
from align.train.command import TrainingStopped


class _NanGradient(torch.autograd.Function):
    """Identity forward (a finite loss), NaN backward: the next optimiser step writes NaN weights."""
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def test_dpo_stops_on_nan_weights_after_a_step_and_keeps_the_last_good_checkpoint(tiny_model, pair_parquet, tmp_path, monkeypatch):  # noqa: F811
    real = dpo.diffusion_dpo_loss
    calls = {"n": 0}

    def poisoned_gradient(*args, **kwargs):
        calls["n"] += 1
        loss, metrics = real(*args, **kwargs)
        return (_NanGradient.apply(loss) if calls["n"] == 3 else loss), metrics

    monkeypatch.setattr(dpo, "diffusion_dpo_loss", poisoned_gradient)
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match="non-finite trainable weights after step 2") as stopped:
        dpo.train(small_config(tiny_model, out, dataset=pair_parquet, max_grad_norm=0.0))
    assert "step_0000002" in str(stopped.value)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_0000002"]  # the NaN weights were never saved
    assert not (out / "final").exists()
    resumed_from = json.loads((out / "checkpoints" / "step_0000002" / "state.json").read_text())["step"]
    assert resumed_from == 2


def test_ddpo_stops_on_nan_images_like_a_failed_reward(tiny_model, prompt_file, tmp_path, monkeypatch):  # noqa: F811

    real = online_rollouts.decode_latents
    calls = {"n": 0}

    def nan_in_epoch_two(pipe, latents):
        calls["n"] += 1
        images = real(pipe, latents)
        return images * float("nan") if calls["n"] > 2 else images  # two sampling batches per epoch

    monkeypatch.setattr(online_rollouts, "decode_latents", nan_in_epoch_two)
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match="non-finite generated images at epoch 1") as stopped:
        ddpo.train(ddpo_config(tiny_model, prompt_file, out))
    assert "step_0000001" in str(stopped.value) and "--resume latest" in str(stopped.value)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_0000001"]
    assert not (out / "final").exists()


def test_dpo_before_and_after_evaluation_mark_blank_images_instead_of_scoring_them(tiny_model, pair_parquet, prompt_file, tmp_path, monkeypatch):  # noqa: F811

    def black_images(pipe, prompts, seeds, **kwargs):  # what a LoRA full of NaNs gives once clamped and quantised
        return torch.zeros(len(prompts), 3, 16, 16)

    monkeypatch.setattr(align.train.heldout, "generate_images", black_images)
    run = dpo.train(small_config(tiny_model, tmp_path / "run", dataset=pair_parquet, max_steps=2,
                                 eval_prompts=prompt_file, eval_judge="jpeg-compressibility"))
    for name in ("eval_before.json", "eval_after.json"):
        result = json.loads((run / name).read_text())
        assert result["mean"] is None and result["scores"] is None
        assert "3 of 3 images are blank" in result["degenerate"]
    assert "DEGENERATE: the after model" in (run / "report.html").read_text()
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file()  # the run itself finishes


@pytest.fixture(scope="module")
def three_models(tmp_path_factory):
    """A random testbed-architecture base, a perturbed UNet and a diverged one (NaN in a weight)."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    pipe = build_pipeline(testbed_tokenizer())
    pipe.save_pretrained(root / "base")
    with torch.no_grad():
        pipe.unet.conv_out.bias.add_(0.5)
    save_full_unet(pipe.unet, root / "tuned")
    with torch.no_grad():
        pipe.unet.conv_out.bias.fill_(float("nan"))
    save_full_unet(pipe.unet, root / "diverged")
    return root / "base", root / "tuned", root / "diverged"


def _eval_config(tmp_path, models: str, **kw) -> ev.EvalConfig:
    return ev.EvalConfig(models=models, **kw, judges="jpeg-compressibility", prompts="testbed", num_prompts=2, seeds="0",
                         num_inference_steps=2, guidance_scale=3.0, batch_size=4, device="cpu",
                         output_dir=str(tmp_path / "eval"))


def test_evaluation_leaves_a_diverged_model_out_of_the_ranking_and_says_why(tmp_path, three_models, capsys):
    base, tuned, diverged = three_models
    results = ev.evaluate(_eval_config(tmp_path, f"base={base},tuned={tuned},diverged={diverged}"))
    assert [row["model"] for row in results["table"]] == ["base", "tuned"]
    flags = {m["name"]: m["degenerate"] for m in results["models"]}
    assert flags["base"] is None and flags["tuned"] is None and "images are blank" in flags["diverged"]
    assert "diverged" not in results["judges"]["jpeg-compressibility"]["per_model"]
    saved = json.loads((Path(tmp_path) / "eval" / "results.json").read_text())
    assert saved["models"][2]["degenerate"] == flags["diverged"]
    report = (Path(tmp_path) / "eval" / "report.html").read_text()
    assert "Not ranked, DEGENERATE images" in report and "diverged:" in report
    assert "diverged: DEGENERATE images" in capsys.readouterr().out


def test_evaluation_refuses_a_diverged_base_in_one_line(tmp_path, three_models):
    base, tuned, diverged = three_models
    with pytest.raises(ConfigError, match="the base model 'diverged' gives degenerate images"):
        ev.evaluate(_eval_config(tmp_path, f"diverged={diverged},tuned={tuned}", base_model=str(base)))


def test_dpo_stops_before_judging_degenerate_feedback_images(tiny_model, prompt_file, tmp_path, monkeypatch):  # noqa: F811

    def black_generator(pipe, **kwargs):  # a base model full of NaNs draws black images once they are PIL images
        return lambda prompts, seeds: [Image.new("RGB", (16, 16)) for _ in prompts]

    monkeypatch.setattr(dpo_feedback, "make_pipeline_generator", black_generator)
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match=r"degenerate images while labelling feedback \(6 of 6 images are blank"):
        dpo.train(small_config(tiny_model, out, reward="jpeg-compressibility", prompts=prompt_file))
    assert not (out / "feedback" / "pairs.parquet").exists() and not (out / "checkpoints").exists()
