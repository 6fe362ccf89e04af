"""DDPO throughput and peak memory: align/ddpo.py against TRL 0.23.1's DDPOTrainer, side by side.

    python scripts/bench_ddpo_vs_trl.py                        # CPU, the testbed-architecture pipeline
    python scripts/bench_ddpo_vs_trl.py --model testbed --epochs 4 --device cuda
    python scripts/bench_ddpo_vs_trl.py --timestep-batch 4 --epochs 5 --rounds 3   # median of 3 alternating rounds

Both trainers get the same pipeline folder, reward (JPEG compressibility, a rule judge), prompts,
sampling settings (DDIM steps, η, guidance), LoRA rank, batch sizes, timestep fraction and
per-prompt statistics (buffer 16, minimum 16, TRL's). Ours trains through PEFT's LoRA layers, as TRL
does (the merged W + B·A training forward, `lora_merged_forward`, was removed: experiments/notes/removed-options.md).
Each runs in its own process (TRL from its own virtual environment,
because TRL removed DDPOTrainer in 0.24); the first epoch is a warm-up and is not timed.
Reported: samples per second (sampling + reward + PPO update, per epoch), peak memory
(peak resident set size on CPU, peak allocated CUDA memory on a GPU), on Linux the peak of anonymous
resident memory (RssAnon polled every 10 ms while each trainer loads and runs) and the untimed first epoch.

TRL 0.23.1 lives in a separate virtual environment, by default /tmp/trl023-shared, that holds only TRL
and reads every other package from this project's environment:

    python -m venv /tmp/trl023-shared
    /tmp/trl023-shared/bin/pip install --no-deps trl==0.23.1
    python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > /tmp/trl023-shared/lib/python3.11/site-packages/project.pth

(run the last line with this project's python). Both trainers then map the very same library files.
Peak resident memory counts the pages of shared libraries mapped into the process, and two byte-identical
copies of the same torch wheel measured 45 MB apart after `import torch` alone (224 vs 269 MB, mostly
libtorch's resident pages), so separate installs are not a fair memory comparison;
the bench warns when the two processes load torch from different files.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRL_PYTHON = "/tmp/trl023-shared/bin/python"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="pipeline folder or 'testbed'; default: a random testbed-architecture pipeline")
    p.add_argument("--trl-python", default=DEFAULT_TRL_PYTHON, help="python of the virtual environment with trl==0.23.1")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    p.add_argument("--epochs", type=int, default=3, help="epochs per trainer; the first is a warm-up")
    p.add_argument("--rounds", type=int, default=1,
                   help="run both trainers this many times, alternating which goes first, and report the median ratio "
                        "(a shared or throttled machine drifts by tens of percent between runs)")
    p.add_argument("--steps", type=int, default=20, help="DDIM steps")
    p.add_argument("--guidance", type=float, default=4.0)
    p.add_argument("--eta", type=float, default=1.0)
    p.add_argument("--sample-batch-size", type=int, default=16)
    p.add_argument("--batches-per-epoch", type=int, default=2)
    p.add_argument("--train-batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--timestep-fraction", type=float, default=0.5)
    p.add_argument("--timestep-batch", type=int, default=None,
                   help="ours only: trained timesteps per UNet call (default: all of them; 1 = one at a time like TRL). "
                        "The gradient is the same either way")
    p.add_argument("--lora-rank", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--only", choices=("ours", "trl"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def peak_memory_mb(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class AnonymousMemoryPeak:
    """Peak of the process's anonymous resident memory (RssAnon: tensors, heap; no library pages),
    polled every 10 ms from /proc on Linux. Library pages count in peak RSS, but how many of them are
    resident depends on the files' history (module docstring), so this is the steadier comparison."""

    def __init__(self):
        import threading

        self.peak_kb, self.stop = 0, threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)
        if Path("/proc/self/status").is_file():
            self.thread.start()

    def poll(self) -> None:
        while not self.stop.wait(0.01):
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    self.peak_kb = max(self.peak_kb, int(line.split()[1]))

    def mb(self) -> float | None:
        self.stop.set()
        return self.peak_kb / 1024 if self.peak_kb else None


def loaded_libraries() -> dict:
    """Where torch came from and whether scipy was loaded: both change resident memory (module docstring)."""
    import torch

    return {"torch_file": torch.__file__, "scipy_loaded": "scipy" in sys.modules}


def prompts_for(n: int) -> list[str]:
    from align.testbed.scene import sample_captions

    return sample_captions(n, seed=0)


# ---------------------------------------------------------------------------------------------- children


def run_ours(args) -> dict:

    from align.train import ddpo

    work = Path(args.workdir)
    prompt_file = work / "prompts.txt"
    samples_per_epoch = args.sample_batch_size * args.batches_per_epoch
    config = ddpo.DDPOConfig(
        model=args.model, reward="jpeg-compressibility", prompts=str(prompt_file), output_dir=str(work / "ours"),
        overwrite=True, report_to="none", num_inference_steps=args.steps, guidance_scale=args.guidance, eta=args.eta,
        samples_per_epoch=samples_per_epoch, sample_batch_size=args.sample_batch_size,
        train_batch_size=args.train_batch_size, gradient_accumulation_steps=args.grad_accum,
        timestep_fraction=args.timestep_fraction, lora_rank=args.lora_rank, learning_rate=args.lr,
        num_epochs=args.epochs, checkpointing_epochs=10**6, timestep_batch=args.timestep_batch,
    )
    ddpo.STAT_BUFFER_SIZE, ddpo.STAT_MIN_COUNT = 16, 16  # TRL's per-prompt statistics
    anonymous = AnonymousMemoryPeak()
    ddpo.train(config)
    records = [json.loads(line) for line in (work / "ours" / "metrics.jsonl").read_text().splitlines()]
    timed = records[1:] or records
    wall = sum(samples_per_epoch / r["samples_per_second"] for r in timed)
    cpu = sum(r["epoch_cpu_seconds"] for r in timed)
    return {"samples_per_s": samples_per_epoch * len(timed) / wall, "samples_per_cpu_s": samples_per_epoch * len(timed) / cpu,
            "epochs_timed": len(timed), "peak_memory_mb": peak_memory_mb(args.device), "peak_anonymous_mb": anonymous.mb(),
            "first_epoch_s": samples_per_epoch / records[0]["samples_per_second"],
            "epoch_cpu_s": cpu / len(timed), **loaded_libraries()}


def run_trl(args) -> dict:
    import random

    import torch
    import trl
    from trl import DDPOConfig, DDPOTrainer, DefaultDDPOStableDiffusionPipeline

    from rewards.rules import JpegCompressibility

    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    prompts = (work / "prompts.txt").read_text().splitlines()
    rng = random.Random(0)
    judge = JpegCompressibility()

    def prompt_fn():
        return rng.choice(prompts), {}

    def reward_fn(images, batch_prompts, metadata):
        return judge.score(list(batch_prompts), images.float().cpu()), {}

    config = DDPOConfig(
        num_epochs=args.epochs, sample_num_steps=args.steps, sample_eta=args.eta, sample_guidance_scale=args.guidance,
        sample_batch_size=args.sample_batch_size, sample_num_batches_per_epoch=args.batches_per_epoch,
        train_batch_size=args.train_batch_size, train_gradient_accumulation_steps=args.grad_accum,
        train_timestep_fraction=args.timestep_fraction, train_learning_rate=args.lr,
        per_prompt_stat_tracking=True, per_prompt_stat_tracking_buffer_size=16, per_prompt_stat_tracking_min_count=16,
        mixed_precision="no", log_with=None, save_freq=10**6, project_kwargs={"project_dir": str(work / "trl")},
    )
    from accelerate import PartialState

    PartialState()  # TRL's pipeline logs through accelerate before the trainer creates its Accelerator
    anonymous = AnonymousMemoryPeak()
    pipeline = DefaultDDPOStableDiffusionPipeline(args.model, use_lora=True)
    pipeline.sd_pipeline.to(args.device)
    trainer = DDPOTrainer(config, reward_fn, prompt_fn, pipeline)
    seconds, cpu_seconds, global_step = [], [], 0
    for epoch in range(args.epochs):
        start, cpu_start = time.perf_counter(), time.process_time()
        global_step = trainer.step(epoch, global_step)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    first = 1 if args.epochs > 1 else 0
    samples = args.sample_batch_size * args.batches_per_epoch * (args.epochs - first)
    return {"samples_per_s": samples / sum(seconds[first:]), "samples_per_cpu_s": samples / sum(cpu_seconds[first:]),
            "epochs_timed": args.epochs - first, "peak_memory_mb": peak_memory_mb(args.device), "peak_anonymous_mb": anonymous.mb(),
            "trl_version": trl.__version__,
            "first_epoch_s": seconds[0], **loaded_libraries()}


# ---------------------------------------------------------------------------------------------- driver


def build_pipeline_folder(folder: Path) -> str:
    """The testbed architecture (UNet 64/128 channels on 8x8 latents, 32 px images) with random weights."""
    import torch

    from align.testbed.models import build_pipeline
    from align.testbed.tokenizer import testbed_tokenizer

    torch.manual_seed(0)
    build_pipeline(testbed_tokenizer()).save_pretrained(folder)
    return str(folder)


def ratios(ours: dict, theirs: dict) -> dict:
    out = {key: ours[key] / theirs[key] for key in ("samples_per_s", "samples_per_cpu_s", "peak_memory_mb")}
    if ours["peak_anonymous_mb"] is not None and theirs["peak_anonymous_mb"] is not None:
        out["peak_anonymous_mb"] = ours["peak_anonymous_mb"] / theirs["peak_anonymous_mb"]
    return out


def print_round(ours: dict, theirs: dict) -> None:
    rows = [("align/ddpo.py", ours), (f"TRL {theirs['trl_version']} DDPOTrainer", theirs)]
    print(f"{'trainer':<28}{'samples/s':>11}{'samples/CPU-s':>15}{'peak memory (MB)':>18}"
          f"{'peak anonymous (MB)':>21}{'first epoch (s)':>17}")
    for name, r in rows:
        print(f"{name:<28}{r['samples_per_s']:>11.2f}{r['samples_per_cpu_s']:>15.2f}{r['peak_memory_mb']:>18.0f}"
              f"{r['peak_anonymous_mb'] or float('nan'):>21.0f}{r['first_epoch_s']:>17.1f}")
    q = ratios(ours, theirs)
    print(f"ours / TRL: throughput {q['samples_per_s']:.2f}x (wall), {q['samples_per_cpu_s']:.2f}x (per CPU-second); "
          f"peak memory {q['peak_memory_mb']:.2f}x"
          + (f", peak anonymous memory {q['peak_anonymous_mb']:.2f}x" if "peak_anonymous_mb" in q else ""), flush=True)


def print_median(rounds: list[tuple[dict, dict]]) -> None:
    """Median and range of each round's ratio: both trainers of a round ran back to back on the same machine."""
    import statistics

    per_round = [ratios(ours, theirs) for ours, theirs in rounds]
    parts = []
    for key, label in (("samples_per_cpu_s", "throughput per CPU-second"), ("samples_per_s", "wall throughput"),
                       ("peak_memory_mb", "peak memory"), ("peak_anonymous_mb", "peak anonymous memory")):
        values = [r[key] for r in per_round if key in r]
        if values:
            parts.append(f"{label} {statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})")
    print(f"median over {len(rounds)} rounds (range): " + "; ".join(parts))


def child(python: str, which: str, args, workdir: Path) -> dict:
    argv = [python, str(Path(__file__).resolve()), "--only", which, "--workdir", str(workdir)]
    for key, value in vars(args).items():
        if key in ("only", "workdir", "trl_python") or value is None or value is False:
            continue
        if value is True:
            argv.append(f"--{key.replace('_', '-')}")
            continue
        argv += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("BENCH ")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"{which} run failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(lines[-1][len("BENCH "):])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.only:
        sys.path.insert(0, str(REPO))
        from align.pipeline import resolve_model

        args.model = resolve_model(args.model)
        result = run_ours(args) if args.only == "ours" else run_trl(args)
        print("BENCH " + json.dumps(result), flush=True)
        return

    trl_python = Path(args.trl_python)
    if not trl_python.is_file():
        raise SystemExit(
            f"TRL 0.23.1 virtual environment not found: {trl_python} does not exist.\n"
            "TRL removed DDPOTrainer in 0.24, so it needs its own environment (see this script's docstring):\n"
            "    python -m venv /tmp/trl023-shared\n"
            "    /tmp/trl023-shared/bin/pip install --no-deps trl==0.23.1\n"
            f"    echo {sysconfig.get_paths()['purelib']} > /tmp/trl023-shared/lib/python3.11/site-packages/project.pth\n"
            "then rerun, or pass --trl-python /path/to/that/venv/bin/python"
        )
    with tempfile.TemporaryDirectory(prefix="bench_ddpo_") as tmp:
        work = Path(tmp)
        if args.model is None:
            args.model = build_pipeline_folder(work / "pipeline")
        (work / "prompts.txt").write_text("\n".join(prompts_for(args.num_prompts)) + "\n")
        samples_per_epoch = args.sample_batch_size * args.batches_per_epoch
        if args.timestep_batch is None:
            args.timestep_batch = max(1, int(args.steps * args.timestep_fraction))
        print(
            f"model: {args.model} | device: {args.device} ({args.threads} thread(s)) | {args.steps} DDIM steps, eta {args.eta}, "
            f"guidance {args.guidance} | {samples_per_epoch} samples/epoch ({args.sample_batch_size} x {args.batches_per_epoch}) | "
            f"train batch {args.train_batch_size} x {args.grad_accum} accumulation | timestep fraction {args.timestep_fraction} | "
            f"ours: {args.timestep_batch} timestep(s) per UNet call | LoRA rank {args.lora_rank} | {args.epochs} epochs (first one untimed) | reward: jpeg-compressibility",
            flush=True,
        )
        rounds = []
        for index in range(args.rounds):
            order = ("ours", "trl") if index % 2 == 0 else ("trl", "ours")
            got = {which: child(sys.executable if which == "ours" else str(trl_python), which, args, work) for which in order}
            rounds.append((got["ours"], got["trl"]))
            if args.rounds > 1:
                print(f"round {index + 1} of {args.rounds} ({order[0]} first):")
            print_round(*rounds[-1])
    if args.rounds > 1:
        print_median(rounds)
    print("(samples/CPU-s is the steadier number on a shared machine; on a GPU read samples/s)")
    ours, theirs = rounds[0]
    if ours["torch_file"] != theirs["torch_file"]:
        print(f"warning: the two processes loaded torch from different files ({ours['torch_file']} vs "
              f"{theirs['torch_file']}): resident memory then differs by tens of MB for the same work (module docstring)")
    if ours["scipy_loaded"] != theirs["scipy_loaded"]:
        print(f"warning: scipy was loaded by {'ours' if ours['scipy_loaded'] else 'TRL'} only (transformers imports it when "
              "installed, ~55 MB): install the same packages in both environments to compare memory")

if __name__ == "__main__":
    main()
