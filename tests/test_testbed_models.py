"""The testbed models: tokenizer, configs, the bundled pipeline and the bundled shapes-clip."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline
from script_loader import load_experiment, load_script
from transformers import CLIPModel, CLIPProcessor, CLIPTokenizer

import rewards
from align.eval.evaluate import EvalConfig
from align.eval.generation import sampling_settings
from align.pipeline import generate_images, load_trained
from align.pipeline import testbed_settings as read_testbed_settings
from align.testbed import models, weights
from align.testbed.scene import corrupt_caption, render, sample_captions
from align.testbed.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    build_tokenizer,
    grammar_words,
    save_tokenizer,
    whole_word_merges,
)

SHAPES_CLIP_DIR = Path(__file__).resolve().parents[1] / "rewards" / "weights" / "shapes-clip"


def expected_tokens(caption: str) -> list[str]:
    return [piece + "</w>" for piece in re.findall(r"[a-z]+|,", caption.lower())]


# ---------------------------------------------------------------- tokenizer


def test_merges_make_every_word_one_token_even_when_words_overlap():
    # "on" is a prefix of "one", "lu" sits inside "blue": the merges must not fight.
    words = ["on", "one", "lu", "blue", "blues", "a", "aa", "aaa"]
    tokenizer = build_tokenizer(words)
    for word in words:
        assert tokenizer.tokenize(word) == [word + "</w>"]
    assert len(whole_word_merges(words)) < sum(len(w) for w in words)


def test_tokenizer_rejects_non_letter_words():
    with pytest.raises(ValueError, match="lowercase ASCII"):
        whole_word_merges(["red", "Red2"])


def test_grammar_captions_round_trip_as_whole_words(tmp_path):
    tokenizer = save_tokenizer(tmp_path / "tok", grammar_words())
    assert {"vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in (tmp_path / "tok").iterdir()
    }
    reloaded = CLIPTokenizer.from_pretrained(tmp_path / "tok")
    assert reloaded.model_max_length == 77
    captions = sample_captions(200, seed=7) + ["two red circles to the left of a blue square", "one circle."]
    for caption in captions:
        tokens = reloaded.tokenize(caption)
        if caption.endswith("."):
            assert tokens[-1] == ".</w>"
            tokens = tokens[:-1]
        assert tokens == expected_tokens(caption), caption
        ids = reloaded(caption).input_ids
        assert ids[0] == reloaded.convert_tokens_to_ids(BOS_TOKEN)
        assert ids[-1] == reloaded.convert_tokens_to_ids(EOS_TOKEN)
        assert ids == tokenizer(caption).input_ids
        decoded = reloaded.decode(ids, skip_special_tokens=True)
        assert decoded.replace(" ,", ",").replace(" .", ".") == caption
    # CLIP layout: the end token has the highest id (the text encoder pools there).
    assert reloaded.eos_token_id == len(reloaded) - 1 == reloaded.pad_token_id


def test_every_grammar_word_is_in_the_vocabulary():
    tokenizer = build_tokenizer(grammar_words())
    vocab = tokenizer.get_vocab()
    for word in grammar_words():
        assert word + "</w>" in vocab
    for caption in sample_captions(100, seed=3):
        for word in re.findall(r"[a-z]+", caption):
            assert word in grammar_words()


# ---------------------------------------------------------------- configs


def test_pipeline_from_configs_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    tokenizer = build_tokenizer(grammar_words())
    pipe = models.build_pipeline(tokenizer)
    assert pipe.vae_scale_factor * pipe.unet.config.sample_size == models.IMAGE_SIZE
    pipe.save_pretrained(tmp_path / "pipe", safe_serialization=True)
    loaded = StableDiffusionPipeline.from_pretrained(tmp_path / "pipe")
    assert isinstance(loaded.scheduler, DDIMScheduler)
    assert loaded.safety_checker is None
    state = pipe.unet.state_dict()
    for key, value in loaded.unet.state_dict().items():
        torch.testing.assert_close(value, state[key])
    loaded.set_progress_bar_config(disable=True)
    image = loaded("a red circle", num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (models.IMAGE_SIZE, models.IMAGE_SIZE)


def test_shapes_clip_processor_keeps_32px_images():
    processor = models.shapes_clip_image_processor()
    image = render("two red circles left of a blue square", seed=0)
    pixels = processor(images=[image], return_tensors="pt").pixel_values[0]
    mean = torch.tensor(processor.image_mean).view(3, 1, 1)
    std = torch.tensor(processor.image_std).view(3, 1, 1)
    expected = (torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255 - mean) / std
    torch.testing.assert_close(pixels, expected, atol=1e-5, rtol=0)
    larger = render("a circle", seed=0, size=64)
    assert processor(images=[larger], return_tensors="pt").pixel_values.shape == (1, 3, 32, 32)


def test_missing_bundled_pipeline_gives_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "TESTBED_PIPELINE_DIR", tmp_path / "nothing")
    with pytest.raises(weights.MissingTestbedWeightsError, match="scripts/build_testbed.py"):
        weights.testbed_pipeline_dir()


# ---------------------------------------------------------------- bundled weights


def _bundled_pipeline_or_skip():
    if not (weights.TESTBED_PIPELINE_DIR / "model_index.json").is_file():
        pytest.skip(f"bundled testbed pipeline not built yet ({weights.TESTBED_PIPELINE_DIR}); "
                    "run scripts/build_testbed.py")
    return weights.testbed_pipeline_dir()


def test_bundled_pipeline_loads_offline_and_generates_32px():
    folder = _bundled_pipeline_or_skip()
    size_mb = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
    assert size_mb <= 25

    settings = read_testbed_settings("testbed")
    assert settings["resolution"] == models.IMAGE_SIZE
    pipe = StableDiffusionPipeline.from_pretrained(folder, torch_dtype=torch.float32, local_files_only=True)
    assert isinstance(pipe.scheduler, DDIMScheduler)
    assert pipe.unet.dtype == torch.float32
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        ["a red circle", "two blue squares"],
        num_inference_steps=settings["num_inference_steps"],
        guidance_scale=settings["guidance_scale"],
        generator=[torch.Generator().manual_seed(i) for i in range(2)],
        output_type="np",
    ).images
    assert images.shape == (2, 32, 32, 3)
    assert np.isfinite(images).all() and images.std() > 0.05  # an actual picture, not a flat field


def _bundled_clip_or_skip():
    if not (SHAPES_CLIP_DIR / "config.json").is_file():
        pytest.skip(f"bundled shapes-clip not built yet ({SHAPES_CLIP_DIR}); run scripts/train_shapes_clip.py")
    return SHAPES_CLIP_DIR


def _held_out_pairs(n: int = 24):
    captions = sample_captions(n, seed=424242)
    right = [render(c, seed=i) for i, c in enumerate(captions)]
    wrong = [render(corrupt_caption(c, seed=i)[0], seed=i) for i, c in enumerate(captions)]
    return captions, right, wrong


def test_bundled_shapes_clip_loads_with_transformers_and_prefers_the_right_scene():
    folder = _bundled_clip_or_skip()
    model = CLIPModel.from_pretrained(folder, local_files_only=True).eval()
    processor = CLIPProcessor.from_pretrained(folder, local_files_only=True)
    assert model.config.vision_config.image_size == 32
    captions, right, wrong = _held_out_pairs()
    with torch.no_grad():
        text = processor(text=captions, padding=True, return_tensors="pt")
        t = model.get_text_features(input_ids=text.input_ids).pooler_output
        sims = []
        for images in (right, wrong):
            pixels = processor(images=images, return_tensors="pt").pixel_values
            assert pixels.shape[-2:] == (32, 32)
            v = model.get_image_features(pixel_values=pixels).pooler_output
            sims.append(torch.nn.functional.cosine_similarity(v, t))
    assert (sims[0] > sims[1]).float().mean() > 0.6


def test_bundled_shapes_clip_loads_through_rewards():
    folder = _bundled_clip_or_skip()
    pytest.importorskip("rewards.clip", reason="rewards/clip.py (shapes-clip adapter) not written yet")

    judge = rewards.load("shapes-clip")
    captions, right, wrong = _held_out_pairs(8)
    scores = judge.score(captions + captions, right + wrong)
    assert scores.shape == (16,)
    assert torch.isfinite(scores).all()
    assert json.loads((folder / "config.json").read_text())["vision_config"]["image_size"] == 32


def test_headroom_script_scores_renders_perfectly_and_the_base_models_generations_lower(capsys):
    testbed_headroom = load_experiment("testbed_headroom")
    testbed_headroom.main(["--captions", "testbed:6:777"])
    rows = {line[:26].strip(): line[26:].split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {"true renders", "renders through the VAE", "model generations"}
    assert all(float(v) == 1.0 for v in rows["true renders"])
    vae_round_trip, generations = float(rows["renders through the VAE"][0]), float(rows["model generations"][0])
    assert 0.0 <= vae_round_trip <= 1.0
    assert 0.0 <= generations < vae_round_trip  # the bundled model is imperfect on purpose


def test_headroom_scripts_stochastic_sampler_reduces_to_the_pipelines_sampler_without_noisy_steps(capsys):
    testbed_headroom = load_experiment("testbed_headroom")
    pipe = load_trained("testbed")
    pipe.set_progress_bar_config(disable=True)
    settings = sampling_settings(EvalConfig(), "testbed")
    captions, seeds = ["a red circle", "two blue squares"], [3, 4]
    pipeline_images = generate_images(pipe, captions, seeds, num_inference_steps=settings["num_inference_steps"],
                                      guidance_scale=settings["guidance_scale"])
    deterministic = testbed_headroom.stochastic_generations(pipe, captions, seeds, settings, eta=0.7, stochastic_steps=0)
    torch.testing.assert_close(deterministic, pipeline_images, atol=1e-4, rtol=0)  # same starting noise, η = 0 throughout
    noisy = testbed_headroom.stochastic_generations(pipe, captions, seeds, settings, eta=0.7, stochastic_steps=10)
    assert (noisy - pipeline_images).abs().max() > 0.05

    testbed_headroom.main(["--captions", "testbed:4:777", "--stochastic-eta", "0.7"])
    rows = [line[:26].strip() for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows[-1] == "eta 0.7, 10 noisy steps"


# ---------------------------------------------------------------- the build script's caption noise


def test_caption_noise_swaps_the_requested_share_of_captions_among_themselves():
    build = load_script("build_testbed")
    captions = [f"caption {i}" for i in range(2000)]
    swapped = build.swap_captions(captions, 0.25, torch.Generator().manual_seed(0))
    moved = [i for i, (a, b) in enumerate(zip(captions, swapped)) if a != b]
    assert 0.2 < len(moved) / len(captions) < 0.3
    # A permutation within the chosen scenes: no caption is invented or lost.
    assert sorted(swapped) == sorted(captions)
    assert swapped == build.swap_captions(captions, 0.25, torch.Generator().manual_seed(0))  # deterministic
    assert build.swap_captions(captions, 0.0, torch.Generator().manual_seed(0)) == captions
    with pytest.raises(SystemExit):
        build.parse_args(["--caption-noise", "1.0"])


def test_build_script_is_deterministic_and_writes_a_loadable_pipeline(tmp_path):
    """Two tiny builds with the same seed write byte-identical weights (caption noise included)."""
    build = load_script("build_testbed")
    tiny = ["--vae-steps", "2", "--unet-steps", "3", "--num-scenes", "64", "--batch-size", "8",
            "--eval-captions", "0", "--caption-noise", "0.5", "--warmup-steps", "1"]
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        for name in ("a", "b"):
            build.main([*tiny, "--out", str(tmp_path / name / "pipeline")])
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_num_threads(1)
    weights_a = sorted((tmp_path / "a" / "pipeline").rglob("*.safetensors"))
    assert [p.relative_to(tmp_path / "a") for p in weights_a] == [
        p.relative_to(tmp_path / "b") for p in sorted((tmp_path / "b" / "pipeline").rglob("*.safetensors"))]
    assert len(weights_a) == 3  # vae, unet, text encoder
    for path in weights_a:
        assert path.read_bytes() == (tmp_path / "b" / path.relative_to(tmp_path / "a")).read_bytes(), path
    settings = json.loads((tmp_path / "a" / "pipeline" / weights.TESTBED_SETTINGS_FILE).read_text())
    assert settings["build"]["caption_noise"] == 0.5

    StableDiffusionPipeline.from_pretrained(tmp_path / "a" / "pipeline", local_files_only=True)
