"""Local VLM judges: tiny random LLaVA and Idefics2 built here with the real model and processor
classes, saved in the checkpoint layout and loaded back through AutoProcessor /
AutoModelForImageTextToText, then run through the real chat-template + generate path."""

import pytest
import torch
from transformers import (
    CLIPVisionConfig,
    Idefics2Config,
    Idefics2ForConditionalGeneration,
    Idefics2Processor,
    InstructBlipConfig,
    InstructBlipForConditionalGeneration,
    InstructBlipProcessor,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)
from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.idefics2.image_processing_pil_idefics2 import Idefics2ImageProcessorPil

import rewards
from align.testing.tiny_vlms import record_generate, text_config, tiny_tokenizer
from rewards import vlm
from rewards.mllm import JudgeNotReadyError

LLAVA_TEMPLATE = (
    "{% for m in messages %}USER: {% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n"
    "{% else %}{{ c['text'] }} {% endif %}{% endfor %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
IDEFICS2_TEMPLATE = (
    "{% for m in messages %}User:{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
    "{% else %} {{ c['text'] }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def build_llava(folder, constant_answer=False):
    tok = tiny_tokenizer(["<image>"])
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=28, patch_size=14, projection_dim=16),
        text_config=text_config(tok, "llama"),
        image_token_id=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    if constant_answer:
        with torch.no_grad():
            model.model.language_model.norm.weight.zero_()
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
        tokenizer=tok, patch_size=14, vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE,
        num_additional_image_tokens=1,
    )
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return tok.convert_tokens_to_ids("<image>")


def build_idefics2(folder):
    tok = tiny_tokenizer(["<image>", "<fake_token_around_image>", "<end_of_utterance>"])
    config = Idefics2Config(
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 14},
        perceiver_config={"hidden_size": 32, "resampler_n_latents": 4, "resampler_depth": 1, "resampler_n_heads": 2,
                          "resampler_head_dim": 8, "num_key_value_heads": 2},
        text_config={"model_type": "mistral", "vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
                     "pad_token_id": tok.pad_token_id},
        image_token_id=tok.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(0)
    Idefics2ForConditionalGeneration(config).eval().save_pretrained(folder)
    image_processor = Idefics2ImageProcessorPil(size={"shortest_edge": 28, "longest_edge": 28}, do_image_splitting=False)
    Idefics2Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=4,
                      chat_template=IDEFICS2_TEMPLATE).save_pretrained(folder)


def build_instructblip(folder):
    """InstructBLIP: no chat template; the instruction also goes to the Q-Former."""
    tok, qformer_tok = tiny_tokenizer(["<image>"]), tiny_tokenizer([])
    config = InstructBlipConfig(
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 14},
        qformer_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                        "vocab_size": len(qformer_tok), "encoder_hidden_size": 16,
                        "pad_token_id": qformer_tok.pad_token_id},
        text_config=text_config(tok, "llama"),
        num_query_tokens=4, image_token_index=tok.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(0)
    model = InstructBlipForConditionalGeneration(config).eval()
    with torch.no_grad():  # constant greedy answer "7" (see WORDS)
        model.language_model.model.norm.weight.zero_()
    model.save_pretrained(folder)
    InstructBlipProcessor(image_processor=BlipImageProcessorPil(size={"height": 28, "width": 28}), tokenizer=tok,
                          qformer_tokenizer=qformer_tok, num_query_tokens=4).save_pretrained(folder)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llava")
    image_token_id = build_llava(folder, constant_answer=True)
    return folder, image_token_id


def test_llava_scores_through_chat_template_and_generate(llava_dir, tmp_path):
    folder, image_token_id = llava_dir
    judge = rewards.load(f"hf-vlm:{folder}", mode="single", max_tokens=1, batch_size=2,
                         cache_path=str(tmp_path / "cache.sqlite"))
    seen = record_generate(judge)
    images = torch.rand(3, 3, 40, 36)
    scores = judge.score(["a red cube", "a cat", "two dogs"], images)
    # the model's only greedy token is "7": decoding keeps the new tokens only, and it parses as a rating
    assert scores.tolist() == [7.0, 7.0, 7.0]
    assert [a.raw for a in judge.last_answers] == ["7"] * 3
    assert len(seen) == 2  # batches of 2 then 1
    ids = seen[0]["input_ids"]
    assert ids.shape[0] == 2
    assert ((ids == image_token_id).sum(dim=1) == 4).all()  # (28 / 14)^2 patches, CLS dropped
    text = judge._processor.tokenizer.decode(ids[0], skip_special_tokens=False)
    assert text.lstrip("<pad> ").startswith("USER") and text.rstrip().endswith("ASSISTANT :")
    assert seen[0]["pixel_values"].shape[-2:] == (28, 28)
    judge.close()

    again = rewards.load(f"hf-vlm:{folder}", mode="single", max_tokens=1, cache_path=str(tmp_path / "cache.sqlite"))
    seen_again = record_generate(again)
    assert again.score(["a red cube", "a cat", "two dogs"], images).tolist() == [7.0] * 3
    assert seen_again == [] and again.stats.cache_hits == 3


def test_llava_random_answers_are_abstentions(tmp_path):
    build_llava(tmp_path)
    judge = rewards.load(f"hf-vlm:{tmp_path}", mode="likert", max_tokens=6)
    scores = judge.score(["a red cube", "a cat"], torch.rand(2, 3, 28, 28))
    assert torch.isnan(scores).all()
    assert all(a.raw is not None and a.parsed.status == "unparseable" for a in judge.last_answers)
    prefs = judge.compare(["a"], torch.rand(1, 3, 28, 28), torch.rand(1, 3, 28, 28))
    assert prefs[0].abstained and not prefs[0].tie


def test_instructblip_without_chat_template(tmp_path):
    build_instructblip(tmp_path)
    judge = rewards.load(f"hf-vlm:{tmp_path}", mode="single", scale="0-100", max_tokens=1)
    assert judge.model_type == "instructblip" and not judge.multi_image
    seen = record_generate(judge)
    assert judge.score(["a red cube", "a cat"], torch.rand(2, 3, 30, 30)).tolist() == [7.0, 7.0]
    assert "qformer_input_ids" in seen[0]  # the instruction reached the Q-Former too
    with pytest.raises(ValueError, match="one image per question"):
        rewards.load(f"hf-vlm:{tmp_path}", mode="pair")


def test_single_image_models_refuse_pair_mode(llava_dir):
    folder, _ = llava_dir
    with pytest.raises(ValueError, match="one image per question"):
        rewards.load(f"hf-vlm:{folder}", mode="pair")


def test_idefics2_pair_mode_sends_both_images_in_both_orders(tmp_path):
    build_idefics2(tmp_path)
    judge = rewards.load(f"hf-vlm:{tmp_path}", mode="pair", max_tokens=4, batch_size=4)
    assert judge.multi_image and judge.pairwise_native
    seen = record_generate(judge)
    a, b = torch.rand(2, 3, 28, 28), torch.rand(2, 3, 28, 28)
    prefs = judge.compare(["a cat", "a dog"], a, b)
    assert len(seen) == 1
    pixels = seen[0]["pixel_values"]
    assert pixels.shape[:2] == (4, 2)  # 4 questions (2 pairs x 2 orders), 2 images each
    assert torch.equal(pixels[0, 0], pixels[2, 1]) and torch.equal(pixels[0, 1], pixels[2, 0])  # swapped
    assert not torch.equal(pixels[0, 0], pixels[0, 1])
    image_token_id = judge._processor.tokenizer.convert_tokens_to_ids("<image>")
    assert ((seen[0]["input_ids"] == image_token_id).sum(dim=1) == 8).all()  # 2 images x 4 latents
    assert len(judge.last_answers) == 4
    for pref in prefs:  # random weights: no usable verdict, recorded as such with both raw answers
        assert pref.abstained and [o["order"] for o in pref.raw["orders"]] == ["AB", "BA"]


def test_registry_presets_have_factories_and_default_ids():
    for name, hub_id in vlm.DEFAULT_IDS.items():
        target = rewards._REGISTRY[name]
        assert target.startswith("rewards.vlm:")
        assert callable(getattr(vlm, target.split(":")[1]))
        assert "/" in hub_id


def test_missing_weights_fail_with_a_clear_message(tmp_path):
    with pytest.raises(JudgeNotReadyError, match="cannot load VLM judge"):
        rewards.load("hf-vlm:" + str(tmp_path / "no-such-model"))
