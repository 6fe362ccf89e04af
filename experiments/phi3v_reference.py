"""Reference outputs of Phi-3.5-vision's remote modelling code at random weights, for
tests/test_phi3v_model.py (the native rewards/phi3v.py must reproduce them).

Runs in a side environment with the transformers version the remote code was written for (it does
not import under transformers 5), e.g.:

    python3 -m venv /work/sidevenv-phi
    echo /work/main/.venv/lib/python3.11/site-packages > /work/sidevenv-phi/lib/python3.11/site-packages/zz_main.pth
    /work/sidevenv-phi/bin/pip install --no-deps transformers==4.44.2 tokenizers==0.19.1 huggingface_hub==0.24.7
    PYTHONPATH=$PWD /work/sidevenv-phi/bin/python -m experiments.phi3v_reference \
        --remote DIR --out tests/data/phi3v_model_reference.json

DIR holds configuration_phi3_v.py and modeling_phi3_v.py (as vendored in github.com/sjz5202/LLaVA-Reward,
llava_reward/models/base_mllm/phi3_v/, the copy LLaVA-Reward runs; its Phi3ImageEmbedding is the
hub file's image_embedding_phi3_v.py inlined, and its model appends the image embeddings to the
hidden states, which does not change the logits).

The weights are not stored: ``seeded_weights`` draws every tensor from a fixed seed in sorted key
order, so the test rebuilds the same weights under transformers 5. The vision tower must keep the
ViT-L/14-336 widths (1024-d, 24 x 24 patches: the remote code asserts them), so only its depth and
MLP width are cut.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from experiments import fidelity_reference_phi3v as phi_inputs

SEED = 39
SMALL_CLIP = dict(num_hidden_layers=2, intermediate_size=64)  # widths as ViT-L/14-336
# The text model: small, with GQA and Phi-3.5's "su" (longrope) scaling, so both paths are exercised.
TEXT_CONFIG = dict(
    vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=131072, original_max_position_embeddings=4096,
    rope_theta=10000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=262144,
    rope_scaling={"type": "su", "short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6],
                  "long_factor": [1.0, 1.5, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0]},
    embd_layer={"embedding_cls": "image", "hd_transform_order": "sub_glb", "projection_cls": "mlp",
                "use_hd_transform": True, "with_learnable_separator": True},
    img_processor={"image_dim_out": 1024, "model_name": "openai/clip-vit-large-patch14-336",
                   "name": "clip_vision_model", "num_img_tokens": 144},
)
# cases: rows of (image index in phi_inputs.IMAGE_SIZES, text ids before, text ids after), the processor's
# num_crops, and text-config overrides. Grids: 2 x 2 crops, 2 x 2 + 1 x 4 in one batch, 4 x 3 (16 crops);
# "long_rope" puts the sequence past original_max_position_embeddings (the "su" long factors).
CASES = {
    "landscape": {"rows": [(0, [1, 5, 6], [7, 8, 9, 2])], "num_crops": 4, "overrides": {}},
    "portrait_and_wide_batch": {"rows": [(1, [1, 10], [11, 12, 2]), (4, [1, 13, 14, 15], [16, 2])], "num_crops": 4,
                                "overrides": {}},
    "portrait_16_crops": {"rows": [(1, [1, 17], [18, 2])], "num_crops": 16, "overrides": {}},
    "long_rope": {"rows": [(0, [1, 5, 6], [7, 8, 9, 2])], "num_crops": 4,
                  "overrides": {"original_max_position_embeddings": 512}},
}


def seeded_weights(shapes: dict[str, list[int]], seed: int = SEED) -> dict[str, torch.Tensor]:
    """Every tensor N(0, 0.02) (norm weights 1 + N(0, 0.02)) from one generator, in sorted key order."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for key in sorted(shapes):
        values = torch.randn(shapes[key], generator=generator, dtype=torch.float32) * 0.02
        if "norm" in key and key.endswith("weight"):
            values += 1.0
        weights[key] = values
    return weights


def sample_positions(ids: torch.Tensor) -> list[int]:
    """Positions whose logits are kept: every text position and every 61st image position."""
    return [p for p in range(len(ids)) if ids[p] >= 0 or p % 61 == 0]


def case_inputs(rows: list[tuple[int, list[int], list[int]]], num_image_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids / attention_mask, right-padded with id 0; image k of the batch is placeholder -1 of its row
    (one image per row, as the processor writes it)."""
    ids = [before + [-1] * num_image_tokens[i] + after for i, (_, before, after) in enumerate(rows)]
    longest = max(len(x) for x in ids)
    input_ids = torch.tensor([x + [0] * (longest - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (longest - len(x)) for x in ids])
    return input_ids, mask


def image_batch(rows, num_crops: int):
    from rewards.phi3v_processor import image_inputs

    images = phi_inputs.fixed_images()
    return image_inputs([images[index] for index, _, _ in rows], num_crops)


def _remote_package(folder: Path):
    """Import the remote files as a package (modeling_phi3_v imports .configuration_phi3_v)."""
    root = Path(tempfile.mkdtemp())
    package = root / "phi3v_remote"
    package.mkdir()
    for name in ("configuration_phi3_v.py", "modeling_phi3_v.py"):
        shutil.copy(folder / name, package / name)
    (package / "__init__.py").write_text("")
    sys.path.insert(0, str(root))
    return importlib.import_module("phi3v_remote.configuration_phi3_v"), importlib.import_module("phi3v_remote.modeling_phi3_v")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--remote", type=Path, required=True, help="folder with configuration_phi3_v.py and modeling_phi3_v.py")
    parser.add_argument("--out", type=Path, default=Path("tests/data/phi3v_model_reference.json"))
    args = parser.parse_args()
    configuration, modeling = _remote_package(args.remote)
    from transformers import CLIPVisionConfig

    base = modeling.CLIP_VIT_LARGE_PATCH14_336_CONFIG.to_dict()
    modeling.CLIP_VIT_LARGE_PATCH14_336_CONFIG = CLIPVisionConfig(**{**base, **SMALL_CLIP})

    def build(overrides):
        config = configuration.Phi3VConfig(**{**TEXT_CONFIG, **overrides})
        config._attn_implementation = "eager"
        model = modeling.Phi3VForCausalLM(config).eval()
        # the checkpoint's keys: the embedding shared with vision_embed_tokens.wte is stored once
        shapes = {k: list(v.shape) for k, v in model.state_dict().items() if ".wte." not in k}
        model.load_state_dict(seeded_weights(shapes), strict=False)
        torch.testing.assert_close(model.model.vision_embed_tokens.wte.weight, model.model.embed_tokens.weight)
        return model, shapes

    result = {"transformers": __import__("transformers").__version__, "seed": SEED, "small_clip": SMALL_CLIP,
              "text_config": TEXT_CONFIG, "shapes": build({})[1], "cases": {}}
    with torch.no_grad():
        for name, spec in CASES.items():
            model, _ = build(spec["overrides"])
            rows = spec["rows"]
            vision = image_batch(rows, spec["num_crops"])
            input_ids, mask = case_inputs(rows, vision["num_img_tokens"])
            out = model(input_ids=input_ids, attention_mask=mask, pixel_values=vision["pixel_values"],
                        image_sizes=vision["image_sizes"], output_hidden_states=True, use_cache=False)
            embeds = out.hidden_states[0]
            rows_out = []
            for i in range(len(rows)):
                valid = mask[i].bool()
                logits, ids = out.logits[i][valid].double(), input_ids[i][valid]
                picked = sample_positions(ids)
                image = embeds[i][input_ids[i] < 0].double()
                rows_out.append({
                    "positions": picked, "logits": logits[picked].tolist(),
                    "logits_sum": float(logits.sum()), "logits_sum_sq": float((logits * logits).sum()),
                    "last_hidden": out.hidden_states[-2][i][valid][-1].tolist(),
                    "image_embeds_sum": float(image.sum()), "image_embeds_sum_sq": float((image * image).sum()),
                    "image_embeds_first": image[:3].tolist(),
                })
            result["cases"][name] = {"input_shape": list(input_ids.shape), "num_img_tokens": vision["num_img_tokens"],
                                     "rows": rows_out}
            print(name, tuple(input_ids.shape), float(out.logits.abs().mean()))
    args.out.write_text(json.dumps(result))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
