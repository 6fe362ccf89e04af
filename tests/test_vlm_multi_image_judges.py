"""Multi-image local VLM judges (qwen2.5-vl-7b, llava-1.6-7b, internvl) on tiny random models of the real
classes, saved in the hub checkpoint layout and loaded through the preset's own path
(``rewards.load("<name>[model=<folder>]")``), then run through chat template + processor + generate.

Without torchvision (this environment) the judge gets the PIL image processors, and Qwen2.5-VL's and
InternVL's processors are loaded without their video processors (which need torchvision)."""

import pytest
import torch
import transformers
from transformers.utils import is_torchvision_available

import rewards
from align.testing.tiny_vlms import build_internvl, build_llava_next, build_qwen25_vl, record_generate
from rewards.vlm import load_processor

# name -> (builder, image placeholder token, that token per image, image height x width, PIL image processor)
CASES = {
    # 40x36 is resized to 84x56 (min_pixels = 56^2, multiples of 28): 6x4 patches of 14 px, merged 2x2 -> 6
    "qwen2.5-vl-7b": (build_qwen25_vl, "<|image_pad|>", 6, (40, 36), "Qwen2VLImageProcessorPil"),
    # anyres: 2x2 features of the 28 px base view + the 56x28 pinpoint's 4x2 map unpadded to 40:36, row ends -> 10
    "llava-1.6-7b": (build_llava_next, "<image>", 10, (40, 36), "LlavaNextImageProcessorPil"),
    # 28x60 -> a 1x2 grid of 28 px tiles plus the thumbnail; each tile is 2x2 patches pixel-shuffled to 1 token
    "internvl": (build_internvl, "<IMG_CONTEXT>", 3, (28, 60), "GotOcr2ImageProcessorPil"),
}


def load_judge(name, folder, **options):
    judge = rewards.load(f"{name}[model={folder}]", **options)
    assert judge.multi_image and judge.name == name
    if not is_torchvision_available():
        assert type(judge._processor.image_processor).__name__ == CASES[name][4]
    return judge


def images_per_question(inputs, count):
    """The pixels of each image in the batch, in the order the questions show them."""
    pixels = inputs["pixel_values"]
    if "image_grid_thw" in inputs:  # Qwen: all images' patches in one sequence
        return torch.split(pixels, inputs["image_grid_thw"].prod(dim=1).tolist())
    return pixels.chunk(count)  # LLaVA-NeXT: one row per image; InternVL: equal tiles per same-size image


def image_tokens_per_row(judge, inputs, token):
    token_id = judge._processor.tokenizer.convert_tokens_to_ids(token)
    return (inputs["input_ids"] == token_id).sum(dim=1).tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_pair_mode_shows_both_images_in_both_orders(name, tmp_path):
    build, token, per_image, (height, width), _ = CASES[name]
    build(tmp_path)
    judge = load_judge(name, tmp_path, mode="pair", max_tokens=4, batch_size=4)
    seen = record_generate(judge)
    a, b = torch.rand(2, 3, height, width), torch.rand(2, 3, height, width)
    prefs = judge.compare(["a cat", "a dog"], a, b)

    assert len(seen) == 1  # 2 pairs x 2 orders in one batch
    assert image_tokens_per_row(judge, seen[0], token) == [2 * per_image] * 4
    images = images_per_question(seen[0], 8)
    assert torch.equal(images[0], images[5]) and torch.equal(images[1], images[4])  # pair 0 as (A, B) and (B, A)
    assert not torch.equal(images[0], images[1])
    # random weights: the answers parse as nothing, so every pair abstains with both raw answers kept
    assert len(judge.last_answers) == 4 and all(a.parsed.status == "unparseable" for a in judge.last_answers)
    for pref in prefs:
        assert pref.abstained and not pref.tie
        assert [o["order"] for o in pref.raw["orders"]] == ["AB", "BA"] and all(o["raw"] for o in pref.raw["orders"])


@pytest.mark.parametrize("name", list(CASES))
def test_single_mode_scores_one_image_per_question(name, tmp_path):
    build, token, per_image, (height, width), _ = CASES[name]
    build(tmp_path, constant_answer=True)  # greedy decoding always says "7"
    judge = load_judge(name, tmp_path, mode="single", max_tokens=1, batch_size=2)
    seen = record_generate(judge)
    scores = judge.score(["a red cube", "a cat", "two dogs"], torch.rand(3, 3, height, width))

    assert scores.tolist() == [7.0, 7.0, 7.0] and [a.raw for a in judge.last_answers] == ["7"] * 3
    assert len(seen) == 2  # batches of 2 then 1
    assert image_tokens_per_row(judge, seen[0], token) == [per_image, per_image]
    text = judge._processor.tokenizer.decode(seen[0]["input_ids"][0], skip_special_tokens=False)
    text = text.replace("<pad>", "").strip()  # left padding
    assert text.startswith("<|im_start|> user") and text.endswith("<|im_start|> assistant")  # the chat template


@pytest.mark.skipif(is_torchvision_available(), reason="the fallback applies without torchvision only")
@pytest.mark.parametrize("name, processor_class", [("qwen2.5-vl-7b", "Qwen2_5_VLProcessor"),
                                                   ("internvl", "InternVLProcessor")])
def test_processors_load_without_their_video_processor(name, processor_class, tmp_path):
    CASES[name][0](tmp_path)
    with pytest.raises((ImportError, ValueError), match="orchvision"):  # what AutoProcessor says here
        transformers.AutoProcessor.from_pretrained(tmp_path)
    processor = load_processor(str(tmp_path))
    assert isinstance(processor, getattr(transformers, processor_class))
    assert not hasattr(processor, "video_processor") and processor.chat_template
    if name == "internvl":
        assert processor.image_seq_length == 1  # options from processor_config.json still reach the processor
