"""LLaVA-Reward: input format, backbone gating, final-token read-out, and loading a tiny random
Qwen2.5-VL checkpoint written in the authors' layout (lora/ + pytorch_model.bin + reward_config.yaml)."""

import json
import shutil

import pytest
import torch
import yaml
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import rewards
from align.testing.tiny_vlms import build_qwen25_vl
from align.train.reward_losses import bradley_terry_loss
from rewards.llava_reward import (
    QWEN_MAX_PIXELS,
    QWEN_MIN_PIXELS,
    LlavaReward,
    LlavaRewardError,
    LlavaRewardModel,
    check_backbone,
    load_reward_checkpoint,
    phi3v_reward_text,
    qwen_fetch_image,
    qwen_fetch_size,
    qwen_reward_text,
)
from rewards.trained import write_marker

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
WORDS = ["[UNK]", "user", "a", "red", "blue", "circle", "square", "on", "the", "left", "of", "two"]
PROMPTS = ["a red circle", "two blue square on the left of a red circle", "a blue circle"]


def tiny_processor(padding_side="left"):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS + SPECIAL)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                   additional_special_tokens=SPECIAL[1:], padding_side=padding_side)
    images = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 64, "longest_edge": 1024})
    # The real processor class; its constructor insists on a video processor, which needs torchvision
    # (not installable here), so the attributes are set directly.
    proc = Qwen2_5_VLProcessor.__new__(Qwen2_5_VLProcessor)
    proc.image_processor, proc.tokenizer, proc.video_processor, proc.chat_template = images, fast, None, None
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id, proc.video_token_id = fast.convert_tokens_to_ids("<|image_pad|>"), fast.convert_tokens_to_ids("<|video_pad|>")
    return proc


def tiny_qwen(processor, seed=0):
    t = processor.tokenizer
    ids = {name: t.convert_tokens_to_ids(tok) for name, tok in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(t), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                         bos_token_id=0, eos_token_id=t.eos_token_id, pad_token_id=t.pad_token_id),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=8, out_hidden_size=32, fullatt_block_indexes=[1]),
        **ids,
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def images():
    # different sizes -> different numbers of image tokens per row (padding inside SkipCA too)
    return [Image.new("RGB", (16, 16), "red"), Image.new("RGB", (24, 16), "blue"), Image.new("RGB", (16, 16), (0, 90, 200))]


@pytest.fixture(scope="module")
def processor():
    return tiny_processor()


def trained_like(model: LlavaRewardModel, seed=3):
    """Non-trivial head, SkipCA, projector and LoRA weights (a fresh LoRA B is zero: no effect)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "value_head" in name or "W_" in name or "merger" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def test_input_texts():
    assert phi3v_reward_text("a cat", "<|endoftext|>") == "<|user|>\n<|image_1|>\na cat<|endoftext|>"
    assert qwen_reward_text("a cat") == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>a cat<|im_end|>"


def test_backbone_gating(tmp_path):
    # Phi-3.5-vision runs natively (rewards/phi3v.py): no remote code to allow
    assert check_backbone("microsoft/Phi-3.5-vision-instruct") == "phi3v"
    assert check_backbone("Qwen/Qwen2.5-VL-7B-Instruct") == "qwen2.5-vl"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(LlavaRewardError, match="supported: Phi-3.5-vision"):
        check_backbone(str(tmp_path))
    # offline, the default judge (released checkpoint on the hub) fails with one clear error
    with pytest.raises(LlavaRewardError, match="cannot fetch LLaVA-Reward checkpoint"):
        rewards.load("llava-reward")


def test_reward_read_at_final_token_under_left_and_right_padding(processor):
    mllm = tiny_qwen(processor)
    model = trained_like(LlavaRewardModel(mllm, processor, "qwen2.5-vl", skip_cross_attention=True))
    imgs = images()
    with torch.no_grad():
        alone = torch.stack([model([p], [im])[0] for p, im in zip(PROMPTS, imgs)])
        left = model(PROMPTS, imgs)
        model.processor = tiny_processor("right")
        right = model(PROMPTS, imgs)
    assert processor.tokenizer.padding_side == "left"
    assert torch.allclose(left, alone, atol=1e-4), (left, alone)
    assert torch.allclose(right, alone, atol=1e-4), (right, alone)
    assert len(set(alone.tolist())) == 3


def _write_authors_checkpoint(model: LlavaRewardModel, folder, general_preference=False):
    """The layout of the authors' save_model_lora: lora/, pytorch_model.bin (named_parameters keys
    holding value_head / W_* / ca_layernorm / merger), reward_config.yaml, the base config.json."""
    folder.mkdir()
    model.save_lora(folder / "lora")
    keys = ("value_head", "W_q", "W_k", "W_v", "ca_layernorm", "merger")
    state = {
        name.replace("mllm.model.visual.", "visual.").replace("skipca.", ""): p.detach().clone()
        for name, p in model.named_parameters()
        if any(k in name for k in keys) and "lora_" not in name
    }
    assert "visual.merger.mlp.0.weight" in state and "W_q.weight" in state and "value_head.weight" in state
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "reward_config.yaml").write_text(yaml.safe_dump({
        "is_general_preference": general_preference, "add_cross_attention": True,
        "value_head_dim": 2 if general_preference else 1, "general_preference_tau": 0.1}))
    model.mllm.config.to_json_file(str(folder / "config.json"))
    assert sorted(p.name for p in (folder / "lora").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_loads_tiny_checkpoint_in_the_authors_layout(tmp_path, processor):
    base = tmp_path / "base"
    tiny_qwen(processor).save_pretrained(base)
    reference = LlavaRewardModel(tiny_qwen(processor), processor, "qwen2.5-vl", skip_cross_attention=True)
    reference.add_lora(rank=4, alpha=8, dropout=0.0)
    trained_like(reference)
    _write_authors_checkpoint(reference, tmp_path / "ckpt")

    judge = rewards.load("llava-reward", model=str(tmp_path / "ckpt"), base_model=str(base), processor=processor)
    imgs = images()
    with torch.no_grad():
        expected = reference(PROMPTS, imgs)
        expected_b = reference(PROMPTS[:2], imgs[1:])
    assert torch.allclose(judge.score(PROMPTS, imgs) * judge.scale, expected, atol=1e-4)
    pref = judge.compare(PROMPTS[:2], imgs[:2], imgs[1:])
    expected_p = torch.sigmoid((expected[:2] - expected_b) / 0.1)
    assert [p.prob_a for p in pref] == pytest.approx(expected_p.tolist(), abs=1e-4)

    # the LoRA adapter matters: without it the rewards differ
    judge.model.set_adapters_enabled(False)
    with torch.no_grad():
        assert not torch.allclose(judge.model(PROMPTS, imgs), expected, atol=1e-4)

    # a head file with a foreign tensor is refused, not half-loaded
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "ckpt", bad)
    state = torch.load(bad / "pytorch_model.bin", weights_only=True)
    state["lm_head.weight"] = torch.zeros(2, 2)
    torch.save(state, bad / "pytorch_model.bin")
    with pytest.raises(LlavaRewardError, match="unexpected tensors"):
        load_reward_checkpoint(bad, base_model=str(base), processor=processor)


def test_own_save_reloads_by_path_and_general_preference(tmp_path, processor):
    base = tmp_path / "base"
    tiny_qwen(processor).save_pretrained(base)
    model = LlavaRewardModel(tiny_qwen(processor), processor, "qwen2.5-vl", skip_cross_attention=True, base_model=str(base))
    model.add_lora(rank=4, alpha=8, dropout=0.0)
    trained_like(model, seed=5)
    folder = tmp_path / "ours"
    meta = model.save(folder)
    write_marker(folder, {**meta, "tau": 0.1, "calibration": {"temperature": 2.0}})
    judge = rewards.load(str(folder), processor=processor)
    imgs = images()
    with torch.no_grad():
        expected = model(PROMPTS, imgs)
    assert torch.allclose(judge.score(PROMPTS, imgs), expected / (0.1 * 2.0), atol=1e-3)

    # a general-preference (2-d) checkpoint compares pairs only, skew-symmetrically
    gpm = LlavaRewardModel(tiny_qwen(processor), processor, "qwen2.5-vl", skip_cross_attention=True, value_head_dim=2)
    gpm.add_lora(rank=4, alpha=8, dropout=0.0)
    trained_like(gpm, seed=7)
    _write_authors_checkpoint(gpm, tmp_path / "gpm", general_preference=True)
    judge = LlavaReward(model=str(tmp_path / "gpm"), base_model=str(base), processor=processor)
    ab = [p.prob_a for p in judge.compare(PROMPTS[:2], imgs[:2], imgs[1:])]
    ba = [p.prob_a for p in judge.compare(PROMPTS[:2], imgs[1:], imgs[:2])]
    assert [x + y for x, y in zip(ab, ba)] == pytest.approx([1.0, 1.0], abs=1e-5)
    with pytest.raises(NotImplementedError, match="only compares pairs"):
        judge.score(PROMPTS, imgs)


def test_lora_skipca_and_head_train_with_bradley_terry(processor):
    model = LlavaRewardModel(tiny_qwen(processor), processor, "qwen2.5-vl", skip_cross_attention=True)
    model.init_reward_head()
    model.add_lora(rank=4, alpha=8, dropout=0.0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("merger" in n for n in trainable)
    assert {"value_head.weight", "skipca.W_q.weight", "skipca.ca_layernorm.weight"} <= trainable
    assert not any(".visual.blocks." in n for n in trainable)  # vision tower frozen
    imgs = images()
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(3):
        rewards_ = model(PROMPTS[:2] * 2, imgs[:2] + imgs[1:])
        loss = bradley_terry_loss(*rewards_.chunk(2), tau=0.1)
        optimizer.zero_grad()
        loss.backward()
        assert model.skipca.W_k.weight.grad.abs().sum() > 0
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


# ---- the authors' image sizes (github.com/sjz5202/LLaVA-Reward) ----------------------------------


@pytest.mark.parametrize("size, expected", [
    ((512, 512), (504, 504)),      # sides to the nearest multiple of 28
    ((1024, 768), (1036, 756)),
    ((20, 10), (84, 56)),          # below 4 x 28 x 28 pixels: grown (ceil) to at least that area
])
def test_qwen_fetch_size_is_the_authors_smart_resize(size, expected):
    assert qwen_fetch_size(*size) == expected


def test_qwen_processor_bounds_are_the_authors():
    # a 256 px image: the processor's default bounds (56 x 56 px up) keep 252 x 252 = 81 tokens; the
    # authors' lower bound of 256 tokens of 28 x 28 px grows it to 448 x 448 = 256 tokens
    assert qwen_fetch_size(252, 252, min_pixels=56 * 56, max_pixels=28 * 28 * 1280) == (252, 252)
    assert qwen_fetch_size(252, 252, min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS) == (448, 448)
    # 2048 px: shrunk under 1280 tokens, floored to 28 px: 35 x 35 = 1225 tokens (36 x 36 would exceed it)
    assert qwen_fetch_size(2048, 2048, min_pixels=QWEN_MIN_PIXELS, max_pixels=QWEN_MAX_PIXELS) == (980, 980)
    with pytest.raises(ValueError, match="aspect ratios up to 200"):
        qwen_fetch_size(4020, 20)


def test_qwen_backbone_gets_the_authors_pixel_limits_and_fetch_resize(tmp_path):
    build_qwen25_vl(tmp_path / "qwen")
    model = LlavaRewardModel.from_base(str(tmp_path / "qwen"))
    size = model.processor.image_processor.size
    assert (size["shortest_edge"], size["longest_edge"]) == (QWEN_MIN_PIXELS, QWEN_MAX_PIXELS)
    image = Image.new("RGB", (40, 40), (200, 10, 10))  # 28 x 28 after rounding: grown to 56 x 56 (3136 px)
    assert qwen_fetch_image(image).size == (56, 56)
    inputs = model.build_inputs(["a red circle"], [image])
    # 56 x 56 grows to the 256-token minimum: 448 x 448 px = 32 x 32 patches of 14 px
    assert inputs["image_grid_thw"].tolist() == [[1, 32, 32]]
