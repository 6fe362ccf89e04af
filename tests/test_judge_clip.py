"""CLIP-family judges (clip, pickscore, aesthetic, shapes-clip) on tiny random CLIP models."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from transformers import AutoProcessor, BertConfig, CLIPModel

import rewards
from align.testing.tiny_judges import clip_tokenizer, images_as_tensor, random_images, save_tiny_clip
from rewards import clip as clip_module
from rewards.checkpoint_keys import CheckpointLayoutError, ScoreMLP, aesthetic_mlp_keys
from rewards.weights import MissingWeightsError

PROMPTS = ["a red circle", "a blue square on the left", "a green triangle", "a photo of a cat"]


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-clip")
    save_tiny_clip(folder, seed=1)
    return folder


def reference_cosines(folder, prompts, images):
    """The cosine computed directly with transformers, as its documentation shows."""
    model = CLIPModel.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    inputs = processor(text=prompts, images=images, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**inputs)
    img = out.image_embeds / out.image_embeds.norm(dim=-1, keepdim=True)
    txt = out.text_embeds / out.text_embeds.norm(dim=-1, keepdim=True)
    return (img * txt).sum(-1), float(model.logit_scale.detach().exp())


def test_clip_score_matches_transformers_reference(clip_folder):
    images = random_images(4)
    judge = rewards.load("clip", model=str(clip_folder), device="cpu", batch_size=3)
    scores = judge.score(PROMPTS, images)
    expected, _ = reference_cosines(clip_folder, PROMPTS, images)
    assert scores.shape == (4,)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    # random embeddings of 4 different pairs are not all equal
    assert scores.std() > 1e-4


def test_tensor_images_score_like_pil_and_batch_size_does_not_matter(clip_folder):
    images = random_images(4, seed=3)
    one = rewards.load("clip", model=str(clip_folder), device="cpu", batch_size=1)
    many = rewards.load("clip", model=str(clip_folder), device="cpu", batch_size=16)
    from_pil = one.score(PROMPTS, images)
    torch.testing.assert_close(many.score(PROMPTS, images_as_tensor(images)), from_pil, atol=1e-5, rtol=1e-4)


def test_clip_s_variant_and_pickscore_scaling(clip_folder):
    images = random_images(4, seed=5)
    cos, logit_scale = reference_cosines(clip_folder, PROMPTS, images)
    clip_s = rewards.load("clip", model=str(clip_folder), variant="clip-s", device="cpu").score(PROMPTS, images)
    torch.testing.assert_close(clip_s, 2.5 * cos.clamp(min=0), atol=1e-5, rtol=1e-4)
    pick = rewards.load("pickscore", model=str(clip_folder), processor=str(clip_folder), device="cpu")
    torch.testing.assert_close(pick.score(PROMPTS, images), logit_scale * cos, atol=1e-4, rtol=1e-4)


def test_compare_follows_score_with_tie_margin(clip_folder):
    a, b = random_images(4, seed=7), random_images(4, seed=8)
    judge = rewards.load("clip", model=str(clip_folder), device="cpu")
    sa, sb = judge.score(PROMPTS, a), judge.score(PROMPTS, b)
    prefs = judge.compare(PROMPTS, a, b)
    assert [p.winner for p in prefs] == [0 if x > y else 1 for x, y in zip(sa, sb)]
    tied = rewards.load("clip", model=str(clip_folder), device="cpu", tie_margin=10.0).compare(PROMPTS, a, b)
    assert all(p.tie and p.winner is None for p in tied)


def test_shapes_clip_respects_saved_32px_processor(tmp_path, monkeypatch):
    folder = tmp_path / "shapes-clip"
    save_tiny_clip(folder, seed=2, image_size=32, patch_size=8)
    monkeypatch.setattr(clip_module, "SHAPES_CLIP_FOLDER", folder)
    judge = rewards.load("shapes-clip", model=str(folder))
    images = random_images(3, size=(64, 48))
    pixels = judge.embedder.processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    assert pixels.shape == (3, 3, 32, 32)  # no 224 resize: the folder's own config
    expected, _ = reference_cosines(folder, PROMPTS[:3], images)
    torch.testing.assert_close(judge.score(PROMPTS[:3], images), expected, atol=1e-5, rtol=1e-4)


def test_shapes_clip_without_weights_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(clip_module, "SHAPES_CLIP_FOLDER", tmp_path / "not-built")
    with pytest.raises(MissingWeightsError, match="not built yet"):
        rewards.load("shapes-clip", model=tmp_path / "not-built")


def test_aesthetic_head_loads_from_the_authors_pth_layout(clip_folder, tmp_path):
    torch.manual_seed(0)
    head = ScoreMLP(16)
    # the authors' file is a bare OrderedDict state_dict of the Sequential named "layers"
    path = tmp_path / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(OrderedDict((k, v.clone()) for k, v in head.state_dict().items()), path)
    judge = rewards.load("aesthetic", model=str(path), clip_model=str(clip_folder), device="cpu")
    images = random_images(3, seed=11)
    scores = judge.score(["ignored"] * 3, images)
    # reference: the head's five linear maps applied by hand to the normalised embedding
    model = CLIPModel.from_pretrained(clip_folder).eval()
    pixels = AutoProcessor.from_pretrained(clip_folder)(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        x = model.get_image_features(pixel_values=pixels).pooler_output
        x = x / x.norm(dim=-1, keepdim=True)
        state = torch.load(path, weights_only=True)
        for i in (0, 2, 4, 6, 7):
            x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    torch.testing.assert_close(scores, x.squeeze(-1), atol=1e-5, rtol=1e-4)
    # the folder form (folder + default filename) loads the same head
    folder_judge = rewards.load("aesthetic", model=str(tmp_path), clip_model=str(clip_folder), device="cpu")
    torch.testing.assert_close(folder_judge.score(["x"] * 3, images), scores)


# The real sac+logos+ava1-l14-linearMSE.pth layout (keys and shapes), written out by hand.
REAL_AESTHETIC_LAYOUT = {
    "layers.0.weight": (1024, 768), "layers.0.bias": (1024,),
    "layers.2.weight": (128, 1024), "layers.2.bias": (128,),
    "layers.4.weight": (64, 128), "layers.4.bias": (64,),
    "layers.6.weight": (16, 64), "layers.6.bias": (16,),
    "layers.7.weight": (1, 16), "layers.7.bias": (1,),
}


def test_real_aesthetic_layout_is_consumed_and_loads_strictly():
    state = {k: torch.zeros(shape) for k, shape in REAL_AESTHETIC_LAYOUT.items()}
    mapped = aesthetic_mlp_keys(state)
    ScoreMLP(768).load_state_dict(mapped, strict=True)
    with pytest.raises(CheckpointLayoutError, match="visual.proj"):
        aesthetic_mlp_keys({**state, "visual.proj": torch.zeros(1)})


def test_aesthetic_head_of_wrong_width_is_refused(clip_folder, tmp_path):
    path = tmp_path / "head.pth"
    torch.save(ScoreMLP(768).state_dict(), path)
    with pytest.raises(ValueError, match="768-d"):
        rewards.load("aesthetic", model=str(path), clip_model=str(clip_folder), device="cpu")


def test_bad_inputs_get_clear_errors(clip_folder, tmp_path):
    with pytest.raises(ValueError, match="unknown variant 'cos'"):
        rewards.load("clip", model=str(clip_folder), variant="cos")
    with pytest.raises(MissingWeightsError, match="no-such-folder"):
        rewards.load("clip", model=str(tmp_path / "no-such-folder"))
    with pytest.raises(MissingWeightsError, match="HF_HUB_OFFLINE"):  # conftest: tests never download
        rewards.load("clip", model="nobody/no-such-clip")
    with pytest.raises(MissingWeightsError, match="torch hub cache"):
        rewards.load("aesthetic", model="https://example.invalid/head.pth", filename="no-such-head.pth",
                      clip_model=str(clip_folder), device="cpu")
    judge = rewards.load("clip", model=str(clip_folder), device="cpu")
    with pytest.raises(ValueError, match="2 prompts for 3 images"):
        judge.score(PROMPTS[:2], random_images(3))
    with pytest.raises(TypeError, match="list of strings"):
        judge.score("a red circle", random_images(1))


def test_a_folder_of_another_model_type_is_refused(tmp_path):
    BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'bert' model"):
        rewards.load("clip", model=str(tmp_path))


def test_tokenizer_words_are_single_tokens():
    # guards the fixture: prompts above must tokenize to whole words for the tiny text encoder
    tok = clip_tokenizer()
    assert len(tok("a red circle")["input_ids"]) == 5
