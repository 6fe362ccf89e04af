"""DDPO (Black et al. 2023, "Training Diffusion Models with Reinforcement Learning") for SD 1.x/2.x and
SDXL, and Flow-GRPO (Liu et al. 2025) / Flow-GRPO-Fast for flow-matching models (SD3, FLUX), with rewards
from any judge in ``rewards``. What differs between model families comes from ``align.families``.

    accelerate launch align/ddpo.py --reward aesthetic --prompts prompts.txt
    accelerate launch align/ddpo.py --config configs/ddpo_sd15.yaml
    python align/ddpo.py --config configs/testbed_ddpo.yaml          # offline, on a CPU

The algorithm box, per epoch:
    1. sample: draw prompts, run stochastic DDIM (η > 0; align/sampling/ddim.py) or, for flow families,
       Flow-GRPO's SDE (noise level a = η; align/sampling/flow.py) with classifier-free guidance, and keep
       every stochastic step's latent, next latent and log-probability. With --deterministic_tail only the
       trained steps are stochastic (DDIM: the noisiest ones; flow: Flow-GRPO-Fast's window);
    2. reward: score the final images with the judge(s), in a worker thread while the next batch
       samples; pairwise-only judges give win rates within each prompt's group of images;
    3. advantages: gather rewards from all processes, normalise them per prompt (DDPO's stat
       tracker) or per group (GRPO), give each process its share back;
    4. train: shuffle samples and, per sample, the order of its timesteps; for a fraction of the
       timesteps re-score the stored step under the current model and take the PPO-clip loss (plus,
       optionally, the KL to the reference model, as Flow-GRPO does; losses in align/train/losses.py);
       gradients accumulate over the timesteps and ``gradient_accumulation_steps`` batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from align.api_cost import ddpo_api_plan, guard_on_every_process
from align.cli import ConfigError
from align.data.pairs import DataError
from align.data.prompt_sets import load_prompt_list
from align.families import UnknownFamilyError, family_of, family_of_pipeline
from align.families.base import (
    Conditioning,
    ModelFamily,
    ModelLoadError,
    cat_conditioning,
    expand_conditioning,
    guided_prediction,
    one_line,
    repeat_conditioning,
    select_conditioning,
)
from align.families.sd import StableDiffusion
from align.health import images_finite
from align.judges import check_judge_names, check_judges_take_prompts, load_judge
from align.pipeline import (
    add_lora,
    check_model,
    decode_latents,
    disabled_adapter,
    frozen_copy,
    load_pipeline,
    merged_adapter,
)
from align.progress import progress_bar
from align.run_folder import (
    RunFolder,
    atomic_write_text,
    restores_old_run_on_failure,
)
from align.sampling.ddim import (
    check_scheduler_steps,
    ddim_step_mean_std,
    gaussian_log_prob,
    sample_with_logprob,
)
from align.sampling.flow import draw_window, flow_grpo_kl, sample_flow_with_logprob, sde_step
from align.sampling.flow import gaussian_log_prob as flow_gaussian_log_prob
from align.train.accelerator import (
    adamw_class,
    end_training,
    keep_default_attention,
    make_accelerator,
    tracker_config,
)
from align.train.advantages import PerPromptStatTracker, compute_advantages
from align.train.checkpoints import (
    check_resume_settings,
    register_trainable_checkpoint_hooks,
    save_checkpoint,
    save_final_weights,
    start_run,
    stop_unless_weights_finite,
    write_diffusion_model_card,
)
from align.train.command import TrainingStopped, check_config_and_model, keep_judge_answers, run_trainer
from align.train.ddpo_config import FAST_WINDOW_SHARE, DDPOConfig
from align.train.ddpo_order import gathered_slots, global_batch, in_global_order, stratified_order
from align.train.ddpo_rewards import BackgroundRewards, MixedReward, RewardError
from align.train.heldout import (
    evaluate_model,
    periodic_evaluation,
    periodic_evaluation_due,
    require_pointwise_eval_judge,
    save_image_row,
)
from align.train.losses import ddpo_clipped_loss, gaussian_mean_kl
from align.train.report import write_training_report

STATE_FILE = "ddpo_state.json"
STAT_BUFFER_SIZE, STAT_MIN_COUNT = 32, 16  # --advantage per-prompt: ddpo-pytorch's per-prompt stat tracking
LOGGED_IMAGES = 8  # training images (with their rewards) saved under samples/ at each checkpoint epoch


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


def resolve_family(config: DDPOConfig) -> ModelFamily:
    """The model's family (from its model_index.json, before any weight loads); fills the sampler options
    left unset with that family's defaults (DDIM: the DDPO paper's; flow: Flow-GRPO's)."""
    try:
        family = family_of(check_model(config.model))
    except ModelLoadError:
        raise
    except (UnknownFamilyError, OSError, ValueError) as err:
        raise ModelLoadError(f"--model {config.model!r}: {one_line(err)}") from None
    config.resolve_for_family(family.is_flow)
    return family


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
    # The recorded steps, [B, T, ...] each. DDIM: all_latents [B, T+1, C, H, W], timesteps, log_probs.
    # Flow: latents and next_latents of each stochastic step, timesteps (σ·1000), step_indices, log_probs.
    steps: dict[str, torch.Tensor]
    images: torch.Tensor  # [B, 3, H, W] in [0, 1], CPU


def sampling_merges_lora(config: DDPOConfig) -> bool:
    """Sample with the LoRA folded into the weights (~12% faster on the testbed) when that computes what the
    training forward does: in fp32 up to rounding; not under fp16/bf16 (the rounding differs, the first
    minibatch would be off-policy and PPO would clip it)."""
    return config.mixed_precision == "no"


def flow_window(config: DDPOConfig, num_steps: int, gen: torch.Generator) -> tuple[int, int] | None:
    """The stochastic steps of a flow sampling batch: every step (None: Flow-GRPO) or, with
    --deterministic_tail, a window of num_train_timesteps steps (Flow-GRPO-Fast): at the start
    (high_noise) or drawn per batch within the first half of the steps (random, the authors' window range)."""
    if not config.deterministic_tail:
        return None
    size = config.num_train_timesteps
    if config.timestep_selection == "high_noise":
        return 0, size
    return draw_window(size, (0, max(size, int(num_steps * FAST_WINDOW_SHARE))), gen)


@torch.no_grad()
def sample_steps(pipe, family, sampler, config, cond, uncond, noise, gen, sigmas) -> tuple[torch.Tensor, dict]:
    """One batch's chain from ``noise``: (final latents, the recorded steps of SampleBatch.steps)."""
    if family.is_flow:
        def velocity(x, t):
            return guided_prediction(family, sampler, x, t, cond, uncond, config.guidance_scale)

        trajectory = sample_flow_with_logprob(velocity, noise, sigmas, flow_window(config, len(sigmas) - 1, gen),
                                              config.eta, generator=gen,
                                              num_train_timesteps=pipe.scheduler.config.num_train_timesteps)
        batch, width = trajectory.log_probs.shape
        return trajectory.final_latents, {
            "latents": trajectory.latents, "next_latents": trajectory.next_latents, "log_probs": trajectory.log_probs,
            "timesteps": trajectory.timesteps.expand(batch, -1).clone(),
            "step_indices": torch.tensor(trajectory.step_indices, device=noise.device).expand(batch, width).clone(),
        }
    trajectory = sample_with_logprob(
        sampler, pipe.scheduler, cond, uncond,
        num_inference_steps=config.num_inference_steps, guidance_scale=config.guidance_scale,
        eta=config.eta, latents=noise, generator=gen,
        stochastic_steps=config.num_train_timesteps if config.deterministic_tail else None, family=family,
    )
    return trajectory.final_latents, {"all_latents": trajectory.all_latents, "timesteps": trajectory.timesteps,
                                      "log_probs": trajectory.log_probs}


def collect_samples(pipe, family, sampler, config, prompts, negative, epoch, process, num_batches, background,
                    latent_shape, resolution, sigmas=None, num_processes=1):
    """Sample num_batches batches; rewards are computed in the background as each batch finishes.

    ``sampler`` is the family's denoiser; ``negative`` the one-row unconditional side of classifier-free
    guidance (the family's); ``sigmas`` the flow families' σ schedule.
    """
    batches, futures = [], []
    merge = merged_adapter(family.denoiser(pipe)) if sampling_merges_lora(config) else contextlib.nullcontext()
    with merge:
        for b in range(num_batches):
            # keyed by the global batch: N processes draw what one process with N times the batches draws
            gen = epoch_generator(config.seed, epoch, SAMPLE, global_batch(b, process, num_processes), 0)
            batch_prompts = draw_prompts(prompts, config, gen)
            cond = family.encode_prompts(pipe, batch_prompts, resolution)
            embeds = cond["prompt_embeds"]
            noise = torch.randn((len(batch_prompts), *latent_shape), generator=gen).to(embeds.device, embeds.dtype)
            final, steps = sample_steps(pipe, family, sampler, config, cond, expand_conditioning(negative, len(batch_prompts)),
                                        noise, gen, sigmas)
            images = decode_latents(pipe, final).cpu()  # the family's decoder
            futures.append(background.submit(batch_prompts, images))
            batches.append(SampleBatch(batch_prompts, cond, steps, images))
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

    check_inputs(config)
    family = resolve_family(config)
    run = RunFolder(config.output_dir, resume=config.resume, overwrite=config.overwrite)
    check_resume_settings(run, config)  # a resumed run keeps its settings (or is refused in one line)
    log_with = None if config.report_to == "none" else config.report_to
    accelerator, config.mixed_precision = make_accelerator(  # the flag, else accelerate's setting; recorded resolved
        config.mixed_precision, "ddpo", log_with=log_with, project_dir=str(run.path))
    main, process = accelerator.is_main_process, accelerator.process_index
    num_batches = check_batch_sizes(config, accelerator.num_processes)

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
    check_judges_take_prompts([reward_fn], prompts, "--prompts")  # a rule judge that cannot parse one stops here
    if eval_judge is not None:
        check_judges_take_prompts([eval_judge.reward], load_prompt_list(config.eval_prompts), "--eval_prompts")
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
    if family_of_pipeline(pipe) is not family:
        raise ConfigError(f"--model {config.model!r} loaded as {family_of_pipeline(pipe).name}, detected as {family.name}")
    if not family.is_flow:
        check_scheduler_steps(pipe.scheduler, config.num_inference_steps, config.eta)
    for module in family.frozen_modules(pipe):
        module.requires_grad_(False)
    unet = family.denoiser(pipe)  # the UNet (or transformer) that trains
    resolution = config.resolution or family.native_resolution(pipe)
    latent_shape = family.latent_shape(pipe, resolution)

    if not family.is_flow:  # SD3/FLUX keep their joint-attention processors
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
            f"advantage: {config.advantage} | kl_coef: {config.kl_coef} | family: {family.name} "
            f"({sampler_name(family, config)})",
            flush=True,
        )
        if reward_fn.needs_groups:  # what a paid judge will be asked, before it is asked
            per_epoch = config.samples_per_epoch * (config.images_per_prompt - 1) // 2
            print(f"[ddpo] pairwise judge: every pair of a caption's {config.images_per_prompt} images is compared, "
                  f"at least {per_epoch:,} comparisons per epoch ({per_epoch * config.num_epochs:,} in all; more when a "
                  "caption is drawn twice in a batch; API and VLM judges ask each in both image orders)", flush=True)

    optimizer = adamw_class(config.use_8bit_adam)(params, lr=config.learning_rate, weight_decay=config.adam_weight_decay)  # β, ε: PyTorch's
    train_unet, optimizer = accelerator.prepare(unet, optimizer)  # a constant learning rate, as the papers
    register_trainable_checkpoint_hooks(accelerator, config.finetune == "lora")
    tracker = PerPromptStatTracker(STAT_BUFFER_SIZE, STAT_MIN_COUNT)
    negative = family.unconditional(pipe, 1, resolution)  # what the family's pipeline uses without a negative prompt
    sigmas = family.flow_sigmas(pipe, config.num_inference_steps, resolution).to(accelerator.device) if family.is_flow else None
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
        evaluate_model(pipe, eval_judge, config, config.eval_inference_steps, config.guidance_scale,
                       run.path / "eval_before.json", "before")

    background = BackgroundRewards(reward_fn)
    last_good = run.latest_checkpoint()
    progress = progress_bar(range(start_epoch, config.num_epochs), desc="ddpo", unit="epoch", enabled=accelerator.is_local_main_process)
    try:
        for epoch in progress:
            epoch_start, epoch_cpu_start = time.perf_counter(), time.process_time()
            # 1-2. Sample and reward (the judge works on batch b while batch b+1 samples).
            unet.eval()
            with accelerator.autocast():
                batches, futures = collect_samples(
                    pipe, family, unet, config, prompts, negative, epoch, process, num_batches, background,
                    latent_shape, resolution, sigmas, accelerator.num_processes,
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
            advantages = in_global_order(lambda p, r: compute_advantages(config.advantage, p, r, tracker), all_prompts, all_rewards,
                                         gathered_slots(accelerator.num_processes, num_batches, config.sample_batch_size))
            advantages = torch.as_tensor(advantages, dtype=torch.float32).reshape(accelerator.num_processes, -1)[process]

            # 4. PPO on the stored trajectories.
            unet.train()
            samples = {key: torch.cat([b.steps[key] for b in batches]) for key in batches[0].steps}
            samples.update(cond=cat_conditioning([b.cond for b in batches]), advantages=advantages.to(accelerator.device))
            if sigmas is not None:
                samples["sigmas"] = sigmas  # the σ schedule the step indices point into (not per sample)
            stats: dict[str, list[float]] = {}
            gens = [epoch_generator(config.seed, epoch, TRAIN, global_batch(b, process, accelerator.num_processes), 0)
                    for b in range(num_batches)]  # one per sampling batch, keyed by the global batch (ddpo_order.py)
            schedule = stratified_order(gens, config.sample_batch_size, functools.partial(
                train_timestep_indices, config.sample_batch_size, samples["timesteps"].shape[1],
                config.num_train_timesteps, config.timestep_selection))
            global_step += train_inner_epoch(
                config, accelerator, train_unet, unet, reference, optimizer, params, pipe.scheduler,
                samples, negative, gens[0], stats, disabled_adapter, family=family, schedule=schedule,
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
                "samples_per_second": config.samples_per_epoch / (time.perf_counter() - epoch_start),
                "sampling_seconds": sample_seconds,
                "epoch_cpu_seconds": time.process_time() - epoch_cpu_start,  # this process, all threads
            })
            if config.advantage == "per-prompt":
                logs.update(tracker.stats())
            if main and periodic_evaluation_due(config.eval_every_epochs, done, config.num_epochs):
                logs["heldout_score"] = periodic_evaluation(pipe, eval_judge, config, config.eval_inference_steps,
                                                            config.guidance_scale, run.path, done)
            if main:
                run.log(done, logs)
                progress.set_postfix(reward=f"{logs['reward_mean']:.3f}", kl=f"{logs.get('approx_kl', 0):.2e}")
                if done % config.checkpointing_epochs == 0 or done == config.num_epochs or epoch == start_epoch:
                    log_samples(accelerator, run, batches, local_rewards, LOGGED_IMAGES, done)
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
            evaluate_model(pipe, eval_judge, config, config.eval_inference_steps, config.guidance_scale,
                           run.path / "eval_after.json", "after")
        save_final_weights(accelerator, train_unet, run.path, config.finetune, lambda final: write_model_card(final, config, run, family),
                           family=family)

        write_training_report(run.path, title=f"{method_name(family)}: {config.model}", judge=config.eval_judge or config.reward, step_name="epoch",
                              metric_keys=("reward_mean", "approx_kl", "kl_to_reference", "clipfrac", "policy_loss"))
        run.let_go_of_old_run()
    reward_fn.close()
    del train_unet, optimizer
    end_training(accelerator)
    return run.path


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


def train_inner_epoch(config, accelerator, train_unet, unet, reference, optimizer, params, scheduler,
                      samples, negative, gen, stats, disabled_adapter, family: ModelFamily | None = None,
                      schedule=None) -> int:
    """One PPO pass over this epoch's samples; returns the number of optimiser steps taken.

    ``schedule``: (sample order, each sample's trained steps) as the trainer draws them (ddpo_order.py); else drawn
    from ``gen``.

    ``samples["cond"]`` holds each sample's conditioning, ``negative`` the one-row unconditional side; ``family`` is the denoiser's (None: SD 1.x/2.x)."""
    family = family or StableDiffusion()
    if config.eta is None or config.num_inference_steps is None:  # built by hand (tests, benchmarks), not by train()
        config = dataclasses.replace(config)
        config.resolve_for_family(family.is_flow)
    n, steps_total = samples["timesteps"].shape
    if schedule is not None:
        order, time_order = schedule
    else:
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
        optimizer.zero_grad(set_to_none=True)
        updates += 1
    return updates


def step_pairs(samples, rows, chosen) -> tuple[torch.Tensor, torch.Tensor]:
    """Input and output latents of the chosen steps: DDIM keeps the whole chain, flow its stochastic steps' pairs."""
    if "all_latents" in samples:
        return samples["all_latents"][rows, chosen], samples["all_latents"][rows, chosen + 1]
    return samples["latents"][rows, chosen], samples["next_latents"][rows, chosen]


def policy_step(family, scheduler, config, samples, prediction, timesteps, latents, step_indices):
    """(mean, std, log-density function, KL function) of the step's Gaussian under ``prediction``, in float32:
    DDIM's step (align/sampling/ddim.py) or Flow-GRPO's SDE step (align/sampling/flow.py) with the KL the authors
    train with; each exactly as the sampler computed it, so the first minibatch is on-policy."""
    if family.is_flow:
        sigmas = samples["sigmas"]
        step = sde_step(latents, prediction, sigmas[step_indices], sigmas[step_indices + 1], float(sigmas[1]), config.eta)
        return step.mean, step.std, flow_gaussian_log_prob, lambda mean, ref_mean: flow_grpo_kl(mean, ref_mean, step.sde_sigma)
    mean, std = ddim_step_mean_std(scheduler, prediction, timesteps, latents, config.eta)
    return mean, std, gaussian_log_prob, lambda mean, ref_mean: gaussian_mean_kl(mean, ref_mean, std)


def trained_prediction(family, denoiser, latents, timesteps, cond, uncond, guidance_scale) -> torch.Tensor:
    """The guided prediction the update differentiates: ``guided_prediction``'s value; for flow families the
    unconditional half carries no gradient, as Flow-GRPO's ``compute_log_prob`` detaches it (DDPO, as
    ddpo-pytorch, differentiates both halves)."""
    if not family.is_flow or guidance_scale == 1.0 or family.uses_guidance_embedding(denoiser):
        return guided_prediction(family, denoiser, latents, timesteps, cond, uncond, guidance_scale)
    out = family.predict(denoiser, torch.cat([latents, latents]), torch.cat([timesteps, timesteps]),
                         cat_conditioning([uncond, cond]))
    uncond_out, cond_out = out.float().chunk(2)
    uncond_out = uncond_out.detach()
    return uncond_out + guidance_scale * (cond_out - uncond_out)


def train_micro_batch(config, accelerator, train_unet, unet, reference, scheduler, samples, negative, stats,
                      disabled_adapter, idx, time_order, per_update, last_of_update, family: ModelFamily | None = None) -> None:
    """Forward and backward of the samples `idx` at their trained timesteps; gradients accumulate, each
    term weighted 1 / (per_update x k), so an update's gradient is the mean over all its samples' terms."""
    device = accelerator.device
    family = family or StableDiffusion()
    k = time_order.shape[1]
    rows = idx[:, None]  # each sample's row, against its k chosen steps
    sample_cond = select_conditioning(samples["cond"], idx)
    chosen = time_order[idx]
    latents, next_latents = step_pairs(samples, rows, chosen)  # [b, k, C, H, W]
    timesteps = samples["timesteps"][rows, chosen]
    step_indices = samples["step_indices"][rows, chosen] if family.is_flow else None
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
                pred = trained_prediction(family, train_unet, lat, ts.to(device), cond, uncond, config.guidance_scale)
            step_index = step_indices[:, js].flatten() if family.is_flow else None
            mean, std, log_density, kl_to = policy_step(family, scheduler, config, samples, pred, ts, lat, step_index)
            log_prob = log_density(nxt, mean, std)
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
                ref_mean = policy_step(family, scheduler, config, samples, ref_pred, ts, lat, step_index)[0]
                kl = kl_to(mean, ref_mean).mean()
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


def method_name(family: ModelFamily) -> str:
    return "Flow-GRPO" if family.is_flow else "DDPO"


def sampler_name(family: ModelFamily, config: DDPOConfig) -> str:
    """How the training sampler runs, in words (the startup line and the model card)."""
    k, n = config.num_train_timesteps, config.num_inference_steps
    if family.is_flow:
        noise = f"SDE noise level {config.eta}"
        if not config.deterministic_tail:
            return f"Flow-GRPO SDE on all {n} steps, {noise}"
        where = "the first steps" if config.timestep_selection == "high_noise" else "drawn per batch in the first half"
        return f"Flow-GRPO-Fast: SDE on a window of {k} of {n} steps ({where}), ODE elsewhere, {noise}"
    tail = f" on the first {k} steps, then {n - k} deterministic (eta 0) steps" if config.deterministic_tail else ""
    return f"DDIM, {n} steps, eta {config.eta}{tail}"


def write_model_card(folder: Path, config: DDPOConfig, run: RunFolder, family: ModelFamily) -> None:
    metrics = run.read_metrics()
    first, last = (metrics[0], metrics[-1]) if metrics else ({}, {})
    method = method_name(family)
    paper = "Liu et al. 2025" if family.is_flow else "Black et al. 2023"
    write_diffusion_model_card(folder, config.model, config.finetune, method, f"{method.lower()}, reinforcement-learning",
                               f"Trained with {method} ({paper}) to maximise the reward `{config.reward}`.", {
        "sampling": f"{sampler_name(family, config)}, guidance {config.guidance_scale}",
        "evaluation sampler": f"the pipeline's own, {config.eval_inference_steps} steps",
        "trained steps per sample": f"{config.num_train_timesteps} ({config.timestep_selection})",
        "epochs x samples": f"{config.num_epochs} x {config.samples_per_epoch}",
        "advantages": config.advantage,
        "PPO": f"clip range {config.clip_range}, advantage clip {config.adv_clip_max}, KL coefficient {config.kl_coef}",
        "learning rate": f"{config.learning_rate} (constant)",
        "reward mean, first epoch": f"{first.get('reward_mean', float('nan')):.4f}",
        "reward mean, last epoch": f"{last.get('reward_mean', float('nan')):.4f}",
    })


def main(argv: list[str] | None = None) -> None:
    run_trainer(DDPOConfig, train, argv, __doc__, stopped=(TrainingStopped, RewardError))


if __name__ == "__main__":
    main()
