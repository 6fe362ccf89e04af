"""What a quantized frozen base costs (issue 57): one testbed recipe trained twice, the frozen base in full precision and
in torchao int8 weight-only (--quantize_base int8), scored on the same held-out images.

    OMP_NUM_THREADS=1 python -m experiments.quantization_cost --testbed testbed --runs runs/qcost
    OMP_NUM_THREADS=1 python -m experiments.quantization_cost --testbed testbed-flow --runs runs/qcost

The recipes are the shipped testbed configs (testbed: configs/testbed_dpo.yaml, Diffusion-DPO; testbed-flow:
configs/testbed_flow_grpo.yaml, Flow-GRPO), run as they are but for --quantize_base, each with its own held-out set
(the config's --eval_prompts and eval seeds), scored before and after training by the run itself. Printed, each with
its paired standard error over the same images:

- the gain of the full-precision run (its own before and after);
- the gain of the int8 run, as it ran (before and after through the int8 base);
- the gain of the int8 run's LoRA deployed on the full-precision base (load_lora_weights into the unquantized
  pipeline), over the full-precision base's before;
- the difference between the int8 and full-precision gains, per image (both runs sampled the same held-out images);
- the quantized base alone: the oracle's score change (int8 base's before minus the full-precision base's) and the
  mean absolute pixel change of --pixel-images of those images (pixels in [0, 1]).

Each run is resumed (--resume latest) if its folder exists unfinished, skipped if finished; --out writes the numbers
as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch
import yaml

import rewards
from align.pipeline import generate_images, load_pipeline, load_trained, testbed_settings
from align.train.quantization import pipeline_quantization
from align.train.trained_model import detect_family
from experiments.flow_ceiling import paired_gain

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"testbed": ("align/dpo.py", "configs/testbed_dpo.yaml"),
           "testbed-flow": ("align/ddpo.py", "configs/testbed_flow_grpo.yaml")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--testbed", choices=sorted(RECIPES), required=True)
    p.add_argument("--runs", type=Path, default=Path("runs/qcost"), help="folder of the two run folders")
    p.add_argument("--pixel-images", type=int, default=200, help="held-out images drawn by both bases for the pixel change")
    p.add_argument("--out", type=Path, default=None, help="a JSON file for the numbers")
    return p.parse_args(argv)


def train(trainer: str, config: str, run: Path, quantize: str) -> None:
    """The recipe as shipped, --quantize_base ``quantize``, in its own process (one CPU thread); its CPU seconds (the
    whole command: training and both held-out evaluations) go to <run>.cpu.json."""
    if (run / "eval_after.json").is_file() and (run / "final").is_dir():
        return
    resume = ["--resume", "latest"] if run.is_dir() else []
    command = [sys.executable, trainer, "--config", config, "--output_dir", str(run), "--quantize_base", quantize,
               "--report_to", "none", "--quiet", "true", *resume]
    print("$", " ".join(command), flush=True)
    start = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, cwd=REPO, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    end = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = (end.ru_utime + end.ru_stime) - (start.ru_utime + start.ru_stime)
    Path(f"{run}.cpu.json").write_text(json.dumps({"cpu_seconds": seconds, "resumed": bool(resume)}))


def held_out(run: Path, name: str) -> dict:
    return json.loads((run / name).read_text())


def sampling_of(run: Path) -> tuple[int, float]:
    """The held-out evaluation's steps and guidance, as the run used them (its resolved config.yaml)."""
    config = yaml.safe_load((run / "config.yaml").read_text())
    defaults = testbed_settings(config["model"])
    steps = config.get("eval_inference_steps") or config.get("num_inference_steps") or defaults["num_inference_steps"]
    guidance = config.get("guidance_scale")
    return int(steps), float(guidance if guidance is not None else defaults["guidance_scale"])


def generated(pipe, record: dict, steps: int, guidance: float, count: int | None = None) -> torch.Tensor:
    prompts, seeds = record["prompts"][:count], record["seeds"][:count]
    return generate_images(pipe, prompts, seeds, num_inference_steps=steps, guidance_scale=guidance, batch_size=32)


def gain(before: list[float], after: list[float], prompts: list[str]) -> dict:
    return paired_gain(before, after, prompts)  # per image and clustered by caption


def line(label: str, g: dict) -> str:
    return f"{label}: {g['gain']:+.4f} ± {g['paired_sem_images']:.4f} per image (± {g['paired_sem_captions']:.4f} per caption)"


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    trainer, config = RECIPES[args.testbed]
    plain, int8 = args.runs / f"{args.testbed}-plain", args.runs / f"{args.testbed}-int8"
    train(trainer, config, plain, "none")
    train(trainer, config, int8, "int8")

    before, after = held_out(plain, "eval_before.json"), held_out(plain, "eval_after.json")
    q_before, q_after = held_out(int8, "eval_before.json"), held_out(int8, "eval_after.json")
    if (before["prompts"], before["seeds"]) != (q_before["prompts"], q_before["seeds"]):
        sys.exit("the two runs' held-out images differ (prompts or seeds): rerun both with the same config")
    repeats = len(before["scores"]) // len(set(before["prompts"]))
    steps, guidance = sampling_of(plain)
    judge = rewards.load(yaml.safe_load((plain / "config.yaml").read_text()).get("eval_judge") or "shapes-oracle")

    deployed_file = args.runs / f"{args.testbed}-int8-deployed.json"  # the int8 run's LoRA on the full-precision base
    if deployed_file.is_file():
        deployed = json.loads(deployed_file.read_text())
    else:
        images = generated(load_trained(str(int8)), before, steps, guidance)
        deployed = {"scores": judge.score(before["prompts"], images).float().tolist()}
        deployed_file.write_text(json.dumps(deployed))

    model = yaml.safe_load((plain / "config.yaml").read_text())["model"]
    n = args.pixel_images
    full = generated(load_pipeline(model), before, steps, guidance, n)
    int8_base = pipeline_quantization("int8", "none", detect_family(model).denoiser_name, [], torch.float32)
    quantized = generated(load_pipeline(model, quantization=int8_base), before, steps, guidance, n)
    check = judge.score(before["prompts"][:n], full).float().tolist()
    if max(abs(a - b) for a, b in zip(check, before["scores"][:n])) > 1e-6:
        sys.exit("regenerating the full-precision base's held-out images did not give the run's before-scores")

    results = {
        "testbed": args.testbed, "recipe": config, "held_out": f"{len(before['scores'])} images, "
        f"{len(set(before['prompts']))} prompts x {repeats} seeds from {before['seeds'][0]}",
        "full_precision_gain": gain(before["scores"], after["scores"], before["prompts"]),
        "int8_gain_as_run": gain(q_before["scores"], q_after["scores"], before["prompts"]),
        "int8_lora_on_full_precision_base_gain": gain(before["scores"], deployed["scores"], before["prompts"]),
        "int8_minus_full_precision_gain": gain(
            [a - b for a, b in zip(after["scores"], before["scores"])],
            [a - b for a, b in zip(q_after["scores"], q_before["scores"])], before["prompts"]),
        "int8_base_score_change": gain(before["scores"], q_before["scores"], before["prompts"]),
        "int8_base_mean_abs_pixel_change": float((full - quantized).abs().mean()),
        "pixel_images": n,
        "command_cpu_minutes": {name: round(json.loads(Path(f"{run}.cpu.json").read_text())["cpu_seconds"] / 60, 1)
                                for name, run in (("full_precision", plain), ("int8", int8))
                                if Path(f"{run}.cpu.json").is_file()},
    }
    print(f"{args.testbed}, {config}, held-out {results['held_out']}, judge {judge.name}")
    for key in ("full_precision_gain", "int8_gain_as_run", "int8_lora_on_full_precision_base_gain",
                "int8_minus_full_precision_gain", "int8_base_score_change"):
        print(line(key.replace("_", " "), results[key]))
    print(f"int8 base alone: mean absolute pixel change {results['int8_base_mean_abs_pixel_change']:.4f} "
          f"over {n} images; CPU minutes of each command: {results['command_cpu_minutes']}")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
