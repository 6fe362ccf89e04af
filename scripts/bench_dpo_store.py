"""Diffusion-DPO from a precomputed latent store vs diffusers' train_diffusion_dpo.py, side by side.

    python scripts/bench_dpo_store.py --resolution 256 --steps 4
    python scripts/bench_dpo_store.py --resolution 512 --steps 3          # SD v1.5's own size (slow on a CPU)

Target (issue 37): training from the store costs <= 1/1.3 of the peer's time per step at <= its peak
memory. Both sides train LoRA (rank 4, to_q/to_k/to_v/to_out.0, adapter-disabled reference), one pair
per step, fp32, on one SD v1.5-architecture pipeline with random weights (UNet, VAE and a 12-layer
CLIP text encoder from SD v1.5's configs; a character tokenizer), built once, with no download.
- peer: ../shared/peers/train_diffusion_dpo.py: VAE-encodes both images and the caption every step;
- ours: `align/dpo.py --latent_store` on a store built beforehand by `python -m align.precompute`
  (not timed: it is paid once per dataset, not per step).
Time per step: the median interval between optimizer steps (a torch optimizer-step hook), first step
excluded. Peak memory: the process's peak RSS. Each side runs in its own fresh process, one after
the other, in this same environment.

The peer imports torchvision for its transforms, and the PyPI torchvision wheel does not import beside
the CPU torch 2.13.0 wheel. The peer's process therefore gets a small stand-in `torchvision.transforms`
(Resize, CenterCrop, RandomHorizontalFlip, ToTensor, Normalize on PIL images, written below), put in
its sys.modules only, after transformers and diffusers were imported (so they see no torchvision). It does what torchvision does on PIL images (PIL's bilinear resize, a crop, a flip, a
conversion to a float tensor) and touches nothing in the timed training step.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from PIL import Image
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.flop_counter import FlopCounterMode
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from align.testing.sd15 import SD15_UNET
from align.testing.tiny_sd import write_char_tokenizer

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT.parent.parent / "shared" / "peers" / "train_diffusion_dpo.py"

TRANSFORMS_STANDIN = '''"""Stand-in for torchvision.transforms on PIL images (bench_dpo_store.py; the real wheel does not import here)."""
import enum
import random

import numpy as np
import torch
from PIL import Image


class InterpolationMode(enum.Enum):
    BILINEAR = "bilinear"


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class Resize:
    def __init__(self, size, interpolation=InterpolationMode.BILINEAR):
        self.size = size

    def __call__(self, image):
        w, h = image.size
        if w <= h:
            size = (self.size, int(self.size * h / w))
        else:
            size = (int(self.size * w / h), self.size)
        return image.resize(size, Image.BILINEAR)


class CenterCrop:
    def __init__(self, size):
        self.size = size

    def __call__(self, image):
        w, h = image.size
        left, top = int(round((w - self.size) / 2.0)), int(round((h - self.size) / 2.0))
        return image.crop((left, top, left + self.size, top + self.size))


class RandomCrop(CenterCrop):
    def __call__(self, image):
        w, h = image.size
        left, top = random.randint(0, w - self.size), random.randint(0, h - self.size)
        return image.crop((left, top, left + self.size, top + self.size))


class Lambda:
    def __init__(self, fn):
        self.fn = fn

    def __call__(self, x):
        return self.fn(x)


class RandomHorizontalFlip:
    def __call__(self, image):
        return image.transpose(Image.FLIP_LEFT_RIGHT) if torch.rand(1) < 0.5 else image


class ToTensor:
    def __call__(self, image):
        return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float().div(255)


class Normalize:
    def __init__(self, mean, std):
        self.mean, self.std = mean[0], std[0]

    def __call__(self, x):
        return (x - self.mean) / self.std
'''

# SD v1.5's configs (runwayml/stable-diffusion-v1-5 unet/, vae/ and text_encoder/ config.json values).
SD15_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, sample_size=512,
                block_out_channels=(128, 256, 512, 512), norm_num_groups=32, scaling_factor=0.18215,
                down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
SD15_TEXT = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)


def build_sd15_pipeline(folder: Path) -> Path:
    """An SD v1.5-architecture pipeline with random weights, saved as a diffusers folder."""
    torch.manual_seed(0)
    write_char_tokenizer(folder / "tokenizer")
    tokenizer = CLIPTokenizer.from_pretrained(folder / "tokenizer")
    text = CLIPTextModel(CLIPTextConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, **SD15_TEXT))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=AutoencoderKL(**SD15_VAE), text_encoder=text, tokenizer=tokenizer,
                                   unet=UNet2DConditionModel(**SD15_UNET), scheduler=scheduler, safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(folder)
    return folder


def count_step_flops(resolution: int) -> dict:
    """Counted FLOPs of one step of each side, on the meta device (no weights, no compute): what bounds the ratio.

    Both sides: the policy's UNet forward and backward on the pair's 2 images and the reference's forward on them.
    LoRA's backward is counted as the UNet's input-gradient backward (frozen weights; the rank-4 adapters' own
    gradients are < 0.1% of it). The peer adds, per step, the VAE encoder on the 2 images and the text encoder on
    the caption, which the store has done once beforehand.
    """
    def counted(fn) -> int:
        counter = FlopCounterMode(display=False)
        with counter:
            fn()
        return int(counter.get_total_flops())

    with torch.device("meta"):
        unet = UNet2DConditionModel(**SD15_UNET).requires_grad_(False)
        vae = AutoencoderKL(**SD15_VAE).requires_grad_(False)
        text = CLIPTextModel(CLIPTextConfig(vocab_size=49408, **SD15_TEXT)).requires_grad_(False)
    side = resolution // 8
    latents = torch.zeros((2, 4, side, side), device="meta", requires_grad=True)
    timesteps = torch.full((2,), 500, device="meta")
    embeds = torch.zeros((2, 77, 768), device="meta")

    def policy_forward_backward():
        unet(latents, timesteps, embeds).sample.sum().backward()

    with torch.no_grad():
        reference = counted(lambda: unet(latents, timesteps, embeds))
        vae_encode = counted(lambda: vae.encode(torch.zeros((2, 3, resolution, resolution), device="meta")))
        text_encode = counted(lambda: text(torch.zeros((1, 77), dtype=torch.long, device="meta")))
    ours = counted(policy_forward_backward) + reference
    return {"ours": ours, "peer": ours + vae_encode + text_encode, "unet_forward_2_images": reference,
            "vae_encode_2_images": vae_encode, "text_encode": text_encode}


def write_pairs(path: Path, count: int, size: int) -> None:


    rng = np.random.default_rng(0)

    def jpeg():
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buffer, format="JPEG", quality=90)
        return buffer.getvalue()

    rows = [{"caption": f"a photo number {i}", "jpg_0": jpeg(), "jpg_1": jpeg(), "label_0": float(i % 2),
             "label_1": float(1 - i % 2)} for i in range(count)]
    pq.write_table(pa.Table.from_pylist(rows), path)


def install_transforms_standin() -> None:
    """Give the peer `torchvision.transforms` without telling transformers/diffusers that torchvision
    exists: they are imported first (their availability checks run then), the stand-in after."""
    # imported before the stand-in exists, so their torchvision checks see none
    import accelerate  # noqa: F401, PLC0415
    import datasets  # noqa: F401, PLC0415
    import diffusers  # noqa: F401, PLC0415
    import peft  # noqa: F401, PLC0415
    import transformers  # noqa: F401, PLC0415

    transforms = types.ModuleType("torchvision.transforms")
    exec(compile(TRANSFORMS_STANDIN, "torchvision_transforms_standin.py", "exec"), transforms.__dict__)
    package = types.ModuleType("torchvision")
    package.transforms = transforms
    sys.modules["torchvision"], sys.modules["torchvision.transforms"] = package, transforms


def timed_run(script: Path, argv: list[str]) -> dict:
    """Run a training script in this process; the time of each optimizer step and the peak RSS."""
    if script == PEER:
        install_transforms_standin()
    stamps = []
    register_optimizer_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    sys.argv = [str(script), *argv]
    runpy.run_path(str(script), run_name="__main__")
    intervals = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"seconds_per_step": statistics.median(intervals), "steps": len(stamps),
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def side(name: str, model: Path, data: Path, store: Path, out: Path, args) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(out / "datasets_cache"), PYTHONPATH=str(ROOT),
               WANDB_MODE="offline")
    if name == "peer":
        script, argv = PEER, [
            "--pretrained_model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out / "peer"),
            "--resolution", str(args.resolution), "--train_batch_size", "1", "--gradient_accumulation_steps", "1",
            "--max_train_steps", str(args.steps), "--learning_rate", "1e-5", "--lr_warmup_steps", "0", "--rank", "4",
            "--beta_dpo", "2500", "--checkpointing_steps", "100000", "--seed", "0", "--report_to", "tensorboard",
            "--vae_encode_batch_size", "2"]
    else:
        script, argv = ROOT / "align" / "dpo.py", [
            "--model", str(model), "--latent_store", str(store), "--output-dir", str(out / "ours"),
            "--resolution", str(args.resolution), "--finetune", "lora", "--lora_rank", "4", "--train_batch_size", "1",
            "--gradient_accumulation_steps", "1", "--max_steps", str(args.steps), "--learning_rate", "1e-5",
            "--scale_lr", "false", "--lr_warmup_steps", "0", "--beta", "5000", "--checkpointing_steps", "100000",
            "--report_to", "none", "--seed", "0"]
    cmd = [sys.executable, __file__, "--one", str(script), "--", *argv]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per side (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side, in alternating order")
    parser.add_argument("--workdir", help="keep the model, data and store here (default: a temporary folder)")
    parser.add_argument("--count_flops", action="store_true",
                        help="only count each side's FLOPs per step at --resolution on the meta device, and exit")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.count_flops:
        counts = count_step_flops(args.resolution)
        for key, value in counts.items():
            print(f"{key:22s} {value / 1e9:10.1f} GFLOP per step   ({args.resolution} px, counted on the meta device)")
        print(f"store / peer: FLOPs per step {counts['ours'] / counts['peer']:.2f}x: the time ratio of a compute-bound "
              f"step (target <= {1 / 1.3:.2f})", flush=True)
        return
    if args.one:
        result = timed_run(Path(args.one), [a for a in rest if a != "--"])
        print(json.dumps(result), flush=True)
        return
    if not PEER.is_file():
        raise SystemExit(f"the peer script is not at {PEER}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = work / "sd15_random"
        if not (model / "model_index.json").is_file():
            build_sd15_pipeline(model)
        data = work / "pairs.parquet"
        store = work / f"store_{args.resolution}"
        if not data.is_file() or not store.exists():  # a rewritten file is other data to the store's fingerprint
            write_pairs(data, max(8, args.steps * 2), args.resolution)
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(work / "datasets_cache"), PYTHONPATH=str(ROOT))
        built = subprocess.run([sys.executable, "-m", "align.precompute", "--model", str(model), "--dataset", str(data),
                                "--output", str(store), "--resolution", str(args.resolution), "--dtype", "float32",
                                "--batch_size", "1"],  # 1 pair (4 images with flips) per VAE call: 8 took 19 GB at 512 px
                               env=env, capture_output=True, text=True, cwd=ROOT)
        if built.returncode != 0:
            raise SystemExit(f"precompute failed (exit code {built.returncode}; a negative one is a signal, e.g. -9 from the "
                             f"kernel's out-of-memory killer):\n{built.stderr[-2000:]}")
        runs = {"peer": [], "ours": []}
        for repeat in range(args.repeats):  # alternating order: a shared machine's load falls on both sides
            for name in ("peer", "ours") if repeat % 2 == 0 else ("ours", "peer"):
                out = work / f"run_{name}_{args.resolution}_{time.time_ns()}"
                out.mkdir()
                r = side(name, model, data, store, out, args)
                runs[name].append(r)
                print(f"{name:5s} {r['seconds_per_step']:8.2f} s/step   peak RSS {r['peak_mb']:8.0f} MB   ({r['steps']} steps, "
                      f"{args.resolution} px)", flush=True)
        # Per side: the fastest run (the least disturbed by other load) and the largest peak.
        results = {name: {"seconds_per_step": min(r["seconds_per_step"] for r in rs), "peak_mb": max(r["peak_mb"] for r in rs)}
                   for name, rs in runs.items()}
        time_ratio = results["ours"]["seconds_per_step"] / results["peer"]["seconds_per_step"]
        memory_ratio = results["ours"]["peak_mb"] / results["peer"]["peak_mb"]
        print(f"store / peer: time per step {time_ratio:.2f}x (target <= {1 / 1.3:.2f}), peak memory {memory_ratio:.2f}x "
              "(target <= 1.00)", flush=True)


if __name__ == "__main__":
    main()
