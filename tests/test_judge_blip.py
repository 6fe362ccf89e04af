"""BLIP ITM judge on a tiny random BlipForImageTextRetrieval saved like the hub checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import BlipConfig, BlipForImageTextRetrieval, BlipImageProcessor, BlipProcessor

import rewards
from align.testing.tiny_judges import WORDS, bert_tokenizer, images_as_tensor, random_images, save_tiny_clip
from rewards.weights import MissingWeightsError

PROMPTS = ["a red circle", "a blue square on the left", "a photo of a cat"]


@pytest.fixture(scope="module")
def blip_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-blip-itm")
    tokenizer = bert_tokenizer(folder)
    config = BlipConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=64),
        vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        image_text_hidden_size=16,
    )
    torch.manual_seed(0)
    model = BlipForImageTextRetrieval(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    images = BlipImageProcessor(size={"height": 32, "width": 32})
    BlipProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    return folder


def reference_match_probability(folder, prompts, images):
    """transformers' own forward, as documented for Salesforce/blip-itm-base-coco."""
    model = BlipForImageTextRetrieval.from_pretrained(folder).eval()
    processor = BlipProcessor.from_pretrained(folder)
    inputs = processor(images=images, text=prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**inputs, use_itm_head=True).itm_score
    return torch.softmax(logits, dim=-1)[:, 1]


def test_blip_score_is_the_itm_match_probability(blip_folder):
    images = random_images(3, size=(48, 40))
    judge = rewards.load("blip", model=str(blip_folder), device="cpu", batch_size=2)
    scores = judge.score(PROMPTS, images)
    torch.testing.assert_close(scores, reference_match_probability(blip_folder, PROMPTS, images), atol=1e-5, rtol=1e-4)
    assert ((scores > 0) & (scores < 1)).all() and scores.std() > 1e-4
    # index 1 is "match": the no-match probability is its complement
    no_match = torch.softmax(judge.match_logits(PROMPTS, images), -1)[:, 0]
    torch.testing.assert_close(no_match, 1 - scores)


def test_tensor_input_and_prompt_cut_at_35_tokens(blip_folder):
    images = random_images(2, size=(32, 32), seed=4)
    judge = rewards.load("blip", model=str(blip_folder), device="cpu")
    long_prompt = " ".join(WORDS[i % len(WORDS)] for i in range(60))
    first_33_words = " ".join(long_prompt.split()[:33])  # [CLS] + 33 words + [SEP] = 35 tokens
    a = judge.score([long_prompt, "a red circle"], images_as_tensor(images))
    b = judge.score([first_33_words, "a red circle"], images)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_compare_uses_the_tie_margin(blip_folder):
    a, b = random_images(3, seed=5), random_images(3, seed=6)
    judge = rewards.load("blip", model=str(blip_folder), device="cpu", tie_margin=1.0)
    assert all(p.tie for p in judge.compare(PROMPTS, a, b))  # probabilities differ by < 1


def test_blip_errors(blip_folder, tmp_path):
    with pytest.raises(MissingWeightsError, match="nothing-here"):
        rewards.load("blip", model=str(tmp_path / "nothing-here"))

    save_tiny_clip(tmp_path / "clip")
    with pytest.raises(ValueError, match="'clip' model"):
        rewards.load("blip", model=str(tmp_path / "clip"))
