"""Diffusion-DPO step benchmark: pairs per second and peak memory, side by side.

    python scripts/bench_dpo.py                 # all cases (CPU: a few minutes)
    python scripts/bench_dpo.py --cases sd15-lora-disabled,sd15-lora-frozen --resolution 128

Cases (each runs in its own subprocess so peak memory is its own):
  tiny-cache / tiny-nocache   the full dpo.train loop on a tiny pipeline, latent cache on / off
  sd15-lora-disabled          SD v1.5-architecture UNet (random init from its config) + LoRA;
                              reference = the same UNet with the adapter disabled
  sd15-lora-frozen            the same, but the reference is a frozen copy of the UNet
Peak memory: torch.cuda.max_memory_allocated on a GPU, else the process's peak RSS.
Target (issue 2): adapter-disabled reference peak <= 60% of the frozen-copy peak.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from diffusers import DDPMScheduler, UNet2DConditionModel
from PIL import Image

from align.data.pairs import write_pairs_parquet
from align.pipeline import add_lora, disabled_adapter, frozen_copy
from align.testing.sd15 import SD15_UNET
from align.testing.tiny_sd import build_tiny_pipeline
from align.train import dpo
from align.train.losses import diffusion_dpo_loss, per_sample_mse
from rewards.images import encode_png

ROOT = Path(__file__).resolve().parent.parent



def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


def run_sd15(reference_kind: str, resolution: int, steps: int, device: torch.device) -> dict:


    torch.manual_seed(0)
    unet = UNet2DConditionModel(**SD15_UNET).to(device)
    add_lora(unet, rank=8)
    reference = None
    if reference_kind == "frozen":
        # What a trainer without the adapter trick keeps: a second full UNet.
        reference = frozen_copy(unet)
        reference.disable_adapters()
    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    latent = resolution // 8
    x0 = torch.randn(2, 4, latent, latent, device=device)
    text = torch.randn(2, 77, 768, device=device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        noise = torch.randn(1, 4, latent, latent, device=device).repeat(2, 1, 1, 1)
        t = torch.randint(0, 1000, (1,), device=device).repeat(2)
        noisy = scheduler.add_noise(x0, noise, t)
        model_w, model_l = per_sample_mse(unet(noisy, t, text).sample, noise).chunk(2)
        with torch.no_grad():
            if reference is None:
                with disabled_adapter(unet):
                    ref_pred = unet(noisy, t, text).sample
            else:
                ref_pred = reference(noisy, t, text).sample
        ref_w, ref_l = per_sample_mse(ref_pred, noise).chunk(2)
        loss, _ = diffusion_dpo_loss(model_w, model_l, ref_w, ref_l, beta=5000.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    steady = times[1:] or times
    return {"pairs_per_s": 1.0 / (sum(steady) / len(steady)), "peak_mb": peak_memory_mb(device)}


def make_pairs(path: Path, count: int, size: int) -> None:

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(count):
        images = [encode_png(Image.fromarray((torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()))
                  for _ in range(2)]
        rows.append({"caption": f"pair {i}", "jpg_0": images[0], "jpg_1": images[1], "label_0": 1.0, "label_1": 0.0})
    write_pairs_parquet(rows, path)


def run_tiny(cache: bool, steps: int) -> dict:

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_pipeline(Path(tmp) / "m")
        data = Path(tmp) / "pairs.parquet"
        make_pairs(data, 16, 16)
        config = dpo.DPOConfig(
            model=str(model), dataset=str(data), output_dir=str(Path(tmp) / "run"), finetune="lora", lora_rank=4,
            resolution=None, train_batch_size=4, gradient_accumulation_steps=1, max_steps=steps, learning_rate=1e-4,
            scale_lr=False, lr_warmup_steps=0, checkpointing_steps=10**9, report_to="none",
            latent_store="run" if cache else "none",
        )
        run = dpo.train(config)
        rates = [json.loads(line)["pairs_per_second"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    # After the first epoch every image is cached; report the steady state.
    steady = rates[len(rates) // 2 :]
    return {"pairs_per_s": sum(steady) / len(steady), "peak_mb": peak_memory_mb(torch.device("cpu"))}


def run_case(case: str, args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if case == "tiny-cache":
        return run_tiny(True, args.tiny_steps)
    if case == "tiny-nocache":
        return run_tiny(False, args.tiny_steps)
    if case == "sd15-lora-disabled":
        return run_sd15("disabled", args.resolution, args.sd15_steps, device)
    if case == "sd15-lora-frozen":
        return run_sd15("frozen", args.resolution, args.sd15_steps, device)
    raise SystemExit(f"unknown case {case!r}")


CASES = ("tiny-cache", "tiny-nocache", "sd15-lora-disabled", "sd15-lora-frozen")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--resolution", type=int, default=128, help="pixels for the SD v1.5-architecture cases")
    parser.add_argument("--sd15-steps", type=int, default=3)
    parser.add_argument("--tiny-steps", type=int, default=12)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_case(args.one, args)))
        return
    results = {}
    for case in args.cases.split(","):
        cmd = [sys.executable, __file__, "--one", case, "--resolution", str(args.resolution),
               "--sd15-steps", str(args.sd15_steps), "--tiny-steps", str(args.tiny_steps)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{case}: failed\n{out.stderr[-2000:]}")
            continue
        results[case] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{case:22s} {results[case]['pairs_per_s']:8.3f} pairs/s   peak {results[case]['peak_mb']:9.1f} MB", flush=True)
    if "sd15-lora-disabled" in results and "sd15-lora-frozen" in results:
        ratio = results["sd15-lora-disabled"]["peak_mb"] / results["sd15-lora-frozen"]["peak_mb"]
        speed = results["sd15-lora-disabled"]["pairs_per_s"] / results["sd15-lora-frozen"]["pairs_per_s"]
        print(f"adapter-disabled / frozen-copy peak memory: {ratio:.2f} (target <= 0.60); speed ratio {speed:.2f}")
    if "tiny-cache" in results and "tiny-nocache" in results:
        speed = results["tiny-cache"]["pairs_per_s"] / results["tiny-nocache"]["pairs_per_s"]
        print(f"latent cache speed-up (tiny pipeline): {speed:.2f}x")


if __name__ == "__main__":
    main()
