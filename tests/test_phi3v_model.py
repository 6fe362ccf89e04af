"""The native Phi-3.5-vision (rewards/phi3v.py) against the remote modelling code: the same seeded
random weights, under the checkpoint's key names, give the logits, last hidden state and image
embeddings that experiments/phi3v_reference.py recorded with the remote code (transformers 4.44)."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from rewards.llava_reward import LlavaReward, LlavaRewardModel
from rewards.phi3v import Phi3VConfig, Phi3VForCausalLM, check_vision_config, load_phi3v, merge_2x2
from rewards.phi3v_processor import Phi3VInputs

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = json.loads((ROOT / "tests" / "data" / "phi3v_model_reference.json").read_text())
ATOL = 1e-5


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SIDE = _script("phi3v_reference")


def tiny_config(**overrides) -> Phi3VConfig:
    text = {**REFERENCE["text_config"], **overrides}
    text["img_processor"] = {**text["img_processor"], "clip_config": REFERENCE["small_clip"]}
    return Phi3VConfig(**text)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A folder in the hub checkpoint's layout (config.json + model.safetensors, hub key names)."""
    folder = tmp_path_factory.mktemp("phi3v")
    tiny_config().save_pretrained(folder)
    save_file(SIDE.seeded_weights(REFERENCE["shapes"], REFERENCE["seed"]), str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_phi3v(str(checkpoint), attn_implementation="eager")


def test_parameter_names_are_the_remote_checkpoints():
    shapes = {k: list(v.shape) for k, v in Phi3VForCausalLM(tiny_config()).state_dict().items()}
    assert shapes == REFERENCE["shapes"]
    assert "model.vision_embed_tokens.img_processor.vision_model.encoder.layers.0.self_attn.q_proj.weight" in shapes
    assert "model.vision_embed_tokens.img_projection.2.weight" in shapes


@pytest.mark.parametrize("name", sorted(REFERENCE["cases"]))
def test_logits_equal_the_remote_model(checkpoint, model, name, tmp_path):
    case, spec = REFERENCE["cases"][name], SIDE.CASES[name]
    if spec["overrides"]:  # the same weights under another config
        tiny_config(**spec["overrides"]).save_pretrained(tmp_path)
        (tmp_path / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
        model = load_phi3v(str(tmp_path), attn_implementation="eager")
    rows = spec["rows"]
    vision = SIDE.image_batch(rows, spec["num_crops"])
    assert vision["num_img_tokens"] == case["num_img_tokens"]
    input_ids, mask = SIDE.case_inputs(rows, vision["num_img_tokens"])
    assert list(input_ids.shape) == case["input_shape"]
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, pixel_values=vision["pixel_values"],
                    image_sizes=vision["image_sizes"], output_hidden_states=True, use_cache=False)
        embeds = model.model.embed_inputs(input_ids, vision["pixel_values"], vision["image_sizes"])
    for i, ref in enumerate(case["rows"]):
        valid = mask[i].bool()
        logits = out.logits[i][valid].double()
        torch.testing.assert_close(logits[ref["positions"]], torch.tensor(ref["logits"], dtype=torch.float64), atol=ATOL, rtol=0)
        assert float(logits.sum()) == pytest.approx(ref["logits_sum"], abs=ATOL * logits.numel())
        assert float((logits * logits).sum()) == pytest.approx(ref["logits_sum_sq"], rel=1e-5)
        torch.testing.assert_close(out.hidden_states[-1][i][valid][-1].double(), torch.tensor(ref["last_hidden"], dtype=torch.float64),
                                   atol=ATOL, rtol=0)
        image = embeds[i][input_ids[i] < 0].double()
        torch.testing.assert_close(image[:3], torch.tensor(ref["image_embeds_first"], dtype=torch.float64), atol=ATOL, rtol=0)
        assert float(image.sum()) == pytest.approx(ref["image_embeds_sum"], abs=ATOL * image.numel())
        assert float((image * image).sum()) == pytest.approx(ref["image_embeds_sum_sq"], rel=1e-5)


def test_merge_2x2_layout():
    # 2 crops (1 x 2) of a 4 x 4 patch grid, 1 channel: patch value = crop * 100 + row * 10 + col
    crop, row, col = torch.meshgrid(torch.arange(2), torch.arange(4), torch.arange(4), indexing="ij")
    features = (crop * 100 + row * 10 + col).reshape(2, 16, 1).float()
    merged = merge_2x2(features, 1, 2)
    assert merged.shape == (1, 2, 4, 4)
    assert merged[0, 0, 0].tolist() == [0, 1, 10, 11]  # the 2 x 2 block, row-major
    assert merged[0, 1, 3].tolist() == [122, 123, 132, 133]  # second crop sits to the right


def test_unsupported_vision_settings_and_placeholder_mismatch(model):
    config = tiny_config()
    config.embd_layer = {**config.embd_layer, "hd_transform_order": "glb_sub"}
    with pytest.raises(ValueError, match="sub_glb"):
        check_vision_config(config)
    rows = SIDE.CASES["landscape"]["rows"]
    vision = SIDE.image_batch(rows, 4)
    input_ids, _ = SIDE.case_inputs(rows, [vision["num_img_tokens"][0] - 1])
    with pytest.raises(ValueError, match="image placeholders"):
        model.model.embed_inputs(input_ids, vision["pixel_values"], vision["image_sizes"])
    with pytest.raises(ValueError, match="no pixel_values"):
        model.model.embed_inputs(input_ids)


# ------------------------------------------------ LLaVA-Reward on the native Phi-3.5-vision backbone


def tiny_phi_backbone(folder, tokenizer):
    """A Phi-3.5-vision folder as on the hub: config.json (model_type phi3_v), model.safetensors under
    the checkpoint's key names, the tokenizer. Narrow CLIP (336 px, 14 px patches: 144 tokens a crop)."""
    config = Phi3VConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
        img_processor={"image_dim_out": 16, "model_name": "openai/clip-vit-large-patch14-336", "name": "clip_vision_model",
                       "num_img_tokens": 144, "clip_config": {"hidden_size": 16, "intermediate_size": 32,
                                                              "num_attention_heads": 2, "num_hidden_layers": 2}},
    )
    torch.manual_seed(0)
    backbone = Phi3VForCausalLM(config)
    folder.mkdir()
    config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in backbone.state_dict().items()}, str(folder / "model.safetensors"))
    tokenizer.save_pretrained(folder)
    return folder


def test_llava_reward_phi_checkpoint_loads_and_scores_without_remote_code(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "rewards" / "weights" / "shapes-clip"))
    base = tiny_phi_backbone(tmp_path / "base", tokenizer)
    # a "trained" reward model: LoRA on the LLM, SkipCA, value head, projector, all non-trivial
    reference = LlavaRewardModel.from_base(str(base), skip_cross_attention=True)
    assert isinstance(reference.processor, Phi3VInputs) and reference.processor.num_crops == 16  # the authors' crops
    reference.add_lora(rank=4, alpha=8, dropout=0.0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if any(k in name for k in ("lora_", "value_head", "W_", "img_projection")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    reference.eval()

    # the released layout: lora/ (PEFT names, base_model.model. prefix), pytorch_model.bin, reward_config.yaml
    ckpt = tmp_path / "llavareward_phi_alignment"
    (ckpt / "lora").mkdir(parents=True)
    reference.lora_config.save_pretrained(str(ckpt / "lora"))
    save_file({"base_model.model." + k: v for k, v in reference.lora_state_dict().items()},
              str(ckpt / "lora" / "adapter_model.safetensors"))
    head = reference.head_state_dict()
    assert "model.vision_embed_tokens.img_projection.0.weight" in head and "value_head.weight" in head
    torch.save(head, ckpt / "pytorch_model.bin")
    (ckpt / "reward_config.yaml").write_text(yaml.safe_dump(
        {"is_general_preference": False, "add_cross_attention": True, "value_head_dim": 1, "general_preference_tau": 0.1}))

    judge = LlavaReward(model=str(ckpt), base_model=str(base), trust_remote_code=False)
    prompts = ["a red circle", "a blue square"]
    imgs = [Image.new("RGB", (40, 30), "red"), Image.new("RGB", (20, 50), (0, 90, 200))]
    with torch.no_grad():
        expected = reference(prompts, imgs)
        scores = judge.score(prompts, imgs) * judge.scale
    assert torch.allclose(scores, expected, atol=1e-5), (scores, expected)
    assert expected[0] != expected[1]
    judge.model.set_adapters_enabled(False)  # the adapter was loaded and matters
    with torch.no_grad():
        assert not torch.allclose(judge.model(prompts, imgs), expected, atol=1e-4)


def test_full_size_hub_config_builds_the_checkpoint_layout(tmp_path):
    """The hub's config.json fields (Phi-3-vision layout: "su" rope with 48 factors, flash-attention
    default, auto_map) build the full-size model (on the meta device) with the remote code's names."""
    hub = {
        "architectures": ["Phi3VForCausalLM"], "auto_map": {"AutoConfig": "configuration_phi3_v.Phi3VConfig",
                                                             "AutoModelForCausalLM": "modeling_phi3_v.Phi3VForCausalLM"},
        "model_type": "phi3_v", "_attn_implementation": "flash_attention_2", "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "embd_layer": REFERENCE["text_config"]["embd_layer"], "embd_pdrop": 0.0, "hidden_act": "silu",
        "hidden_size": 3072, "img_processor": REFERENCE["text_config"]["img_processor"], "initializer_range": 0.02,
        "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 32, "original_max_position_embeddings": 4096, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
        "rope_scaling": {"long_factor": [1.0 + i for i in range(48)], "short_factor": [1.0 + i / 20 for i in range(48)],
                         "type": "su"},
        "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.38.1", "use_cache": True, "vocab_size": 32064,
    }
    (tmp_path / "config.json").write_text(json.dumps(hub))
    config = Phi3VConfig.from_pretrained(str(tmp_path))
    assert config.rope_parameters["rope_type"] == "longrope" and len(config.rope_parameters["long_factor"]) == 48
    with torch.device("meta"):
        full = Phi3VForCausalLM(config)
    shapes = {k: tuple(v.shape) for k, v in full.state_dict().items()}
    assert shapes["model.vision_embed_tokens.glb_GN"] == (1, 1, 4096)
    assert shapes["model.vision_embed_tokens.sub_GN"] == (1, 1, 1, 4096)
    assert shapes["model.vision_embed_tokens.img_projection.0.weight"] == (3072, 4096)
    assert shapes["model.vision_embed_tokens.img_processor.vision_model.embeddings.position_embedding.weight"] == (577, 1024)
    assert shapes["model.layers.31.self_attn.qkv_proj.weight"] == (3 * 3072, 3072)
    assert shapes["lm_head.weight"] == (32064, 3072)
    assert len(full.model.vision_embed_tokens.img_processor.vision_model.encoder.layers) == 24
    normalise = lambda keys: {re.sub(r"\.\d+\.", ".N.", k) for k in keys}  # noqa: E731
    assert normalise(shapes) == normalise(REFERENCE["shapes"])  # the remote model's names, at any depth


def test_checkpoint_that_does_not_fit_is_refused(checkpoint, tmp_path):
    state = load_file(str(checkpoint / "model.safetensors"))
    # older checkpoints store CLIP's position_ids buffer: tolerated
    state["model.vision_embed_tokens.img_processor.vision_model.embeddings.position_ids"] = torch.arange(577)[None]
    tiny_config().save_pretrained(tmp_path / "extra")
    save_file(state, str(tmp_path / "extra" / "model.safetensors"))
    load_phi3v(str(tmp_path / "extra"))
    del state["model.vision_embed_tokens.sub_GN"]  # a missing tensor is an error, not a random init
    tiny_config().save_pretrained(tmp_path / "missing")
    save_file(state, str(tmp_path / "missing" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"does not fit the native model: missing \['model.vision_embed_tokens.sub_GN'\]"):
        load_phi3v(str(tmp_path / "missing"))


def test_llava_reward_phi_trains_lora_and_projector_not_the_vision_tower(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "rewards" / "weights" / "shapes-clip"))
    base = tiny_phi_backbone(tmp_path / "base", tokenizer)
    model = LlavaRewardModel.from_base(str(base), skip_cross_attention=True, processor=Phi3VInputs(tokenizer, num_crops=1))
    model.add_lora(rank=4, alpha=8, dropout=0.0)
    model.init_reward_head()
    with torch.no_grad():  # a fresh LoRA B is zero, so A would get no gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    reward = model(["a red circle"], [Image.new("RGB", (30, 20), "red")])
    reward.sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert any("img_projection" in n for n in grads) and any("lora_A" in n for n in grads)
    assert all(g is not None and bool(g.abs().sum() > 0) for n, g in grads.items() if "img_projection" in n or "lora_" in n)
    assert not any("img_processor" in n or "glb_GN" in n for n in grads)  # the CLIP tower and separators stay frozen
