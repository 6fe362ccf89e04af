"""The ocr judge's engines: a tiny GOT-OCR2 (transformers) saved in the hub layout and loaded back by name,
PaddleOCR 3.x's result format (a fake pipeline: its weights download at run time), and the testbed
stand-in shapes-ocr."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import GotOcr2Config, GotOcr2ForConditionalGeneration, GotOcr2Processor
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

import rewards
from align.testbed.scene import render
from align.testing.tiny_vlms import text_config, tiny_tokenizer
from rewards.ocr import OcrJudge, PaddleOcrReader
from rewards.ocr_shapes import caption_target, transcribe


def _tiny_got_ocr2(folder):
    """GOT-OCR2's classes at toy size; the final norm zeroed so greedy decoding always says "7"."""
    tok = tiny_tokenizer(["<|im_start|>", "<|im_end|>", "<img>", "</img>", "<imgpad>", "OCR", "system"])
    # 64 px at patch 1 -> 64x64 patches -> the projector's two stride-2 convs -> 16x16 = 256 tokens, the
    # processor's fixed count per image
    vision = dict(hidden_size=16, output_channels=8, num_hidden_layers=2, num_attention_heads=2, image_size=64,
                  patch_size=1, window_size=4, global_attn_indexes=[], mlp_dim=32)
    config = GotOcr2Config(vision_config=vision, text_config=text_config(tok, "qwen2"),
                           image_token_index=tok.convert_tokens_to_ids("<imgpad>"), image_seq_length=256)
    torch.manual_seed(0)
    model = GotOcr2ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.model.language_model.norm.weight.zero_()
    model.save_pretrained(folder)
    GotOcr2Processor(image_processor=GotOcr2ImageProcessorPil(size={"height": 64, "width": 64}),
                     tokenizer=tok).save_pretrained(folder)


def test_got_ocr2_loads_by_name_and_reads(tmp_path):
    _tiny_got_ocr2(tmp_path / "got")
    judge = rewards.load("ocr", model=str(tmp_path / "got"), max_new_tokens=3, device="cpu")
    images = [Image.new("RGB", (50, 40), "white"), Image.new("RGB", (30, 60), "black")]
    scores, details = judge.score_with_details(['a sign that says "77"', 'a mug printed with "abc"'], images)
    assert [d["read"].replace(" ", "") for d in details] == ["777", "777"]
    assert scores.tolist() == [1.0, 0.0]  # "77" is inside "777"; "abc" is 3 edits away, the cap
    with pytest.raises(ValueError, match="double quotes"):
        judge.score(["a photo of a cat"], images[:1])
    with pytest.raises(ValueError, match="unknown engine"):
        rewards.load("ocr[engine=tesseract]")


class FakePaddlePipeline:
    """What PaddleOCR 3.x's ``predict`` returns: one result per image with rec_texts and rec_scores."""

    def predict(self, array):
        return [{"rec_texts": ["HELLO", "noise", "World"], "rec_scores": [0.98, 0.0, 0.91]}]


def test_paddleocr_lines_and_confidences_feed_the_rule():
    judge = OcrJudge(read=PaddleOcrReader(FakePaddlePipeline()))
    scores, details = judge.score_with_details(['a sign "Hello World"'], [Image.new("RGB", (8, 8))])
    assert details[0]["read"] == "HELLOWorld" and scores.tolist() == [1.0]  # the zero-confidence line is dropped


def test_shapes_ocr_transcribes_the_scene():
    assert transcribe(render("two red circles left of a blue square", seed=0)) in (
        "two red circles and a blue square", "a blue square and two red circles")
    assert caption_target("a red circle") == "a red circle" and caption_target('say "hi"') == "hi"
    judge = rewards.load("shapes-ocr")
    scores = judge.score(["a red circle", "a green triangle"], [render("a red circle", seed=1)] * 2)
    assert scores[0] == 1.0 and scores[1] < 0.5
    with pytest.raises(ValueError, match="not a testbed caption"):
        judge.score(["a photo of a cat"], [render("a red circle", seed=1)])
