"""Real size on a CPU: one Diffusion-DPO optimiser step at a real model's architecture and resolution, random
weights, and its peak resident memory beside what `--dry_run` plans for one process. A benchmark, not a test.

    python -m scripts.bench_real_size --model sd15 --finetune lora                 # SD v1.5 at 512 px
    python -m scripts.bench_real_size --model sd15 --finetune full
    python -m scripts.bench_real_size --model sdxl --finetune lora                 # SDXL at 1024 px
    python -m scripts.bench_real_size --model sd35m --finetune lora --mixed_precision bf16   # SD3.5 Medium, 1024 px

No download: the pipeline folder is built from the published config values (scripts/bench_gpu.py's and
experiments/plan_big_models.py's: SD v1.5's UNet, VAE and CLIP ViT-L/14 text encoder; SDXL base 1.0's UNet and two
CLIP encoders; SD3.5 Medium's MMDiT-X, CLIP-L, CLIP-G and T5-v1.1-XXL encoder), with random weights, character-level
tokenizers (the encoders keep their real vocabulary sizes) and saved with `save_pretrained`, so the trainer loads
it through the same `from_pretrained` path as real weights. The step is `align/dpo.py --max_steps 1` on one pair of
random images at the resolution (`--latent_store none`: the step encodes its own images), in a fresh process; the
peak RSS is that process's (getrusage of the children) and the process tree's sampled every 50 ms (psutil).
`--dry_run true` with the same flags gives the planner's "DDP x1" total; its own process's peak RSS (the interpreter,
torch and the libraries, the model built on the meta device) is printed as the runtime, which the plan, like a GPU's
CUDA context, does not count.

Before building anything the plan is compared with the memory available (psutil): a run whose plan does not fit
with 10% to spare is skipped, and the script says so (the machine is shared: check `free -g` first).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transformers
from accelerate import init_empty_weights
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from PIL import Image

from align.testing.sd15 import SD15_UNET
from align.testing.tiny_flow import _t5_tokenizer
from align.testing.tiny_sd import write_char_tokenizer
from scripts.bench_gpu import SD3_VAE, SD15_VAE, SD35M_TRANSFORMER, SDXL_UNET

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30

# The published config values (stable-diffusion-v1-5/stable-diffusion-v1-5, stabilityai/stable-diffusion-xl-base-1.0,
# stabilityai/stable-diffusion-3.5-medium), as scripts/bench_gpu.py and experiments/plan_big_models.py hold them.
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768)
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              max_position_embeddings=77, hidden_act="gelu", projection_dim=1280)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32)
SD_SCHEDULER = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                    clip_sample=False, set_alpha_to_one=False, steps_offset=1, prediction_type="epsilon")


def _char_tokenizer(folder: Path, max_length: int):
    write_char_tokenizer(folder)
    tokenizer = transformers.CLIPTokenizer.from_pretrained(folder)
    tokenizer.model_max_length = max_length
    return tokenizer


def _clip(config: dict, tokenizer, projection: bool, dtype):
    cls = transformers.CLIPTextModelWithProjection if projection else transformers.CLIPTextModel
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.eos_token_id)
    return cls(transformers.CLIPTextConfig(**config, **ids)).to(dtype)


def build_sd15(folder: Path, dtype):
    tokenizer = _char_tokenizer(folder / "_tokenizer", 77)
    pipe = StableDiffusionPipeline(
        vae=AutoencoderKL(**SD15_VAE).to(dtype), text_encoder=_clip(CLIP_L, tokenizer, False, dtype),
        tokenizer=tokenizer, unet=UNet2DConditionModel(**SD15_UNET).to(dtype),
        scheduler=DDIMScheduler(**SD_SCHEDULER), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    return pipe


def build_sdxl(folder: Path, dtype):
    tokenizer = _char_tokenizer(folder / "_tokenizer", 77)
    pipe = StableDiffusionXLPipeline(
        vae=AutoencoderKL(**{**SD15_VAE, "sample_size": 1024, "scaling_factor": 0.13025}).to(dtype),
        text_encoder=_clip(CLIP_L, tokenizer, False, dtype), text_encoder_2=_clip(CLIP_G, tokenizer, True, dtype),
        tokenizer=tokenizer, tokenizer_2=tokenizer, unet=UNet2DConditionModel(**SDXL_UNET).to(dtype),
        scheduler=EulerDiscreteScheduler(**{k: v for k, v in SD_SCHEDULER.items() if k not in ("clip_sample", "set_alpha_to_one")}))
    return pipe


def build_sd35m(folder: Path, dtype):
    tokenizer = _char_tokenizer(folder / "_tokenizer", 77)
    t5 = transformers.T5EncoderModel(transformers.T5Config(**T5_XXL)).to(dtype)
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**SD35M_TRANSFORMER).to(dtype),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0), vae=AutoencoderKL(**SD3_VAE).to(dtype),
        text_encoder=_clip(CLIP_L, tokenizer, True, dtype), tokenizer=tokenizer,
        text_encoder_2=_clip(CLIP_G, tokenizer, True, dtype), tokenizer_2=tokenizer,
        text_encoder_3=t5, tokenizer_3=_t5_tokenizer())
    return pipe


MODELS = {"sd15": (build_sd15, 512), "sdxl": (build_sdxl, 1024), "sd35m": (build_sd35m, 1024)}


def write_configs(build, folder: Path, dtype) -> None:
    """The pipeline folder's configs and tokenizers only (the parts built on the meta device: no memory), which is
    all --dry_run reads: the plan is known before any weight is made."""
    with init_empty_weights(include_buffers=False):  # buffers real: the schedulers build their tables
        pipe = build(folder, dtype)
    pipe.save_config(folder / "configs")  # model_index.json
    for name, part in pipe.components.items():
        if part is None:
            continue
        if hasattr(part, "save_pretrained") and not isinstance(part, torch.nn.Module):
            part.save_pretrained(folder / "configs" / name)  # tokenizers, schedulers
        elif hasattr(part, "save_config"):
            part.save_config(folder / "configs" / name)  # diffusers models
        else:
            part.config.save_pretrained(folder / "configs" / name)  # transformers models


def write_pair(path: Path, resolution: int) -> None:
    rng = np.random.default_rng(0)

    def jpeg():
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (resolution, resolution, 3), dtype=np.uint8)).save(buffer, format="JPEG")
        return buffer.getvalue()

    pq.write_table(pa.Table.from_pylist([{"caption": "a red cube on a table", "jpg_0": jpeg(), "jpg_1": jpeg(),
                                          "label_0": 1.0, "label_1": 0.0}]), path)


def dpo_command(model: str, data: Path, out: Path, args) -> list[str]:
    return [sys.executable, str(ROOT / "align" / "dpo.py"), "--model", model, "--dataset", str(data),
            "--output_dir", str(out), "--finetune", args.finetune, "--lora_rank", "4", "--resolution", str(args.resolution),
            "--train_batch_size", "1", "--gradient_accumulation_steps", "1", "--max_steps", "1",
            "--checkpointing_steps", "1000", "--latent_store", "none", "--report_to", "none",
            "--mixed_precision", args.mixed_precision, "--gradient_checkpointing", str(args.gradient_checkpointing).lower(),
            "--quiet", "true", "--overwrite", "true"]


def planned_gib(model: str, data: Path, out: Path, args, env: dict) -> tuple[float, float]:
    """The planner's DDP x1 total (`--dry_run true`), and the dry run's own peak RSS (the interpreter, torch and the
    libraries, the model on the meta device: what a process holds before any tensor of the plan), in GiB."""
    done = subprocess.run([*dpo_command(model, data, out, args), "--dry_run", "true"], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"--dry_run failed: {done.stderr[-2000:]}")
    unit = re.search(r"(MiB|GiB) per process", done.stdout).group(1)
    total = float(re.search(r"^total\s+([\d.]+)", done.stdout, re.MULTILINE).group(1))
    print(done.stdout.strip(), flush=True)
    runtime = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB  # the only child waited for yet
    return (total / 1024 if unit == "MiB" else total), runtime


def one_step(model: str, data: Path, out: Path, args, env: dict) -> dict:
    """Run the step in a child of a fresh process (so getrusage sees it alone); its peak RSS and the tree's."""
    start = time.perf_counter()
    process = subprocess.Popen(dpo_command(model, data, out, args), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    parent, tree_peak = psutil.Process(process.pid), 0
    while process.poll() is None:
        try:
            tree_peak = max(tree_peak, sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)]))
        except psutil.Error:
            pass
        time.sleep(0.05)
    _, err = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"the step failed ({process.returncode}): {err[-3000:]}")
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 / GIB,
            "tree_gib": tree_peak / GIB, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(MODELS), default="sd15")
    parser.add_argument("--finetune", choices=("lora", "full"), default="lora")
    parser.add_argument("--resolution", type=int, default=None, help="default: the model's own (512 or 1024)")
    parser.add_argument("--mixed_precision", choices=("no", "bf16"), default="no")
    parser.add_argument("--gradient_checkpointing", type=lambda v: v.lower() == "true", default=False)
    parser.add_argument("--workdir", default="/tmp/bench_real_size", help="model folders are kept here and reused")
    parser.add_argument("--force", action="store_true", help="run even when the plan does not fit the free memory")
    parser.add_argument("--plan_only", action="store_true", help="print the plan and stop (builds no weights)")
    args = parser.parse_args()
    build, native = MODELS[args.model]
    args.resolution = args.resolution or native
    work = Path(args.workdir) / args.model
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    dtype = torch.bfloat16 if args.mixed_precision == "bf16" else torch.float32
    if not (work / "configs" / "model_index.json").is_file():
        write_configs(build, work, dtype)
    data = work / f"pair_{args.resolution}.parquet"
    if not data.is_file():
        write_pair(data, args.resolution)
    out = work / f"run_{args.finetune}_{args.mixed_precision}_{int(args.gradient_checkpointing)}"
    plan, runtime = planned_gib(str(work / "configs"), data, out, args, env)
    available = psutil.virtual_memory().available / GIB
    label = (f"{args.model} {args.finetune} {args.resolution} px, mixed precision {args.mixed_precision}, gradient "
             f"checkpointing {'on' if args.gradient_checkpointing else 'off'}")
    if args.plan_only:
        print(json.dumps({"case": label, "planned_gib": round(plan, 2), "available_gib": round(available, 2)}))
        return
    if plan * 1.1 > available and not args.force:
        print(json.dumps({"case": label, "planned_gib": round(plan, 2), "available_gib": round(available, 2),
                          "skipped": "the plan does not fit the memory available with 10% to spare"}))
        return
    if not (work / "pipeline" / "model_index.json").is_file():
        print(f"[bench] building {args.model} with random weights in {work / 'pipeline'}", flush=True)
        torch.manual_seed(0)
        build(work, dtype).save_pretrained(work / "pipeline")
    measured = one_step(str(work / "pipeline"), data, out, args, env)
    peak = measured["peak_rss_gib"]
    print(json.dumps({"case": label, "planned_gib": round(plan, 2), "peak_rss_gib": round(peak, 2),
                      "tree_gib": round(measured["tree_gib"], 2), "runtime_gib": round(runtime, 2),
                      "planned/measured": round(plan / peak, 3),
                      "planned/(measured - runtime)": round(plan / (peak - runtime), 3),
                      "seconds": round(measured["seconds"], 1)}))


if __name__ == "__main__":
    main()
