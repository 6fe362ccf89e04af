"""The flow-matching (SD3-architecture) shapes testbed: build, train a few steps, save, load, sample."""

from __future__ import annotations

import json

import pytest
import torch

import rewards
from align.data.prompt_sets import load_prompt_list
from align.families.base import ModelLoadError
from align.metrics import clustered_sem
from align.pipeline import generate_images, load_pipeline, resolve_model
from align.pipeline import testbed_settings as read_testbed_settings
from align.sampling import flow as flow_sampling
from align.testbed import flow_models, weights
from align.testbed.weights import TESTBED_PIPELINE_DIR
from tests.script_loader import load_experiment, load_script

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


# --- the perfect-supervision ceiling (experiments/flow_ceiling.py) and the bundled folder ('testbed-flow')


@pytest.fixture(scope="module")
def ceiling():
    return load_experiment("flow_ceiling")


def test_paired_gain_is_the_mean_difference_with_the_standard_error_of_the_differences(ceiling):
    # 2 prompts x 2 seeds, laid out prompt-major per round: images (p0 s0, p1 s0, p0 s1, p1 s1).
    gain = ceiling.paired_gain([0.0, 0.5, 1.0, 0.5], [1.0, 0.5, 1.0, 1.0], ["p0", "p1", "p0", "p1"])
    assert gain["gain"] == pytest.approx(0.375)  # differences 1, 0, 0, 0.5
    assert gain["paired_sem_images"] == pytest.approx(float(torch.tensor([1.0, 0, 0, 0.5]).std()) / 2)
    # clustered by caption, with as many seeds per caption: the standard error of the per-caption means
    assert gain["paired_sem_captions"] == pytest.approx(float(torch.tensor([0.5, 0.25]).std()) / 2 ** 0.5)
    assert (gain["num_images"], gain["num_captions"]) == (4, 2)
    with pytest.raises(ValueError):
        ceiling.paired_gain([0.0] * 3, [1.0] * 3, ["p0", "p1"])


def test_ceiling_run_trains_on_true_scenes_and_scores_the_same_images_before_and_after(ceiling, built, tmp_path):
    out, _ = built
    run = ceiling.main(["--model", str(out), "--out", str(tmp_path / "ceiling"), "--minutes", "0.02",
                        "--eval-every", "0.01", "--num-scenes", "32", "--batch-size", "4",
                        "--eval-prompts", "testbed:3:1000", "--eval-images-per-prompt", "2"])
    curve = run["curve"]
    assert curve[0]["step"] == 0 and curve[0]["gain"] == 0.0 and len(curve) >= 3
    assert curve[-1]["step"] > curve[-2]["step"] > 0 and curve[-1]["cpu_minutes"] >= 0.02
    before = json.loads((tmp_path / "ceiling" / "eval_before.json").read_text())
    after = json.loads((tmp_path / "ceiling" / "eval_after.json").read_text())
    assert len(before["scores"]) == 6 and after["seeds"] == before["seeds"] == list(range(1234, 1240))
    assert run["result"]["gain"] == pytest.approx(after["mean"] - before["mean"])
    captions, images = ceiling.render_training_scenes(16, held_out=set(before["prompts"]), seed=0)
    assert not set(captions) & set(before["prompts"])

    assert rewards.load("shapes-oracle").score(captions, (images + 1) / 2).tolist() == [1.0] * 16


def test_ceiling_refuses_a_folder_with_results_before_any_work(ceiling, tmp_path, capsys):
    (tmp_path / "curve.json").write_text("{}")
    with pytest.raises(SystemExit) as stopped:
        ceiling.main(["--out", str(tmp_path)])
    assert stopped.value.code == 2 and "is not empty" in capsys.readouterr().err
    assert (tmp_path / "curve.json").read_text() == "{}"


def test_testbed_flow_without_bundled_weights_says_how_to_build_them(monkeypatch, tmp_path):
    monkeypatch.setattr(weights, "FLOW_TESTBED_PIPELINE_DIR", tmp_path / "nothing")
    with pytest.raises(ModelLoadError, match="scripts/build_flow_testbed.py"):
        resolve_model("testbed-flow")


def test_testbed_settings_reads_a_flow_testbed_folders_settings(built):
    out, settings = built
    assert read_testbed_settings(str(out))["max_sequence_length"] == settings["max_sequence_length"] == 2


def test_bundled_flow_testbed_loads_through_its_family_with_its_recorded_settings_and_samples_at_its_resolution():
    folder = resolve_model("testbed-flow")
    assert folder == str(weights.FLOW_TESTBED_PIPELINE_DIR)
    # small enough to ship inside the package (the SD testbed's pipeline is ~8 MB)
    assert sum(f.stat().st_size for f in weights.FLOW_TESTBED_PIPELINE_DIR.rglob("*.safetensors")) < 15e6
    settings = read_testbed_settings("testbed-flow")
    assert settings["resolution"] == 32 and settings["max_sequence_length"] == flow_models.MAX_SEQUENCE_LENGTH
    assert settings["scheduler"] == "FlowMatchEulerDiscreteScheduler" and 0 < settings["evaluation"]["mean_oracle_score"] < 1
    pipe = load_pipeline("testbed-flow")
    assert type(pipe).__name__ == "StableDiffusion3Pipeline" and pipe.text_encoder_3 is None
    assert dict(pipe.transformer.config) | flow_models.transformer_config(settings["build"]["size"]) == dict(pipe.transformer.config)
    images = generate_images(pipe, ["a red circle", "two blue squares"], [0, 0], num_inference_steps=4,
                             guidance_scale=settings["guidance_scale"])
    assert images.shape == (2, 3, 32, 32) and 0 <= images.min() and images.max() <= 1
    assert (images[0] - images[1]).abs().mean() > 0.01  # the same seed, another caption: another image


@pytest.mark.slow  # the suite's time budget on the 2-core CI machine
def test_unet_flow_probe_trains_velocity_scores_and_measures_the_gradient(capsys):
    probe = load_experiment("unet_flow_probe")
    probe.main(["--minutes", "0.02", "--num-scenes", "64", "--eval-captions", "4", "--estimates", "2", "--samples", "16"])
    out = capsys.readouterr().out
    assert "64 scenes encoded to (4, 8, 8) latents" in out
    held_out = next(line for line in out.splitlines() if "held-out oracle" in line)
    assert 0.0 <= float(held_out.split("oracle ")[1].split()[0]) <= 1.0
    cosine = next(line for line in out.splitlines() if "gradient cosine" in line)
    assert -1.0 <= float(cosine.split(": ")[1].split()[0]) <= 1.0


@pytest.mark.slow  # the suite's time budget on the 2-core CI machine
def test_unet_flow_probe_samples_the_epsilon_unet_with_ddim_steps_in_flow_coordinates(capsys):
    probe = load_experiment("unet_flow_probe")
    probe.main(["--epsilon", "--ddim-grid", "--step", "ddim", "--eval-captions", "4", "--estimates", "2", "--samples", "16"])
    out = capsys.readouterr().out
    assert "scenes encoded" not in out  # --epsilon: the UNet as it is, no fine-tuning
    assert "DDIM steps on σ 0.936" in out  # DDIM's first timestep (999) in flow coordinates
    held_out = next(line for line in out.splitlines() if "held-out oracle" in line)
    assert float(held_out.split("oracle ")[1].split()[0]) > 0.25  # the converted sampler draws the shapes world
    assert "first 10 of 20 steps" in out


# --- experiments/paired_heldout.py: the large held-out comparison that resolves a +0.02 gain


def test_paired_heldout_clusters_by_caption_text_and_counts_better_and_worse_images():
    paired = load_experiment("paired_heldout")
    # 2 captions x 2 seeds, and a third image on the first caption again: three images share one caption
    gain = paired.paired_gain([0.0, 1.0, 0.5, 0.5, 0.0], [1.0, 1.0, 0.5, 1.0, 1.0], ["a", "a", "b", "b", "a"])
    assert gain["gain"] == pytest.approx(0.5)  # differences 1, 0, 0, 0.5, 1
    assert (gain["num_images"], gain["num_captions"], gain["better"], gain["worse"]) == (5, 2, 3, 0)
    assert gain["paired_sem_captions"] == pytest.approx(clustered_sem([1, 0, 0, 0.5, 1], ["a", "a", "b", "b", "a"]))
    assert gain["clustered_se_ratio"] == pytest.approx(gain["gain"] / gain["paired_sem_captions"])
    assert paired.parse_set("novel=testbed-novel:5:3@60000") == ("novel", "testbed-novel:5:3", 60000)
    assert paired.parse_set("unseen=testbed-heldout:5") == ("unseen", "testbed-heldout:5", 50000)
    with pytest.raises(SystemExit, match="NAME=SPEC"):
        paired.parse_set("testbed-heldout:5")


def test_paired_heldout_gives_every_image_its_own_noise_and_a_model_no_gain_over_itself(tmp_path, capsys):
    paired = load_experiment("paired_heldout")
    paired.main(["testbed", "--base", "testbed", "--sets", "unseen=testbed-heldout:2:5@7", "--images-per-prompt", "2",
                 "--out", str(tmp_path)])
    scores = json.loads((tmp_path / "unseen" / "testbed.json").read_text())
    first, second = load_prompt_list("testbed-heldout:2:5")
    assert scores["captions"] == [first, first, second, second] and scores["seeds"] == [7, 8, 9, 10]
    assert len(scores["scores"]) == 4
    assert json.loads((tmp_path / "unseen" / "base.json").read_text())["scores"] == scores["scores"]
    assert "gain +0.0000 ± 0.0000 per image" in capsys.readouterr().out
    paired.main(["testbed", "--base", "testbed", "--sets", "unseen=testbed-heldout:2:5", "--images-per-prompt", "2",
                 "--trainers-layout", "--out", str(tmp_path / "trainers")])
    scores = json.loads((tmp_path / "trainers" / "unseen" / "testbed.json").read_text())
    assert scores["captions"] == [first, second, first, second] and scores["seeds"] == [50000, 50001, 50002, 50003]
    with pytest.raises(SystemExit, match="no such run folder"):
        paired.main([str(tmp_path / "missing"), "--base", "testbed"])


def test_paired_heldout_refuses_a_held_out_set_the_run_trained_on_before_generating(tmp_path, capsys):
    paired = load_experiment("paired_heldout")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("reward: shapes-oracle\nprompts: testbed:64:3\n")  # the unsplit grammar
    with pytest.raises(SystemExit, match="shares .* with the training prompts"):
        paired.main([str(run), "--base", "testbed", "--sets", "unseen=testbed-heldout:64:3", "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()  # refused before any image
    # a set of training-part captions is the "seen" question: the share the run trained on is printed, not refused
    (run / "config.yaml").write_text("reward: shapes-oracle\nprompts: testbed-train:8:3\n")
    paired.check_sets_against_training([str(run)], {"seen": paired.image_set("testbed-train:8:3", 2, 0, False)},
                                       {"seen": "testbed-train:8:3"})
    assert "16 of the 16 images of seen" in capsys.readouterr().out
