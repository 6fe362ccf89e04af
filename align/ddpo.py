"""DDPO (Black et al. 2023, "Training Diffusion Models with Reinforcement Learning") for Stable
Diffusion, with rewards from any judge in ``rewards``.

    accelerate launch align/ddpo.py --reward aesthetic --prompts prompts.txt
    accelerate launch align/ddpo.py --config configs/ddpo_sd15.yaml
    python align/ddpo.py --config configs/testbed_ddpo.yaml          # offline, on a CPU

The algorithm box, per epoch:
    1. sample: draw prompts, run stochastic DDIM (η > 0) with classifier-free guidance and keep
       every step's latent, next latent and log-probability (align/sampling.py);
    2. reward: score the final images with the judge(s), in a worker thread while the next batch
       samples; pairwise-only judges give win rates within each prompt's group of images;
    3. advantages: gather rewards from all processes, normalise them per prompt (DDPO's stat
       tracker) or per group (GRPO), give each process its share back;
    4. train: shuffle samples and, per sample, the order of its timesteps; for a fraction of the
       timesteps re-score the stored step under the current model and take the PPO-clip loss (plus,
       optionally, the KL to the reference model, as Flow-GRPO does);
       gradients accumulate over the timesteps and ``gradient_accumulation_steps`` batches.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# `accelerate launch align/ddpo.py` runs this file as a script: make the repo importable.
if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from align.advantages import PerPromptStatTracker, compute_advantages  # noqa: E402
from align.api_cost import ddpo_api_plan, guard_on_every_process
from align.cli import ConfigError  # noqa: E402
from align.compiled_sampling import CompileError  # noqa: E402
from align.data import DataError
from align.ddpo_config import DDPOConfig  # noqa: E402
from align.ddpo_rewards import BackgroundRewards, MixedReward, RewardError  # noqa: E402
from align.families import family_of_pipeline
from align.families.base import (
    Conditioning,
    ModelFamily,
    cat_conditioning,
    expand_conditioning,
    guided_prediction,
    repeat_conditioning,
    select_conditioning,
)
from align.families.sd import StableDiffusion
from align.health import images_finite
from align.judges import check_judge_names, load_judge  # noqa: E402
from align.losses import ddpo_clipped_loss, gaussian_mean_kl  # noqa: E402
from align.progress import progress_bar  # noqa: E402
from align.runs import (  # noqa: E402
    RunFolder,
    atomic_write_text,
    restores_old_run_on_failure,
)
from align.sampling import (  # noqa: E402
    check_scheduler_steps,
    ddim_step_mean_std,
    gaussian_log_prob,
    sample_with_logprob,
)
from align.trainer_run import (  # noqa: E402
    check_config_and_model,
    run_trainer,
    save_final_weights,
    start_run,
    write_diffusion_model_card,
)
from align.training import (  # noqa: E402
    TrainingStopped,
    adamw_class,
    apply_matmul_switches,
    end_training,
    evaluate_model,
    keep_default_attention,
    keep_judge_answers,
    load_prompt_list,
    make_accelerator,
    periodic_evaluation,
    periodic_evaluation_due,
    register_trainable_checkpoint_hooks,
    require_pointwise_eval_judge,
    save_checkpoint,
    save_image_row,
    stop_unless_weights_finite,
    tracker_config,
)

STATE_FILE = "ddpo_state.json"


def check_inputs(config: DDPOConfig) -> None:
    """Every bad input that can be found without loading a model or calling a judge."""
    check_config_and_model(config)
    check_judge_names((config.reward, config.eval_judge), "--reward/--eval_judge", allow_mix=True)
    for spec in filter(None, (config.prompts, config.eval_prompts)):
        try:
            if not load_prompt_list(spec):
                raise ConfigError(f"prompt source {spec!r} holds no prompts")
        except DataError as err:
            raise ConfigError(str(err)) from None


def compile_toolchain_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot build its C++ kernels on this CPU (compiler, Python headers), or None."""
    if device.type != "cpu":
        return None
    if not any(c and shutil.which(c) for c in (os.environ.get("CXX"), "g++", "clang++")):
        return "--compile_sampling on a CPU needs a C++ compiler (g++ or clang++, or set CXX) and none was found"
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        return f"--compile_sampling on a CPU needs the Python headers (Python.h), not found in {include}"
    return None


def check_batch_sizes(config: DDPOConfig, num_processes: int) -> int:
    """Sampling batches per process per epoch; the epoch must split into whole batches and optimiser steps."""
    per_round = config.sample_batch_size * num_processes
    if config.samples_per_epoch % per_round:
        raise ConfigError(
            f"--samples_per_epoch ({config.samples_per_epoch}) must be a multiple of --sample_batch_size x processes "
            f"({config.sample_batch_size} x {num_processes} = {per_round})"
        )
    per_process = config.samples_per_epoch // num_processes
    per_update = config.train_batch_size * config.gradient_accumulation_steps
    if per_process % per_update:
        raise ConfigError(
            f"samples per process per epoch ({per_process}) must be a multiple of --train_batch_size x "
            f"--gradient_accumulation_steps ({config.train_batch_size} x {config.gradient_accumulation_steps} = {per_update})"
        )
    return config.samples_per_epoch // per_round


# ----------------------------------------------------------------------------------------------
# Every random draw of epoch e comes from a generator seeded by (seed, e, part, process), so an
# interrupted run resumes exactly without saving sampler or data-loader state.

SAMPLE, TRAIN = "sample", "train"


def epoch_generator(seed: int, epoch: int, part: str, index: int, process: int) -> torch.Generator:
    key = f"{seed}/{epoch}/{part}/{index}/{process}".encode()
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))


def draw_prompts(prompts: list[str], config: DDPOConfig, gen: torch.Generator) -> list[str]:
    """sample_batch_size prompts: uniform draws (with replacement), each repeated images_per_prompt times (a group)."""
    n = config.sample_batch_size // config.images_per_prompt
    picks = torch.randint(len(prompts), (n,), generator=gen).tolist()
    return [prompts[i] for i in picks for _ in range(config.images_per_prompt)]


@dataclass
class SampleBatch:
    prompts: list[str]
    cond: Conditioning  # the family's conditioning of each prompt (batch-first tensors)
    all_latents: torch.Tensor  # [B, T+1, C, H, W]
    timesteps: torch.Tensor  # [B, T]
    log_probs: torch.Tensor  # [B, T]
    images: torch.Tensor  # [B, 3, H, W] in [0, 1], CPU


def sampling_merges_lora(config: DDPOConfig) -> bool:
    """Sample with the LoRA folded into the weights (~12% faster on the testbed) when that computes what the
    training forward does: in fp32 up to rounding; under fp16/bf16 only if training uses the merged weight too
    (else the rounding differs, the first minibatch is off-policy and PPO clips it)."""
    return config.mixed_precision == "no" or config.lora_merged_forward


def collect_samples(pipe, family, sampler, config, prompts, negative, epoch, process, num_batches, background,
                    latent_shape, resolution):
    """Sample num_batches batches; rewards are computed in the background as each batch finishes.

    ``sampler`` is the family's denoiser or a compiled wrapper of it; ``negative`` the one-row conditioning
    of the empty prompt (classifier-free guidance's unconditional side).
    """
    from align.pipeline import decode_latents, merged_adapter

    batches, futures = [], []
    merge = merged_adapter(family.denoiser(pipe)) if sampling_merges_lora(config) else contextlib.nullcontext()
    with merge:
        for b in range(num_batches):
            gen = epoch_generator(config.seed, epoch, SAMPLE, b, process)
            batch_prompts = draw_prompts(prompts, config, gen)
            cond = family.encode_prompts(pipe, batch_prompts, resolution)
            embeds = cond["prompt_embeds"]
            noise = torch.randn((len(batch_prompts), *latent_shape), generator=gen).to(embeds.device, embeds.dtype)
            trajectory = sample_with_logprob(
                sampler, pipe.scheduler, cond, expand_conditioning(negative, len(batch_prompts)),
                num_inference_steps=config.num_inference_steps, guidance_scale=config.guidance_scale,
                eta=config.eta, latents=noise, generator=gen,
                stochastic_steps=config.num_train_timesteps if config.deterministic_tail else None, family=family,
            )
            images = decode_latents(pipe, trajectory.final_latents).cpu()  # the family's decoder
            futures.append(background.submit(batch_prompts, images))
            batches.append(SampleBatch(batch_prompts, cond, trajectory.all_latents, trajectory.timesteps, trajectory.log_probs, images))
    return batches, futures


def gather_rewards(accelerator, futures) -> tuple[torch.Tensor | None, dict[str, float], str | None]:
    """Wait for this process's rewards; every process learns whether any judge failed anywhere."""
    error, rewards, parts = None, [], {}
    for future in futures:
        try:
            total, members = future.result()
        except RewardError as err:
            error = str(err)
            break
        rewards.append(total)
        for name, values in members.items():
            parts.setdefault(name, []).append(values)
    failed = accelerator.gather(torch.tensor([1.0 if error else 0.0], device=accelerator.device)).max()
    if failed > 0:
        return None, {}, error or "a judge failed on another process"
    means = {f"reward_{n}": float(accelerator.gather(torch.cat(v).to(accelerator.device)).mean()) for n, v in parts.items()}
    return torch.cat(rewards), means, None


# ----------------------------------------------------------------------------------------------
# Training


@restores_old_run_on_failure
def train(config: DDPOConfig) -> Path:
    """Run DDPO; returns the run folder."""
    from accelerate.utils import gather_object, set_seed
    from diffusers.optimization import get_scheduler

    from align.pipeline import (
        add_lora,
        disabled_adapter,
        frozen_copy,
        load_pipeline,
        lora_as_merged_weight,
    )

    check_inputs(config)
    run = RunFolder(config.output_dir, resume=config.resume, overwrite=config.overwrite)
    log_with = None if config.report_to == "none" else config.report_to
    accelerator, config.mixed_precision = make_accelerator(  # the flag, else accelerate's setting; recorded resolved
        config.mixed_precision, "ddpo", log_with=log_with, project_dir=str(run.path))
    apply_matmul_switches(config.allow_tf32)
    main, process = accelerator.is_main_process, accelerator.process_index
    num_batches = check_batch_sizes(config, accelerator.num_processes)
    if config.compile_sampling and (problem := compile_toolchain_problem(accelerator.device)):
        raise ConfigError(problem)  # else it would fail at the first sampling step

    # The judges and prompts before anything is written or generated: a missing API key stops us here,
    # and with --overwrite the old run is still whole.
    reward_fn = MixedReward(config.reward, loader=load_judge)
    if reward_fn.needs_groups and config.images_per_prompt < 2:
        raise ConfigError(
            f"--reward {config.reward!r} has a pairwise-only judge: rewards are win rates within a prompt's group, "
            "so --images_per_prompt must be >= 2"
        )
    eval_judge = None
    if main and config.eval_prompts:
        eval_reward = MixedReward(config.eval_judge, loader=load_judge) if config.eval_judge else reward_fn
        require_pointwise_eval_judge(eval_reward.spec, not eval_reward.needs_groups)
        eval_judge = ScoreOnly(eval_reward)
    prompts = load_prompt_list(config.prompts)
    # The paid judge calls, counted and priced before any is made (refused above --max_api_cost).
    eval_members = eval_judge.reward.members if eval_judge is not None else []  # the main process's only
    eval_prompts = len(load_prompt_list(config.eval_prompts)) if eval_judge is not None else 0
    guard_on_every_process(accelerator, ddpo_api_plan(config, reward_fn.members, eval_members, eval_prompts),
                           config.max_api_cost)

    start_run(accelerator, run, config)
    members = reward_fn.members + (eval_judge.reward.members if eval_judge is not None else [])
    keep_judge_answers([member.judge for member in members], run.path, process)
    set_seed(config.seed)

    # Frozen parts in the compute dtype; trainable weights stay in float32.
    weight_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.mixed_precision, torch.float32)
    pipe = load_pipeline(config.model, dtype=weight_dtype if config.finetune == "lora" else torch.float32, device=accelerator.device)
    family = family_of_pipeline(pipe)
    check_scheduler_steps(pipe.scheduler, config.num_inference_steps, config.eta)
    for module in family.frozen_modules(pipe):
        module.requires_grad_(False)
    unet = family.denoiser(pipe)  # the UNet (or transformer) that trains
    resolution = config.resolution or native_resolution(pipe, unet)
    latent_shape = family.latent_shape(pipe, resolution)

    keep_default_attention(unet)
    if config.finetune == "lora":
        add_lora(unet, rank=config.lora_rank, target_modules=family.lora_targets)
        for p in unet.parameters():
            if p.requires_grad:
                p.data = p.data.float()
        reference = None  # the same UNet with the adapter off
    else:
        unet.requires_grad_(True)
        reference = frozen_copy(unet) if config.kl_coef > 0 else None
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    params = [p for p in unet.parameters() if p.requires_grad]

    samples_per_process = config.samples_per_epoch // accelerator.num_processes
    updates_per_epoch = samples_per_process // (config.train_batch_size * config.gradient_accumulation_steps)
    if main:
        print(
            f"[ddpo] samples per epoch: {config.samples_per_epoch} = {config.sample_batch_size} per batch x "
            f"{num_batches} batches x {accelerator.num_processes} processes | images per prompt: {config.images_per_prompt} | "
            f"train batch: {config.train_batch_size} x {config.gradient_accumulation_steps} accumulation x "
            f"{config.num_train_timesteps}/{config.num_inference_steps} timesteps | optimiser steps per epoch: "
            f"{updates_per_epoch} | epochs: {config.num_epochs} | finetune: {config.finetune} "
            f"({sum(p.numel() for p in params):,} trainable parameters) | reward: {config.reward} | "
            f"advantage: {config.advantage} | kl_coef: {config.kl_coef}",
            flush=True,
        )
        if reward_fn.needs_groups:  # what a paid judge will be asked, before it is asked
            per_epoch = config.samples_per_epoch * (config.images_per_prompt - 1) // 2
            print(f"[ddpo] pairwise judge: every pair of a caption's {config.images_per_prompt} images is compared, "
                  f"at least {per_epoch:,} comparisons per epoch ({per_epoch * config.num_epochs:,} in all; more when a "
                  "caption is drawn twice in a batch; API and VLM judges ask each in both image orders)", flush=True)

    optimizer = adamw_class(config.use_8bit_adam)(params, lr=config.learning_rate, weight_decay=config.adam_weight_decay)  # β, ε: PyTorch's
    lr_scheduler = get_scheduler(
        config.lr_scheduler, optimizer=optimizer, num_warmup_steps=config.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=config.num_epochs * updates_per_epoch * accelerator.num_processes,
    )  # accelerate steps a prepared scheduler once per process
    train_unet, optimizer, lr_scheduler = accelerator.prepare(unet, optimizer, lr_scheduler)
    register_trainable_checkpoint_hooks(accelerator, config.finetune == "lora")
    tracker = PerPromptStatTracker(config.stat_buffer_size, config.stat_min_count)
    negative = family.encode_prompts(pipe, [""], resolution)
    negative_embed = negative["prompt_embeds"]
    sampling_unet = unet
    if config.compile_sampling and config.finetune == "full":
        # Every weight trains, and compiling ahead of time bakes some small ones into the code.
        sampling_unet = torch.compile(unet)
    elif config.compile_sampling:  # after the LoRA is added: the compiled code reads the UNet's weights at each call
        from align.compiled_sampling import CompiledSamplingUNet, SamplingShapes, ensure_package

        rows = config.sample_batch_size * (1 if config.guidance_scale == 1.0 else 2)
        shapes = SamplingShapes((rows, *latent_shape), (rows,), (rows, *negative_embed.shape[1:]), str(negative_embed.dtype))
        if main:  # in the per-user cache, never the run folder (native code from a data folder never loads)
            ensure_package(config.model, shapes, accelerator.device)
        accelerator.wait_for_everyone()  # the other processes load what the main one built
        sampling_unet = CompiledSamplingUNet(ensure_package(config.model, shapes, accelerator.device)[0], unet, shapes)
        error = sampling_unet.check_against_eager()
        if main:
            print(f"[ddpo] compiled sampling UNet for {rows} rows; relative difference from eager {error:.1e}", flush=True)

    # Resume: weights, optimiser and the reward statistics; the epoch seeds do the rest.
    start_epoch, global_step = 0, 0
    checkpoint = run.resume_checkpoint()
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        state = json.loads((checkpoint / STATE_FILE).read_text())
        start_epoch, global_step = state["epoch"], state["global_step"]
        tracker.load_state_dict(state["tracker"])
        if main:
            run.truncate_metrics(start_epoch)
            print(f"[ddpo] resumed from {checkpoint} at epoch {start_epoch}", flush=True)
    elif config.resume and main:
        run.truncate_metrics(0)
        print("[ddpo] --resume latest: no checkpoint yet, starting from epoch 0", flush=True)
    if log_with:
        accelerator.init_trackers("ddpo", config=tracker_config(config))
    if main and eval_judge is not None and start_epoch == 0:
        evaluate_model(pipe, eval_judge, config, config.num_inference_steps, config.guidance_scale,
                       run.path / "eval_before.json", "before")

    background = BackgroundRewards(reward_fn)
    last_good = run.latest_checkpoint()
    merged_lora = config.finetune == "lora" and config.lora_merged_forward  # the training forward (pipeline.py)
    progress = progress_bar(range(start_epoch, config.num_epochs), desc="ddpo", unit="epoch", enabled=accelerator.is_local_main_process)
    try:
        for epoch in progress:
            epoch_start, epoch_cpu_start = time.perf_counter(), time.process_time()
            # 1-2. Sample and reward (the judge works on batch b while batch b+1 samples).
            unet.eval()
            with accelerator.autocast():
                batches, futures = collect_samples(
                    pipe, family, sampling_unet, config, prompts, negative, epoch, process, num_batches, background,
                    latent_shape, resolution,
                )
            local_rewards, reward_parts, error = gather_rewards(accelerator, futures)
            stop_on_nonfinite_images(accelerator, batches, epoch, last_good)
            if error:
                raise TrainingStopped(
                    f"reward failed at epoch {epoch}: {error}. Stopped before the update; the last good checkpoint is "
                    f"{last_good or 'none (no checkpoint was written yet)'} (continue with --resume latest)"
                )
            sample_seconds = time.perf_counter() - epoch_start

            # 3. Advantages on every process's rewards, then this process's share.
            local_prompts = [p for b in batches for p in b.prompts]
            all_rewards = accelerator.gather(local_rewards.to(accelerator.device)).cpu().double().numpy()
            all_prompts = gather_object(local_prompts)
            advantages = compute_advantages(config.advantage, all_prompts, all_rewards, tracker)
            advantages = torch.as_tensor(advantages, dtype=torch.float32).reshape(accelerator.num_processes, -1)[process]

            # 4. PPO on the stored trajectories.
            unet.train()
            samples = {
                "cond": cat_conditioning([b.cond for b in batches]),
                "all_latents": torch.cat([b.all_latents for b in batches]),
                "timesteps": torch.cat([b.timesteps for b in batches]),
                "log_probs": torch.cat([b.log_probs for b in batches]),
                "advantages": advantages.to(accelerator.device),
            }
            stats: dict[str, list[float]] = {}
            with lora_as_merged_weight(unet) if merged_lora else contextlib.nullcontext():
                gen = epoch_generator(config.seed, epoch, TRAIN, 0, process)
                global_step += train_inner_epoch(
                    config, accelerator, train_unet, unet, reference, optimizer, params, pipe.scheduler,
                    samples, negative, gen, stats, disabled_adapter, lr_scheduler, family=family,
                )

            # 5. Log, save samples, checkpoint.
            done = epoch + 1
            stop_unless_weights_finite(params, f"epoch {epoch}", last_good)
            logs = {k: float(np.mean(v)) for k, v in stats.items()}
            logs = {k: float(accelerator.reduce(torch.tensor(v, device=accelerator.device), "mean")) for k, v in logs.items()}
            logs.update(reward_parts)
            logs.update({
                "reward_mean": float(all_rewards.mean()), "reward_std": float(all_rewards.std()),
                "epoch": done, "global_step": global_step, "samples_seen": done * config.samples_per_epoch,
                "lr": lr_scheduler.get_last_lr()[0],
                "samples_per_second": config.samples_per_epoch / (time.perf_counter() - epoch_start),
                "sampling_seconds": sample_seconds,
                "epoch_cpu_seconds": time.process_time() - epoch_cpu_start,  # this process, all threads
            })
            if config.advantage == "per-prompt":
                logs.update(tracker.stats())
            if main and periodic_evaluation_due(config.eval_every_epochs, done, config.num_epochs):
                logs["heldout_score"] = periodic_evaluation(pipe, eval_judge, config, config.num_inference_steps,
                                                            config.guidance_scale, run.path, done)
            if main:
                run.log(done, logs)
                progress.set_postfix(reward=f"{logs['reward_mean']:.3f}", kl=f"{logs.get('approx_kl', 0):.2e}")
                if config.num_logged_images > 0 and (done % config.sample_log_epochs == 0 or done == config.num_epochs or epoch == start_epoch):
                    log_samples(accelerator, run, batches, local_rewards, config.num_logged_images, done)
            accelerator.log(logs, step=done)
            if done % config.checkpointing_epochs == 0 or done == config.num_epochs:
                last_good = save_ddpo_checkpoint(accelerator, run, done, global_step, tracker, config.checkpoints_total_limit)
    finally:
        background.shutdown()

    # 6. After-evaluation, final weights with their model card (one folder, written as a whole), report.
    #    Each step is redone by --resume latest from the last checkpoint if the run stops before its end.
    accelerator.wait_for_everyone()
    check_weights_in_sync(accelerator, params)
    if main:
        if eval_judge is not None:
            evaluate_model(pipe, eval_judge, config, config.num_inference_steps, config.guidance_scale,
                           run.path / "eval_after.json", "after")
        save_final_weights(accelerator, train_unet, run.path, config.finetune, lambda final: write_model_card(final, config, run),
                           family=family)
        from align.run_report import write_training_report

        write_training_report(run.path, title=f"DDPO: {config.model}", judge=config.eval_judge or config.reward, step_name="epoch",
                              metric_keys=("reward_mean", "approx_kl", "kl_to_reference", "clipfrac", "policy_loss"))
        run.let_go_of_old_run()
    reward_fn.close()
    del train_unet, optimizer, lr_scheduler
    end_training(accelerator)
    return run.path


def native_resolution(pipe, denoiser) -> int:
    """The side in pixels the pipeline generates by default (its ``default_sample_size`` where it has one)."""
    sample_size = getattr(pipe, "default_sample_size", None) or denoiser.config.sample_size
    return int(sample_size) * pipe.vae_scale_factor


def stop_on_nonfinite_images(accelerator, batches, epoch: int, last_good) -> None:
    """A NaN/inf image sampled on any process (a diverged model) stops every process before the update, as a
    failed reward does."""
    bad = 0.0 if all(images_finite(b.images) for b in batches) else 1.0
    if accelerator.gather(torch.tensor([bad], device=accelerator.device)).max() > 0:
        raise TrainingStopped(
            f"non-finite generated images at epoch {epoch}; stopped before the update. The last good checkpoint is "
            f"{last_good or 'none (no checkpoint was written yet)'} (lower --learning_rate, continue with --resume latest)"
        )


def check_weights_in_sync(accelerator, params) -> None:
    """Every process must end with the same trained weights (else gradients were not all-reduced)."""
    if accelerator.num_processes == 1:
        return
    checksum = torch.stack([p.detach().double().sum() for p in params]).sum().reshape(1)
    sums = accelerator.gather(checksum.to(accelerator.device))
    if not bool((sums == sums[0]).all()):
        raise TrainingStopped(f"trained weights differ across processes ({sums.tolist()}): gradients were not synchronised")
    if accelerator.is_main_process:
        print(f"[ddpo] trained weights identical on all {accelerator.num_processes} processes", flush=True)


def train_timestep_indices(n: int, steps_total: int, k: int, selection: str, gen: torch.Generator) -> torch.Tensor:
    """[n, k] indices into each sample's chain: a random subset per sample, or the k noisiest steps."""
    if selection == "high_noise":
        # Sampling runs from high to low noise: the first k steps of the chain, in random order.
        return torch.stack([torch.randperm(k, generator=gen) for _ in range(n)])
    return torch.stack([torch.randperm(steps_total, generator=gen) for _ in range(n)])[:, :k]


def as_conditioning(value) -> Conditioning:
    """A family's conditioning dict; a bare tensor is SD 1.x/2.x's prompt embeddings (benchmarks and tests
    that build samples by hand pass those)."""
    return value if isinstance(value, dict) else {"prompt_embeds": value}


def train_inner_epoch(config, accelerator, train_unet, unet, reference, optimizer, params, scheduler,
                      samples, negative, gen, stats, disabled_adapter, lr_scheduler=None,
                      family: ModelFamily | None = None) -> int:
    """One PPO pass over this epoch's samples; returns the number of optimiser steps taken.

    ``samples["cond"]`` (or ``samples["embeds"]``, SD's bare prompt embeddings) holds each sample's
    conditioning, ``negative`` the one-row unconditional side; ``family`` is the denoiser's (None: SD 1.x/2.x)."""
    n, steps_total = samples["timesteps"].shape
    order = torch.randperm(n, generator=gen)
    time_order = train_timestep_indices(n, steps_total, config.num_train_timesteps, config.timestep_selection, gen)
    per_update = config.train_batch_size * config.gradient_accumulation_steps
    updates = 0
    for u0 in range(0, n, per_update):
        update_samples = order[u0 : u0 + per_update]
        if config.kl_coef == 0:
            # A zero advantage makes a sample's PPO term and its gradient exactly zero (the KL term
            # would not be), so those samples skip the UNet. Binary-ish judges tie whole groups often.
            # Processes may then run different numbers of micro-batches: DDP all-reduces only in each
            # update's one synced backward (the UNet has no buffers to broadcast per forward). One
            # sample is kept if all are zero, so that every process still takes that backward.
            informative = update_samples[samples["advantages"][update_samples] != 0]
            update_samples = informative if len(informative) else update_samples[:1]
        stats.setdefault("trained_sample_fraction", []).append(len(update_samples) / per_update)
        micro_batches = update_samples.split(config.train_batch_size)
        for m, idx in enumerate(micro_batches):
            train_micro_batch(config, accelerator, train_unet, unet, reference, scheduler, samples, negative,
                              stats, disabled_adapter, idx, time_order, per_update, last_of_update=m == len(micro_batches) - 1,
                              family=family)
        if config.max_grad_norm > 0:
            accelerator.clip_grad_norm_(params, config.max_grad_norm)
        optimizer.step()
        if lr_scheduler is not None:
            lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        updates += 1
    return updates


def train_micro_batch(config, accelerator, train_unet, unet, reference, scheduler, samples, negative, stats,
                      disabled_adapter, idx, time_order, per_update, last_of_update, family: ModelFamily | None = None) -> None:
    """Forward and backward of the samples `idx` at their trained timesteps; gradients accumulate, each
    term weighted 1 / (per_update x k), so an update's gradient is the mean over all its samples' terms."""
    device = accelerator.device
    family = family or StableDiffusion()
    k = time_order.shape[1]
    rows = idx[:, None]  # each sample's row, against its k chosen steps
    sample_cond = select_conditioning(as_conditioning(samples["cond"] if "cond" in samples else samples["embeds"]), idx)
    negative = as_conditioning(negative)
    chosen = time_order[idx]
    latents = samples["all_latents"][rows, chosen]  # [b, k, C, H, W]
    next_latents = samples["all_latents"][rows, chosen + 1]
    timesteps = samples["timesteps"][rows, chosen]
    old_log_probs = samples["log_probs"][rows, chosen]
    adv = samples["advantages"][idx]
    # Timesteps go through the UNet `timestep_batch` at a time, flattened into the batch
    # (sample-major): the loss of a chunk is the mean of its per-step losses, so weighting it
    # by chunk / k gives exactly the gradient of one-step-at-a-time accumulation.
    for j0 in range(0, k, config.timestep_batch):
        js = slice(j0, min(j0 + config.timestep_batch, k))
        c = js.stop - js.start
        sync = last_of_update and js.stop == k
        lat = latents[:, js].flatten(0, 1)
        nxt = next_latents[:, js].flatten(0, 1)
        ts = timesteps[:, js].flatten()
        cond = repeat_conditioning(sample_cond, c)
        uncond = expand_conditioning(negative, len(lat))
        with contextlib.nullcontext() if sync else accelerator.no_sync(train_unet):
            with accelerator.autocast():
                pred = guided_prediction(family, train_unet, lat, ts.to(device), cond, uncond, config.guidance_scale)
            mean, std = ddim_step_mean_std(scheduler, pred, ts, lat, config.eta)
            log_prob = gaussian_log_prob(nxt, mean, std)
            loss, metrics = ddpo_clipped_loss(
                log_prob, old_log_probs[:, js].flatten(), adv.repeat_interleave(c), config.clip_range, config.adv_clip_max
            )
            if config.kl_coef > 0:
                with torch.no_grad(), accelerator.autocast():
                    if reference is None:
                        with disabled_adapter(unet):
                            ref_pred = guided_prediction(family, unet, lat, ts.to(device), cond, uncond, config.guidance_scale)
                    else:
                        ref_pred = guided_prediction(family, reference, lat, ts.to(device), cond, uncond, config.guidance_scale)
                ref_mean, _ = ddim_step_mean_std(scheduler, ref_pred, ts, lat, config.eta)
                kl = gaussian_mean_kl(mean, ref_mean, std).mean()
                loss = loss + config.kl_coef * kl
                metrics["kl_to_reference"] = kl.detach()
            if not torch.isfinite(loss):
                raise TrainingStopped("non-finite DDPO loss; stopped before the update (lower --learning_rate)")
            accelerator.backward(loss * (len(idx) * c / (k * per_update)))
        for key, value in {"loss": loss.detach(), **metrics}.items():
            stats.setdefault(key, []).append(float(value))


# ----------------------------------------------------------------------------------------------
# Checkpoints, samples, model card


class ScoreOnly:
    """A reward (mix) seen as a pointwise judge, for the before/after evaluation."""

    def __init__(self, reward: MixedReward):
        self.reward, self.name = reward, reward.spec

    def score(self, prompts, images) -> torch.Tensor:
        return self.reward(prompts, images)[0]


def save_ddpo_checkpoint(accelerator, run: RunFolder, epoch: int, global_step: int, tracker, keep: int) -> Path:
    """accelerate's state (LoRA or UNet, optimiser, RNG) plus the epoch and the reward statistics
    (ddpo_state.json, inside the checkpoint's manifest)."""
    state = {"epoch": epoch, "global_step": global_step, "tracker": tracker.state_dict()}
    return save_checkpoint(accelerator, run, epoch, keep, extra_files={STATE_FILE: json.dumps(state)})


def log_samples(accelerator, run: RunFolder, batches, rewards: torch.Tensor, count: int, epoch: int) -> None:
    """A row of this process's first images under samples/, with their prompts and rewards beside it."""
    images = torch.cat([b.images for b in batches])[:count]
    prompts = [p for b in batches for p in b.prompts][:count]
    values = rewards[:count].tolist()
    path = run.path / "samples" / f"epoch_{epoch:05d}.png"
    save_image_row(images, path)
    atomic_write_text(path.with_suffix(".json"), json.dumps([{"prompt": p, "reward": r} for p, r in zip(prompts, values)], indent=1))
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            import wandb

            tracker.log({"samples": [wandb.Image(img, caption=f"{r:.3f} | {p}") for img, p, r in
                                     zip(images.permute(0, 2, 3, 1).numpy(), prompts, values)]}, step=epoch)
        elif tracker.name == "tensorboard":
            tracker.writer.add_images("samples", images, epoch)


def write_model_card(folder: Path, config: DDPOConfig, run: RunFolder) -> None:
    metrics = run.read_metrics()
    first, last = (metrics[0], metrics[-1]) if metrics else ({}, {})
    tail = ""
    if config.deterministic_tail:
        tail = (f" on the first {config.num_train_timesteps} steps, then {config.num_untrained_timesteps} "
                "deterministic (eta 0) steps")
    write_diffusion_model_card(folder, config.model, config.finetune, "DDPO", "ddpo, reinforcement-learning",
                               f"Trained with DDPO (Black et al. 2023) to maximise the reward `{config.reward}`.", {
        "sampling": f"DDIM, {config.num_inference_steps} steps, eta {config.eta}{tail}, guidance {config.guidance_scale}",
        "trained steps per sample": f"{config.num_train_timesteps} ({config.timestep_selection})",
        "epochs x samples": f"{config.num_epochs} x {config.samples_per_epoch}",
        "advantages": config.advantage,
        "PPO": f"clip range {config.clip_range}, advantage clip {config.adv_clip_max}, KL coefficient {config.kl_coef}",
        "learning rate": f"{config.learning_rate} ({config.lr_scheduler}, {config.lr_warmup_steps} warm-up steps)",
        "reward mean, first epoch": f"{first.get('reward_mean', float('nan')):.4f}",
        "reward mean, last epoch": f"{last.get('reward_mean', float('nan')):.4f}",
    })


def main(argv: list[str] | None = None) -> None:
    run_trainer(DDPOConfig, train, argv, __doc__, stopped=(TrainingStopped, RewardError, CompileError))


if __name__ == "__main__":
    main()
