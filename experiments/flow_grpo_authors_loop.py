"""The authors' own Flow-GRPO training loop (yifan123/flow_grpo, scripts/train_sd3.py) run on the flow testbed with
the settings of configs/testbed_flow_grpo.yaml, timed per epoch in CPU seconds (one thread), to compare with
``python align/ddpo.py --config configs/testbed_flow_grpo.yaml`` (experiments/notes/online_rl.md).

    OMP_NUM_THREADS=1 python -m experiments.flow_grpo_authors_loop --authors DIR --epochs 12 [--out FILE.jsonl]

DIR is the folder of experiments/flow_grpo_reference.py (its four files, sha256-checked the same way) plus
    sd3_pipeline_with_logprob.py   flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py @ ac4c86e (2025-07)
saved with ``git show ac4c86e8:flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py`` from the local mirror
(/work/.mirror/yifan123+flow_grpo). Nothing of theirs is copied here: their files are executed at run time.

What runs as they wrote it (source parsed from train_sd3.py @ 74db691 and compiled unchanged):
- the body of ``main``'s epoch loop from "#### SAMPLING ####" to "#### TRAINING ####": their
  ``pipeline_with_logprob`` on the testbed's StableDiffusion3Pipeline, the rewards in a thread pool (8 workers), the
  collation, ``PerPromptStatTracker(global_std=True)`` (stat_tracking.py @ 94e23ee), the zero-advantage filter;
- the training block (``for inner_epoch ...`` and ``epoch+=1``): the per-timestep loop over the 9 trained steps,
  ``compute_log_prob`` with both CFG halves in one call, ``accelerator.accumulate`` with accelerate's
  ``Accelerator(gradient_accumulation_steps=2 x 9)``, the clipped loss, ``clip_grad_norm_`` (1.0), AdamW;
- their LoRA: ``get_peft_model`` with ``LoraConfig(r=32, lora_alpha=64, init_lora_weights="gaussian")`` on their
  eight attention projections (the same as align.families.sd3's ``lora_targets``); ``autocast`` is their
  ``contextlib.nullcontext`` for LoRA; AdamW with their betas and epsilon (PyTorch's defaults), weight decay 1e-4 (as
  ours).

Adaptations (each the least that lets their code run on a CPU without their package):
1. The sampler is the July 2025 ``pipeline_with_logprob`` (ac4c86e), which calls ``sde_step_with_logprob`` itself;
   the current one (54809b5) calls ``solver.run_sampling``/``flow_grpo_step``, the same SDE step written again.
   Its relative import resolves to the current step function (54809b5) through a stand-in package.
2. ``compute_text_embeddings`` (their T5/CLIP encoder from train_dreambooth_lora_sd3.py) is the testbed pipeline's
   ``encode_prompt`` through ``align.families`` (the testbed has no T5), as our trainer encodes; ``""`` is the negative.
3. The prompt loader (their ``DistributedKRepeatSampler``) is a stand-in yielding 2 captions x 8 images per batch of
   16, drawn uniformly from the same 256 training captions; ``prompt_metadata`` is empty.
4. ``reward_fn`` is the shapes oracle (``--reward shapes-oracle``, loaded as align/train/ddpo_rewards.py does) in
   their interface: ``({"avg": scores}, {})``.
5. ``wandb`` and ``tqdm`` are no-ops; no eval and no checkpoint (``eval_freq``/``save_freq`` are outside the timed
   parts); EMA off (their default); one process, float32 (no mixed precision on a CPU).

Timing: ``time.process_time()`` (this process, all threads: the reward thread included, as in ours) around the
sampling part and around the training part of each epoch; written as one JSON line per epoch.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import os
import random
import sys
import tempfile
import time
import types
from collections import defaultdict
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from accelerate import Accelerator
from peft import LoraConfig, get_peft_model
from PIL import Image

from align.data.prompt_sets import load_prompt_list
from align.families import family_of_pipeline
from align.judges import load_judge
from align.pipeline import load_pipeline
from experiments.flow_grpo_reference import AUTHORS_FILES, execute, function_source

PIPELINE_FILE = ("sd3_pipeline_with_logprob.py", "flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py",
                 "ac4c86e8cae021841f1fde853d340e0db67690dd",
                 "c4a4ae4e5680572df30e8adc905ee3e76d4eaa2e52f68e4ee75617be05941be8")
FILES = {**{name: AUTHORS_FILES[name] for name in ("sd3_sde_with_logprob.py", "stat_tracking.py", "train_sd3.py")},
         PIPELINE_FILE[0]: PIPELINE_FILE[1:]}
PACKAGE = "flow_grpo_authors"  # stand-in package for the pipeline's relative import

# configs/testbed_flow_grpo.yaml in the authors' config names
SAMPLE_BATCH, BATCHES_PER_EPOCH, IMAGES_PER_PROMPT = 16, 4, 8
TRAIN_BATCH, ACCUMULATION, NUM_STEPS, TRAINED_STEPS = 16, 2, 10, 9


def read_sources(folder: Path) -> dict[str, str]:
    sources = {}
    for name, (path, commit, digest) in FILES.items():
        if not (folder / name).is_file():
            raise SystemExit(f"{folder / name} is missing: save {path} @ {commit[:7]} there (see this file's docstring)")
        data = (folder / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise SystemExit(f"{folder / name} is not yifan123/flow_grpo {path} @ {commit[:7]} (sha256 differs)")
        sources[name] = data.decode()
    return sources


def load_pipeline_with_logprob(sources: dict[str, str]):
    """Their sampler, its ``from .sd3_sde_with_logprob import ...`` served by a stand-in package."""
    package = types.ModuleType(PACKAGE)
    package.__path__ = []
    step_module = types.ModuleType(f"{PACKAGE}.sd3_sde_with_logprob")
    exec(compile(sources["sd3_sde_with_logprob.py"], "sd3_sde_with_logprob.py", "exec"), step_module.__dict__)
    sys.modules[PACKAGE], sys.modules[step_module.__name__] = package, step_module
    namespace = {"__name__": f"{PACKAGE}.sd3_pipeline_with_logprob", "__package__": PACKAGE}
    exec(compile(sources["sd3_pipeline_with_logprob.py"], "sd3_pipeline_with_logprob.py", "exec"), namespace)
    return namespace["pipeline_with_logprob"], step_module.sde_step_with_logprob


def epoch_parts(train_source: str) -> tuple[types.CodeType, types.CodeType]:
    """(sampling, training): the statements of ``main``'s ``while True`` body from the SAMPLING banner to the
    TRAINING banner, and from there to the end, compiled unchanged (their line numbers kept)."""
    tree = ast.parse(train_source)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.While))
    lines = train_source.splitlines()
    banner = {name: next(i + 1 for i, line in enumerate(lines) if line.strip() == f"#################### {name} "
                         "####################") for name in ("SAMPLING", "TRAINING")}
    sampling = [s for s in loop.body if banner["SAMPLING"] < s.lineno < banner["TRAINING"]]
    training = [s for s in loop.body if s.lineno > banner["TRAINING"]]
    if not sampling or not training:
        raise SystemExit("train_sd3.py: the SAMPLING/TRAINING parts of the epoch loop were not found")
    return tuple(compile(ast.Module(body=part, type_ignores=[]), "train_sd3.py", "exec") for part in (sampling, training))


def authors_config(resolution: int) -> SimpleNamespace:
    sample = SimpleNamespace(num_batches_per_epoch=BATCHES_PER_EPOCH, num_steps=NUM_STEPS, guidance_scale=3.0,
                             train_batch_size=SAMPLE_BATCH, noise_level=0.7, same_latent=False, global_std=True)
    train = SimpleNamespace(num_inner_epochs=1, cfg=True, beta=0.0, adv_clip_max=5.0, clip_range=1e-4,
                            max_grad_norm=1.0, ema=False, batch_size=TRAIN_BATCH,
                            gradient_accumulation_steps=ACCUMULATION)
    return SimpleNamespace(sample=sample, train=train, resolution=resolution, per_prompt_stat_tracking=True)


class PromptBatches:
    """Their loader's interface: ``set_epoch``, ``num_batches_per_epoch``; batches of (prompts, metadata)."""

    def __init__(self, prompts: list[str], seed: int):
        self.prompts, self.seed, self.num_batches_per_epoch, self.epoch = prompts, seed, BATCHES_PER_EPOCH, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        while True:
            picks = torch.randint(len(self.prompts), (SAMPLE_BATCH // IMAGES_PER_PROMPT,), generator=gen).tolist()
            yield [self.prompts[i] for i in picks for _ in range(IMAGES_PER_PROMPT)], [{}] * SAMPLE_BATCH


class NoWandb:
    @staticmethod
    def log(*args, **kwargs):
        pass

    @staticmethod
    def Image(*args, **kwargs):  # wandb's name
        return None


def no_progress(iterable, *args, **kwargs):
    return iterable


def build_namespace(sources: dict[str, str], seed: int) -> dict:
    """Everything the two parts of their epoch read, built as their ``main`` builds it (with the adaptations)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    pipeline = load_pipeline("testbed-flow")
    pipeline.set_progress_bar_config(disable=True)
    family = family_of_pipeline(pipeline)
    resolution = family.native_resolution(pipeline)
    config = authors_config(resolution)
    for module in (pipeline.vae, pipeline.text_encoder, pipeline.text_encoder_2, pipeline.transformer):
        module.requires_grad_(False)
    targets = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k", "attn.to_out.0",
               "attn.to_q", "attn.to_v"]
    pipeline.transformer = get_peft_model(pipeline.transformer, LoraConfig(
        r=32, lora_alpha=64, init_lora_weights="gaussian", target_modules=targets))
    transformer = pipeline.transformer
    trainable = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-4, weight_decay=1e-4)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION * TRAINED_STEPS)
    transformer, optimizer = accelerator.prepare(transformer, optimizer)

    def compute_text_embeddings(prompt, text_encoders, tokenizers, max_sequence_length, device):
        with torch.no_grad():
            cond = family.encode_prompts(pipeline, list(prompt), resolution)
        return cond["prompt_embeds"].to(device), cond["pooled_embeds"].to(device)

    neg, neg_pooled = compute_text_embeddings([""], None, None, 128, accelerator.device)
    judge = load_judge("shapes-oracle")

    def reward_fn(images, prompts, prompt_metadata, only_strict=True):
        return {"avg": np.asarray(judge.score(list(prompts), images.float().cpu()), dtype=np.float64)}, {}

    pipeline_with_logprob, step_fn = load_pipeline_with_logprob(sources)
    train = sources["train_sd3.py"]
    helpers = {}
    for name in ("compute_log_prob", "calculate_zero_std_ratio"):
        helpers.update(execute(function_source(train, name), f"train_sd3.py:{name}",
                               {"torch": torch, "np": np, "sde_step_with_logprob": step_fn}))
    tracker_cls = execute(sources["stat_tracking.py"], "stat_tracking")["PerPromptStatTracker"]
    prompts = load_prompt_list("testbed:256")
    train_sampler = PromptBatches(prompts, seed)
    return {
        "__name__": "train_sd3_epoch", "torch": torch, "np": np, "time": time, "os": os, "random": random,
        "tempfile": tempfile, "Image": Image, "defaultdict": defaultdict, "wandb": NoWandb, "tqdm": no_progress,
        "config": config, "accelerator": accelerator, "pipeline": pipeline, "transformer": transformer,
        "optimizer": optimizer, "autocast": contextlib.nullcontext, "train_sampler": train_sampler,
        "train_dataloader": train_sampler, "text_encoders": None, "tokenizers": [pipeline.tokenizer],
        "compute_text_embeddings": compute_text_embeddings, "create_generator": None,
        "pipeline_with_logprob": pipeline_with_logprob,
        "sample_neg_prompt_embeds": neg.repeat(SAMPLE_BATCH, 1, 1),
        "sample_neg_pooled_prompt_embeds": neg_pooled.repeat(SAMPLE_BATCH, 1),
        "train_neg_prompt_embeds": neg.repeat(TRAIN_BATCH, 1, 1),
        "train_neg_pooled_prompt_embeds": neg_pooled.repeat(TRAIN_BATCH, 1),
        "executor": futures.ThreadPoolExecutor(max_workers=8), "reward_fn": reward_fn,
        "num_train_timesteps": TRAINED_STEPS, "stat_tracker": tracker_cls(config.sample.global_std),
        "ema": None, "transformer_trainable_parameters": trainable, "epoch": 0, "global_step": 0,
        **helpers,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--authors", type=Path, required=True, help="folder holding the authors' files (see above)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", type=Path, default=None, help="also write the per-epoch lines here (JSON lines)")
    args = p.parse_args(argv)
    if args.epochs < 1:
        raise SystemExit("--epochs must be at least 1")
    torch.set_num_threads(1)
    sources = read_sources(args.authors)
    sampling, training = epoch_parts(sources["train_sd3.py"])
    namespace = build_namespace(sources, args.seed)
    lines = []
    for _ in range(args.epochs):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        exec(sampling, namespace)
        cpu1 = time.process_time()
        exec(training, namespace)
        cpu2, wall2 = time.process_time(), time.perf_counter()
        kept = int(len(namespace["samples"]["timesteps"]))
        line = {"epoch": namespace["epoch"], "sampling_cpu_seconds": cpu1 - cpu0, "training_cpu_seconds": cpu2 - cpu1,
                "epoch_cpu_seconds": cpu2 - cpu0, "epoch_seconds": wall2 - wall0, "trained_samples": kept,
                "global_step": namespace["global_step"]}
        lines.append(line)
        print(json.dumps(line), flush=True)
    namespace["executor"].shutdown()
    if args.out is not None:
        args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
