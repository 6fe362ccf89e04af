"""The flow-matching (SD3-architecture) shapes testbed: build, train a few steps, save, load, sample."""

from __future__ import annotations

import json

import pytest
import torch

from align import flow_sampling
from align.testbed import flow_models
from align.testbed.weights import TESTBED_PIPELINE_DIR
from tests.script_loader import load_script

pytestmark = pytest.mark.skipif(
    not (TESTBED_PIPELINE_DIR / "vae" / "config.json").is_file(), reason="the bundled SD testbed (its VAE) is missing"
)


@pytest.fixture(scope="module")
def build():
    return load_script("build_flow_testbed")


@pytest.fixture(scope="module")
def built(build, tmp_path_factory):
    out = tmp_path_factory.mktemp("flow") / "pipeline"
    settings = build.main(["--out", str(out), "--size", "test", "--max-steps", "2", "--num-scenes", "32",
                           "--batch-size", "4", "--eval-captions", "0", "--num-inference-steps", "3"])
    return out, settings


def test_saved_folder_loads_with_sd3_pipeline_and_samples_images(built):
    out, settings = built
    assert settings["build"]["steps"] == 2
    assert json.loads((out / flow_models.FLOW_SETTINGS_FILE).read_text())["max_sequence_length"] == 2
    pipe = flow_models.load_pipeline(out)
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    assert type(pipe.transformer).__name__ == "SD3Transformer2DModel" and pipe.text_encoder_3 is None
    assert pipe.tokenizer_max_length == flow_models.TOKENIZER_MAX_LENGTH
    pipe.set_progress_bar_config(disable=True)
    images = pipe(["a red circle", "two blue squares"], output_type="np", generator=torch.Generator().manual_seed(0),
                  num_inference_steps=3, guidance_scale=3.0, height=32, width=32, max_sequence_length=2).images
    assert images.shape == (2, 32, 32, 3) and 0 <= images.min() and images.max() <= 1


def test_flow_sampler_with_the_testbed_transformer_matches_the_pipeline(built):
    # The sampler's transformer_fn convention (timestep = σ·1000) is the pipeline's: with a window of
    # one nearly noiseless step, the final latents are the pipeline's Euler latents.
    out, _ = built
    pipe = flow_models.load_pipeline(out)
    pipe.set_progress_bar_config(disable=True)
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    expected = pipe("a red circle", latents=latents, num_inference_steps=4, guidance_scale=1.0, output_type="latent",
                    max_sequence_length=2).images
    with torch.no_grad():
        embeds, _, pooled, _ = pipe.encode_prompt("a red circle", None, None, do_classifier_free_guidance=False,
                                                  max_sequence_length=2)

        def velocity(x, t):
            return pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=embeds,
                                    pooled_projections=pooled, return_dict=False)[0]

        pipe.scheduler.set_timesteps(4)
        trajectory = flow_sampling.sample_flow_with_logprob(velocity, latents, pipe.scheduler.sigmas, window=(1, 2),
                                                            noise_level=1e-7, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(trajectory.final_latents, expected, atol=1e-5, rtol=1e-5)
    assert trajectory.timesteps.tolist() == pytest.approx([float(pipe.scheduler.timesteps[1])])


def test_rectified_flow_loss_regresses_the_velocity(build):
    # z0 = 0 makes x_σ = σ·ε, so the exact velocity ε - z0 is x_σ / σ: a model returning that has loss 0.
    def exact(hidden_states, timestep, **_):
        return (hidden_states / (timestep / 1000).reshape(-1, 1, 1, 1),)

    loss = build.rectified_flow_loss(exact, torch.zeros(3, 4, 8, 8), None, None, torch.Generator().manual_seed(0))
    assert float(loss) < 1e-10
    wrong = build.rectified_flow_loss(lambda hidden_states, **_: (hidden_states,), torch.zeros(3, 4, 8, 8), None, None,
                                      torch.Generator().manual_seed(0))
    assert float(wrong) > 0.01


def test_training_reaches_both_text_encoders(build, built):
    out, _ = built
    pipe = flow_models.load_pipeline(out)
    embeds, _, pooled, _ = pipe.encode_prompt(["a red circle"] * 2, None, None, do_classifier_free_guidance=False,
                                              max_sequence_length=2)
    build.rectified_flow_loss(pipe.transformer, torch.randn(2, 4, 8, 8), embeds, pooled,
                              torch.Generator().manual_seed(0)).backward()
    for name in ("text_encoder", "text_encoder_2"):
        grads = [p.grad for p in getattr(pipe, name).parameters() if p.grad is not None]
        assert grads and any(g.abs().sum() > 0 for g in grads), name


@pytest.mark.parametrize("flags,message", [(["--minutes", "0"], "--minutes must be > 0"),
                                           (["--size", "huge"], "invalid choice")])
def test_bad_flags_fail_before_anything_is_written(build, tmp_path, capsys, flags, message):
    out = tmp_path / "pipeline"
    with pytest.raises(SystemExit) as exit_info:
        build.main(["--out", str(out), *flags])
    assert exit_info.value.code != 0 and message in capsys.readouterr().err
    assert not out.exists()


def test_an_existing_folder_that_is_not_a_pipeline_is_not_replaced(build, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit):
        build.main(["--out", str(tmp_path), "--max-steps", "1"])
    assert "not a pipeline folder" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "keep me"
