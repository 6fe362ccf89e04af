"""Phi-3.5-vision's HD-crop processing without remote code, pinned against values that
experiments/fidelity_reference_phi3v.py computed with the remote processing_phi3_v.py."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from rewards.phi3v_processor import Phi3VInputs, expand_image_tags, hd_scale, image_inputs, num_image_tokens

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = json.loads((ROOT / "tests" / "data" / "phi3v_reference.json").read_text())


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PHI = _script("fidelity_reference_phi3v")
BASE = _script("fidelity_reference")


@pytest.mark.parametrize("case", REFERENCE["cases"], ids=lambda c: f"{c['num_crops']}-{c['size'][0]}x{c['size'][1]}")
def test_pixels_sizes_and_token_counts_equal_the_remote_processor(case):
    image = PHI.fixed_images()[PHI.IMAGE_SIZES.index(tuple(case["size"]))]
    out = image_inputs([image], case["num_crops"])
    pixels = out["pixel_values"][0]
    assert list(pixels.shape) == case["shape"]
    assert out["image_sizes"][0].tolist() == case["image_size"]
    assert out["num_img_tokens"] == [case["num_img_tokens"]]
    for view, ref in zip(pixels, case["views"]):
        flat = view.double().flatten()
        index = torch.from_numpy(BASE.sample_positions(tuple(view.shape))[: len(ref["samples"])])
        torch.testing.assert_close(flat[index], torch.tensor(ref["samples"], dtype=torch.float64), atol=1e-6, rtol=0)
        assert float(flat.sum()) == pytest.approx(ref["sum"], abs=1e-6 * flat.numel())
        assert float((flat * flat).sum()) == pytest.approx(ref["sum_sq"], rel=1e-6, abs=1e-6)


def test_crop_grid_and_token_formula():
    assert hd_scale(512, 384, 16) == 4  # 4 columns x ceil(4 / 1.33) = 3 rows = 12 crops <= 16; 5 x 4 = 20 > 16
    assert num_image_tokens(1008, 1344) == (3 * 4 + 1) * 144 + 1 + 4 * 12 == 1921


def test_placeholder_expansion():
    assert REFERENCE["expansion_equal"]  # measured against the remote processor in the side environment
    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "rewards" / "weights" / "shapes-clip"))
    ids = expand_image_tags(tokenizer, "a <|image_1|> red circle", [5])[0].tolist()
    head, tail = tokenizer("a ").input_ids, tokenizer(" red circle").input_ids
    assert ids == head + [-1] * 5 + tail
    with pytest.raises(ValueError, match="without gaps"):
        expand_image_tags(tokenizer, "<|image_2|>", [5])
    inputs = Phi3VInputs(tokenizer, num_crops=4)("<|user|>\n<|image_1|>\nred circle", [PHI.fixed_images()[0]])
    assert inputs["pixel_values"].shape == (1, 5, 3, 336, 336)
    assert int((inputs["input_ids"] == -1).sum()) == 757 and bool(inputs["attention_mask"].all())
