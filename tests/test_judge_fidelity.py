"""The judges' preprocessing equals the authors' code: pixels and captions pinned against values that
experiments/fidelity_reference.py computed with the authors' own transforms (HPSv2's open_clip copy,
OpenAI CLIP's torchvision pipeline, open_clip's tokenizer) in a side environment."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoProcessor

import rewards
from align.testing.tiny_judges import save_tiny_clip
from rewards import clip as clip_module
from rewards.checkpoint_keys import ScoreMLP
from rewards.preprocess import centre_crop_offset, hps_pixels, open_clip_clean, openai_clip_pixels

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = json.loads((ROOT / "tests" / "data" / "fidelity_reference.json").read_text())


def _reference_script():
    spec = importlib.util.spec_from_file_location("fidelity_reference", ROOT / "experiments" / "fidelity_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REF = _reference_script()


def _assert_matches(pixels: torch.Tensor, ref: dict, what: str) -> None:
    assert list(pixels.shape) == ref["shape"], what
    flat = pixels.double().flatten()
    index = torch.from_numpy(REF.sample_positions(tuple(pixels.shape)))
    torch.testing.assert_close(flat[index], torch.tensor(ref["samples"], dtype=torch.float64), atol=1e-6, rtol=0,
                               msg=what)
    assert float(flat.sum()) == pytest.approx(ref["sum"], abs=1e-6 * flat.numel()), what
    assert float((flat * flat).sum()) == pytest.approx(ref["sum_sq"], rel=1e-6), what
    assert (float(flat.min()), float(flat.max())) == pytest.approx((ref["min"], ref["max"]), abs=1e-6), what


@pytest.mark.parametrize("index", range(len(REF.IMAGE_SIZES)))
def test_hps_pixels_equal_the_authors_preprocess_val(index):
    image = REF.fixed_images()[index]
    pixels = hps_pixels([image], REF.SIZE, REF.MEAN, REF.STD)[0]
    _assert_matches(pixels, REFERENCE["hps"][index], f"hps {image.size}")


def test_hps_keeps_the_bicubic_overshoot():
    # the authors resize the float tensor: values outside the [0, 1] pixel range survive normalisation
    pixels = hps_pixels(REF.fixed_images()[:1], REF.SIZE, REF.MEAN, REF.STD)[0]
    lowest = min((0 - m) / s for m, s in zip(REF.MEAN, REF.STD))
    assert float(pixels.min()) < lowest - 0.05


@pytest.mark.parametrize("index", range(len(REF.IMAGE_SIZES)))
def test_aesthetic_pixels_equal_openai_clip_transform(index):
    image = REF.fixed_images()[index]
    pixels = openai_clip_pixels([image], REF.SIZE, REF.MEAN, REF.STD)[0]
    _assert_matches(pixels, REFERENCE["aesthetic"][index], f"aesthetic {image.size}")


def test_centre_crop_offset_rounds_like_torchvision():
    # excess 3 -> 1.5 -> 2 (transformers' processor floors it to 1); Python's round is half-to-even
    assert [centre_crop_offset(224 + e, 224) for e in range(6)] == [0, 0, 1, 2, 2, 2]


@pytest.mark.parametrize("entry", REFERENCE["captions"], ids=lambda e: e["caption"][:20])
def test_captions_are_cleaned_like_open_clip(entry):
    assert open_clip_clean(entry["caption"]) == entry["cleaned"]
    assert entry["hf_ids_equal"]  # measured in the side environment: transformers' BPE on the cleaned text


def test_clip_family_processors_use_the_pil_backend_whatever_is_installed(tmp_path, monkeypatch):
    folder = tmp_path / "clip"
    save_tiny_clip(folder)

    asked = []
    real = AutoProcessor.from_pretrained

    def recording(source, *args, **kwargs):
        asked.append(kwargs.get("backend"))
        return real(source, *args, **kwargs)

    monkeypatch.setattr(AutoProcessor, "from_pretrained", recording)
    judge = rewards.load("clip", model=str(folder), device="cpu")
    assert asked == ["pil"]
    assert type(judge.embedder.processor.image_processor).__name__ == "CLIPImageProcessorPil"
    assert clip_module.load_processor(str(folder), "clip").image_processor.__class__.__name__ == "CLIPImageProcessorPil"


def test_aesthetic_and_hps_judges_use_the_authors_preprocessing(tmp_path):
    folder = tmp_path / "clip"
    save_tiny_clip(folder, image_size=32)
    torch.save(ScoreMLP(16).state_dict(), tmp_path / "head.pth")
    judge = rewards.load("aesthetic", model=str(tmp_path / "head.pth"), clip_model=str(folder), device="cpu")
    image = REF.fixed_image(35, 32, 0)  # crop excess 3: offset round(1.5) = 2, transformers' floor gives 1
    expected = openai_clip_pixels([image], 32, REF.MEAN, REF.STD)
    torch.testing.assert_close(judge.embedder.pixel_fn([image]), expected)
    floored = judge.embedder.processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(floored[..., 1:], expected[..., :-1])  # the processor's crop: one pixel to the left
    assert (floored - expected).abs().max() > 0.1
