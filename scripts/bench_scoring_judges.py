"""Benchmark the scoring-model judges: CPU throughput with tiny random weights, and the
memory the real weights need (parameter count x bytes per parameter).

    python scripts/bench_scoring_judges.py [--images 32] [--batch-size 16] [--repeats 3]

Throughput uses tiny models of the real classes (a few hundred thousand parameters), so it
measures each adapter's own overhead (decoding, resizing, tokenizing, batching), not the
speed of the real networks. Parameter counts come from the real architectures built on the
meta device (no weights are downloaded or allocated). Memory is for the weights only;
activations add to it with the batch size.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    BertTokenizer,
    BlipConfig,
    BlipForImageTextRetrieval,
    BlipImageProcessor,
    BlipProcessor,
    BlipVisionConfig,
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPProcessor,
)

import rewards
from align.run_folder import atomic_write_text
from align.testbed.tokenizer import build_tokenizer
from rewards.checkpoint_keys import ScoreMLP
from rewards.clip import ClipEmbedder, ClipSimilarity
from rewards.hps import letterbox_pixels
from rewards.imagereward import (
    IMAGE_REWARD_MEAN,
    IMAGE_REWARD_STD,
    BlipRewardJudge,
    ImageRewardModel,
    text_config_from_med_config,
)

WORDS = ["a", "red", "blue", "green", "circle", "square", "photo", "of", "cat", "on", "the", "left"]


# --- tiny models of the real classes --------------------------------------------------------

def clip_tokenizer():
    return build_tokenizer(WORDS)


def tiny_clip_folder(folder: Path, image_size: int = 32, hidden_act: str = "quick_gelu") -> Path:

    tok = clip_tokenizer()
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, hidden_act=hidden_act, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                           image_size=image_size, patch_size=8, hidden_act=hidden_act),
        projection_dim=16,
    )
    CLIPModel(config).save_pretrained(folder)
    images = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    CLIPProcessor(image_processor=images, tokenizer=tok).save_pretrained(folder)
    return folder


def bert_tokenizer_folder(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tok = BertTokenizer(str(folder / "vocab.txt"))
    tok.save_pretrained(folder)
    return tok


def tiny_blip_folder(folder: Path) -> Path:

    tok = bert_tokenizer_folder(folder)
    config = BlipConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=64),
        vision_config=dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        image_text_hidden_size=16,
    )
    BlipForImageTextRetrieval(config).save_pretrained(folder)
    BlipProcessor(image_processor=BlipImageProcessor(size={"height": 32, "width": 32}), tokenizer=tok).save_pretrained(folder)
    return folder


def tiny_judges(root: Path, batch_size: int) -> dict:
    """name -> judge on tiny weights (hps and imagereward built in memory: their loaders only remap keys)."""
    opts = dict(device="cpu", dtype="float32", batch_size=batch_size)
    clip = tiny_clip_folder(root / "clip")
    gelu_clip = tiny_clip_folder(root / "clip-gelu", hidden_act="gelu")
    head = root / "head.pth"
    torch.save(ScoreMLP(16).state_dict(), head)
    judges = {
        "clip": rewards.load("clip", model=str(clip), **opts),
        "pickscore": rewards.load("pickscore", model=str(clip), processor=str(clip), **opts),
        "shapes-clip": rewards.load("shapes-clip", model=str(clip), **opts),
        "aesthetic": rewards.load("aesthetic", model=str(head), clip_model=str(clip), **opts),
        "blip": rewards.load("blip", model=str(tiny_blip_folder(root / "blip")), **opts),
    }
    hps_embedder = ClipEmbedder.load(gelu_clip, device="cpu", dtype="float32", batch_size=batch_size, judge="hps")
    hps_embedder.pixel_fn = lambda imgs: letterbox_pixels(imgs, 32, (0.48145466, 0.4578275, 0.40821073),
                                                          (0.26862954, 0.26130258, 0.27577711))
    judges["hps"] = ClipSimilarity(hps_embedder, "hps", "cosine")

    tok = bert_tokenizer_folder(root / "bert")
    med = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               max_position_embeddings=40)
    vision = BlipVisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, layer_norm_eps=1e-6)
    net = ImageRewardModel(vision, text_config_from_med_config(med, 128))
    judges["imagereward"] = BlipRewardJudge(net, tok, "imagereward", IMAGE_REWARD_MEAN, IMAGE_REWARD_STD,
                                            torch.device("cpu"), torch.float32, batch_size, 0.0)
    return judges


def images_per_second(judge, images, prompts, repeats: int) -> float:
    judge.score(prompts[:2], images[:2])  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        judge.score(prompts, images)
        best = min(best, time.perf_counter() - start)
    return len(images) / best


# --- real architectures on the meta device ----------------------------------------------------

def real_parameter_counts() -> dict[str, int]:

    clip_l14 = CLIPConfig(  # openai/clip-vit-large-patch14
        text_config=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12),
        vision_config=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24,
                           image_size=224, patch_size=14),
        projection_dim=768,
    )
    clip_h14 = CLIPConfig(  # laion/CLIP-ViT-H-14-laion2B-s32B-b79K (PickScore_v1 and HPS v2.1 share it)
        text_config=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24),
        vision_config=dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=16, num_hidden_layers=32,
                           image_size=224, patch_size=14),
        projection_dim=1024,
    )
    blip_itm = BlipConfig(  # Salesforce/blip-itm-base-coco: ViT-B/16 at 384 px + BERT-base
        text_config=dict(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                         num_attention_heads=12, max_position_embeddings=512),
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           image_size=384, patch_size=16),
        image_text_hidden_size=256,
    )
    med = dict(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
               max_position_embeddings=512)
    vit_l16 = BlipVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                               image_size=224, patch_size=16, layer_norm_eps=1e-6)

    def count(module) -> int:
        return sum(p.numel() for p in module.parameters())

    with torch.device("meta"):
        counts = {
            "clip": count(CLIPModel(clip_l14)),
            "pickscore": count(CLIPModel(clip_h14)),
            "hps": count(CLIPModel(clip_h14)),
            "blip": count(BlipForImageTextRetrieval(blip_itm)),
            "imagereward": count(ImageRewardModel(vit_l16, text_config_from_med_config(med, 1024))),
            # the adapter loads the whole CLIPModel (text tower unused) plus the head
            "aesthetic": count(CLIPModel(clip_l14)) + count(ScoreMLP(768)),
        }
    counts["vpscore"] = counts["imagereward"]  # if its checkpoint has ImageReward's layout (unverified)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", type=int, default=256, help="side of the random input images in pixels")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)) for _ in range(args.images)]
    prompts = [f"a red circle number {i}" for i in range(args.images)]
    counts = real_parameter_counts()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, judge in tiny_judges(Path(tmp), args.batch_size).items():
            rows.append(dict(judge=name, tiny_images_per_s=images_per_second(judge, images, prompts, args.repeats)))
    rows.append(dict(judge="vpscore", tiny_images_per_s=next(r["tiny_images_per_s"] for r in rows if r["judge"] == "imagereward")))
    print(f"CPU threads: {torch.get_num_threads()}, {args.images} images of {args.size}x{args.size} px, batch {args.batch_size}")
    print(f"{'judge':<12} {'tiny img/s':>10} {'real params':>12} {'fp32 GiB':>9} {'fp16 GiB':>9}")
    for row in rows:
        n = counts.get(row["judge"])
        row.update(real_params=n, fp32_gib=n * 4 / 2**30 if n else None, fp16_gib=n * 2 / 2**30 if n else None)
        real = f"{n / 1e6:>11.1f}M {row['fp32_gib']:>9.2f} {row['fp16_gib']:>9.2f}" if n else f"{'(testbed)':>12}"
        print(f"{row['judge']:<12} {row['tiny_images_per_s']:>10.1f} {real}")
    print("vpscore: same adapter as imagereward (throughput copied; size assumes ImageReward's layout, unverified)")
    if args.json:  # atomically: a reader never sees half a file

        atomic_write_text(args.json, json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
