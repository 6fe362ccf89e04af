"""align/ddpo.py on every model family: DDPO on tiny SDXL (DDIM), Flow-GRPO and Flow-GRPO-Fast on tiny SD3
and FLUX; each final LoRA loads with its family's diffusers pipeline and changes what it generates; the
flow path's rounds start exactly on-policy (fp32 and bf16) and resume exactly."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from diffusers import DiffusionPipeline, SD3Transformer2DModel
from safetensors.torch import load_file
from script_loader import load_experiment

from align.families import family_of_pipeline
from align.families.base import guided_prediction
from align.pipeline import add_lora, load_pipeline
from align.sampling.flow import draw_window
from align.sampling.flow_sde_sampler import FlowSampler
from align.train import ddpo, heldout
from align.train.ddpo_config import DDPOConfig
from align.train.policy_models import PolicyModels


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red circle\na blue square\n")
    return str(path)


def config(model, prompt_file, out, **overrides) -> DDPOConfig:
    # One optimiser step per epoch: every logged PPO statistic is that of the round's first minibatch.
    settings = dict(model=model, reward="jpeg-compressibility", prompts=prompt_file, output_dir=str(out), report_to="none",
                    num_inference_steps=4, resolution=32, samples_per_epoch=4, sample_batch_size=4, images_per_prompt=2,
                    advantage="group", train_batch_size=4, gradient_accumulation_steps=1, timestep_fraction=0.5,
                    num_epochs=2, checkpointing_epochs=1, learning_rate=3e-2, clip_range=0.2, guidance_scale=3.0)
    return DDPOConfig(**{**settings, **overrides})


def epochs(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def diffusers_images(model: str, lora: Path | None) -> torch.Tensor:
    """32 px images from the family's own diffusers pipeline (``pipe.load_lora_weights`` for the LoRA)."""
    index = json.loads((Path(model) / "model_index.json").read_text())
    absent = {name: None for name, entry in index.items() if entry in (None, [None, None])}  # SD3 without T5
    pipe = DiffusionPipeline.from_pretrained(model, **absent)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    extra = {"max_sequence_length": 8} if "transformer" in pipe.components else {}  # the tiny flow models' T5 length
    generator = torch.Generator().manual_seed(0)
    return pipe(["a red circle"], num_inference_steps=3, guidance_scale=3.0, height=32, width=32, generator=generator,
                output_type="pt", **extra).images


@pytest.mark.parametrize("kind, overrides", [
    ("sdxl", dict(kl_coef=0.1)),  # DDPO on the DDIM sampler with SDXL's conditioning
    ("sd3", dict(kl_coef=0.1)),  # Flow-GRPO: every step stochastic, half of them trained
    ("flux", dict(deterministic_tail=True)),  # Flow-GRPO-Fast: a window of 2 of 4 steps, drawn per batch
])
def test_lora_run_on_each_family_loads_in_diffusers_and_changes_its_images(family_models, prompt_file, tmp_path, kind, overrides):
    model = family_models(kind)
    run = ddpo.train(config(model, prompt_file, tmp_path / kind, **overrides))
    records = epochs(run)
    assert len(records) == 2
    first = records[0]
    assert first["approx_kl"] == 0.0 and first["clipfrac"] == 0.0  # sampled and re-scored steps agree exactly
    if "kl_coef" in overrides:
        assert first["kl_to_reference"] == 0.0 and records[1]["kl_to_reference"] > 0  # the LoRA moved off the reference
    lora = run / "final"
    assert (lora / "pytorch_lora_weights.safetensors").is_file()
    base, tuned = diffusers_images(model, None), diffusers_images(model, lora)
    assert base.shape == tuned.shape and (base - tuned).abs().max() > 1e-4


def test_flow_defaults_follow_flow_grpo_and_ddim_ones_the_ddpo_paper(family_models, prompt_file, tmp_path, monkeypatch):
    steps = []
    real = heldout.evaluate_model
    monkeypatch.setattr(heldout, "evaluate_model", lambda pipe, judge, cfg, n, *a: steps.append(n) or real(pipe, judge, cfg, n, *a))
    cfg = config(family_models("sd3"), prompt_file, tmp_path / "run", num_inference_steps=None, num_epochs=1,
                 eval_prompts=prompt_file, eval_inference_steps=3)
    run = ddpo.train(cfg)
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert (recorded["num_inference_steps"], recorded["eta"], recorded["eval_inference_steps"]) == (10, 0.7, 3)
    assert steps == [3, 3]  # --eval_inference_steps drives the before/after evaluation sampler
    for is_flow, expected in ((True, (10, 40, 0.7)), (False, (50, 50, 1.0))):
        fresh = DDPOConfig(prompts="x")
        fresh.resolve_for_family(is_flow)
        assert (fresh.num_inference_steps, fresh.eval_inference_steps, fresh.eta) == expected


def test_fast_window_sits_at_the_start_or_is_drawn_per_batch_in_the_first_half():
    sigmas = torch.linspace(1, 0, 11)
    assert FlowSampler(sigmas, 0.7, window=2, window_at="start").draw_window(torch.Generator().manual_seed(0)) == (0, 2)
    fast = FlowSampler(sigmas, 0.7, window=2, window_at="random")
    windows = {fast.draw_window(torch.Generator().manual_seed(s)) for s in range(40)}
    assert all(end - start == 2 and 0 <= start and end <= 5 for start, end in windows) and len(windows) == 4
    assert draw_window(2, (0, 5), torch.Generator().manual_seed(3)) in windows
    assert FlowSampler(sigmas, 0.7).draw_window(torch.Generator()) == (0, 10)  # Flow-GRPO: every step stochastic


def test_fast_run_stores_and_trains_only_the_window(family_models, prompt_file, tmp_path, monkeypatch):
    seen = []
    real = ddpo.train_epoch

    def spy(update, epoch, *args):
        seen.append({key: getattr(epoch.rollout, key).clone() for key in ("step_indices", "log_probs", "timesteps")})
        return real(update, epoch, *args)

    monkeypatch.setattr(ddpo, "train_epoch", spy)
    ddpo.train(config(family_models("sd3"), prompt_file, tmp_path / "fast", num_inference_steps=6, timestep_fraction=0.34,
                      deterministic_tail=True, timestep_selection="high_noise", num_epochs=1))
    (record,) = seen
    assert record["step_indices"].tolist() == [[0, 1]] * 4  # 2 of 6 steps, at the start, nothing else stored
    assert torch.isfinite(record["log_probs"]).all() and record["timesteps"][0, 0] > record["timesteps"][0, 1]


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_bf16_flow_rounds_start_exactly_on_policy(family_models, prompt_file, tmp_path, kind):
    run = ddpo.train(config(family_models(kind), prompt_file, tmp_path / kind, mixed_precision="bf16", num_epochs=3,
                            checkpointing_epochs=3, clip_range=1e-4, kl_coef=0.1))
    records = epochs(run)
    # rounds 2 and 3 sample from a trained LoRA under autocast, as the update re-scores them
    assert [r["clipfrac"] for r in records] == [0.0, 0.0, 0.0]
    assert [r["approx_kl"] for r in records] == [0.0, 0.0, 0.0]
    assert records[-1]["kl_to_reference"] > 0  # and it trained


def test_full_fine_tuning_of_a_flow_model_with_the_kl_to_a_frozen_copy(family_models, prompt_file, tmp_path):
    model = family_models("sd3")
    run = ddpo.train(config(model, prompt_file, tmp_path / "full", finetune="full", kl_coef=0.5, learning_rate=1e-3,
                            deterministic_tail=True))
    records = epochs(run)
    assert records[0]["kl_to_reference"] == 0.0 and records[1]["kl_to_reference"] > 0
    trained = SD3Transformer2DModel.from_pretrained(run / "final" / "transformer")
    base = SD3Transformer2DModel.from_pretrained(Path(model) / "transformer")
    assert any(not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), base.state_dict().values()))


def test_flow_run_resumes_exactly(family_models, prompt_file, tmp_path, monkeypatch):
    class Crash(Exception):
        pass

    settings = dict(num_epochs=2, kl_coef=0.1, deterministic_tail=True)
    straight = ddpo.train(config(family_models("sd3"), prompt_file, tmp_path / "a", **settings))
    save = ddpo.save_ddpo_checkpoint

    def save_then_crash(*args, **kwargs):
        save(*args, **kwargs)
        raise Crash

    monkeypatch.setattr(ddpo, "save_ddpo_checkpoint", save_then_crash)
    with pytest.raises(Crash):
        ddpo.train(config(family_models("sd3"), prompt_file, tmp_path / "b", **settings))
    monkeypatch.setattr(ddpo, "save_ddpo_checkpoint", save)
    resumed = ddpo.train(config(family_models("sd3"), prompt_file, tmp_path / "b", resume="latest", **settings))
    a, b = (load_file(run / "final" / "pytorch_lora_weights.safetensors") for run in (straight, resumed))
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert epochs(straight)[1]["reward_mean"] == epochs(resumed)[1]["reward_mean"]


def test_deterministic_tail_with_random_steps_is_refused_for_ddim_families(family_models, prompt_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        ddpo.main(["--model", family_models("sdxl"), "--prompts", prompt_file, "--output_dir", str(tmp_path / "x"),
                   "--reward", "jpeg-compressibility", "--deterministic_tail", "true"])
    assert exit_.value.code == 2
    assert "--deterministic_tail needs --timestep_selection high_noise" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_flow_update_differentiates_both_halves_of_guidance(family_models):
    # Flow-GRPO since its commit a482878 ("fix cfg gradient detach"): the trained prediction is
    # uncond + w·(cond - uncond) with both halves differentiated, so its gradient is w·∂cond - (w - 1)·∂uncond.
    pipe = load_pipeline(family_models("sd3"))
    family = family_of_pipeline(pipe)
    transformer = add_lora(pipe.transformer, rank=2, target_modules=family.lora_targets)
    torch.manual_seed(0)
    for name, p in transformer.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)
    params = [p for p in transformer.parameters() if p.requires_grad]
    cond, uncond = family.encode_prompts(pipe, ["a red circle"], 32), family.unconditional(pipe, 1, 32)
    latents, timesteps = torch.randn(1, 4, 16, 16), torch.tensor([500.0])
    models = PolicyModels(family, transformer, transformer, None, None, 3.0, contextlib.nullcontext)
    trained = models.predict(latents, timesteps, cond, uncond)
    torch.testing.assert_close(trained, guided_prediction(family, transformer, latents, timesteps, cond, uncond, 3.0),
                               rtol=0, atol=0)
    got = torch.autograd.grad(trained.sum(), params)
    want = torch.autograd.grad((3.0 * family.predict(transformer, latents, timesteps, cond).float()
                                - 2.0 * family.predict(transformer, latents, timesteps, uncond).float()).sum(), params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_flow_grpo_fast_table_reports_gains_per_cpu_minute_with_paired_errors(tmp_path, capsys):
    table = load_experiment("flow_grpo_fast")
    for name, rewards, cpu, after in (("grpo", [0.5, 0.5, 0.7, 0.7], 30.0, [0.6, 0.7, 0.8]), ("fast", [0.5, 0.6], 15.0, [0.5, 0.6, 0.7])):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps({"reward_mean": r, "epoch_cpu_seconds": cpu}) + "\n" for r in rewards))
        (run / "eval_before.json").write_text(json.dumps({"mean": 0.5, "scores": [0.5, 0.5, 0.5]}))
        (run / "eval_after.json").write_text(json.dumps({"mean": sum(after) / 3, "scores": after}))
    rows = table.main([str(tmp_path / "grpo"), str(tmp_path / "fast"), "--window", "2", "--ceiling", "0.4"])
    grpo, fast = rows
    assert grpo["reward_gain"] == pytest.approx(0.2) and grpo["gain_per_cpu_min"] == pytest.approx(0.2 / 2)
    assert fast["reward_gain"] == pytest.approx(0.0) and fast["cpu_s"] == 30.0  # two epochs: the windows overlap
    assert grpo["heldout_gain"] == pytest.approx(0.2) and grpo["heldout_sem"] == pytest.approx(0.1 / math.sqrt(3))
    out = capsys.readouterr().out
    assert "50%" in out and "grpo" in out and "fast" in out
    with pytest.raises(SystemExit):
        table.main([str(tmp_path / "missing")])


def test_flow_grpo_score_function_gradient_points_along_the_exact_gradient(family_models, prompt_file, capsys):
    # experiments/flow_grpo_gradient_check.py: the trainer's estimate mean(A · ∇ log p) over 1,024 samples against
    # the reparameterised gradient of a differentiable reward through the same chain. An estimator with a wrong sign,
    # step or weighting lands near 0 or below; this one reaches ~0.8 here (the run is seeded).
    check = load_experiment("flow_grpo_gradient_check")
    check.main(["--model", family_models("sd3"), "--prompts", prompt_file, "--samples", "1024", "--steps", "4", "--window", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "samples: cos" in line]
    assert len(lines) == 1024 // 32
    assert float(lines[-1].split("=")[1]) > 0.5


def test_flow_gradient_check_refuses_a_unet_pipeline(tiny_model):
    with pytest.raises(SystemExit, match="flow-matching"):
        load_experiment("flow_grpo_gradient_check").main(["--model", tiny_model])
