"""Diffusion-DPO (Wallace et al., CVPR 2024) for SD 1.x/2.x, SDXL, SD3/SD3.5 and FLUX, with preference pairs
from a dataset or made on the fly by a judge.

    accelerate launch align/dpo.py --reward gpt4o --prompts prompts.txt
    accelerate launch align/dpo.py --dataset yuvalkirstain/pickapic_v2
    python align/dpo.py --config configs/testbed_dpo.yaml          # offline, on a CPU

The algorithm box, per optimisation step (the model family, align/families, supplies t, x_t and the target):
    1. take pairs (caption c, preferred x_w, rejected x_l) and encode them to latents and conditioning;
    2. draw one timestep t and one noise ε per pair, shared by x_w and x_l;
    3. err(x) = ‖f_θ(x_t, t, c) − target‖² averaged over C, H, W, for the model and the frozen reference
       (target: ε, v, or the flow velocity ε − x for SD3/FLUX);
    4. loss = −log σ(−β/2 · [(err_θ(w) − err_ref(w)) − (err_θ(l) − err_ref(l))]).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from align.api_cost import dpo_api_plan, guard_api_cost
from align.cli import ConfigError
from align.data.feedback import generate_feedback, make_pipeline_generator, pairwise_scheme
from align.data.latent_store import (
    COND_PREFIX,
    StoreLatents,
    StoreSpec,
    build_store,
    check_store,
    model_fingerprint,
    native_resolution,
    read_manifest,
)
from align.data.pair_stream import PairPixels, PlannedBatches, micro_batch_loader, open_pairs
from align.data.pairs import DataError
from align.data.prompt_overlap import check_heldout_disjoint
from align.data.prompt_sets import load_prompt_list
from align.families import family_of_pipeline
from align.families.base import cat_conditioning, conditioning_to
from align.health import degenerate_reason
from align.judges import check_judge_names, check_judges_take_prompts, load_judge
from align.pipeline import add_lora, disabled_adapter, frozen_copy, load_pipeline, testbed_settings
from align.progress import progress_bar
from align.run_folder import (
    RunFolder,
    restores_old_run_on_failure,
)
from align.train.accelerator import (
    adamw_class,
    apply_matmul_switches,
    end_training,
    keep_default_attention,
    make_accelerator,
    tracker_config,
)
from align.train.checkpoints import (
    check_resume_settings,
    register_trainable_checkpoint_hooks,
    resume_from_checkpoint,
    save_checkpoint,
    save_final_weights,
    start_run,
    stop_unless_weights_finite,
    write_diffusion_model_card,
)
from align.train.command import TrainingStopped, check_config_and_model, keep_judge_answers, run_trainer
from align.train.dpo_config import RUN_STORE, DPOConfig
from align.train.heldout import (
    evaluate_model,
    periodic_evaluation,
    periodic_evaluation_due,
    require_pointwise_eval_judge,
)
from align.train.losses import diffusion_dpo_loss, per_sample_mse
from align.train.report import write_training_report
from align.train.sharding import (
    consolidated_model,
    full_weights_for_main,
    pipeline_device,
    place_frozen_parts,
    shard_frozen,
    use_family_blocks,
)
from rewards.images import to_tensor

# ----------------------------------------------------------------------------------------------
# Prompts and pairs


def check_inputs(config: DPOConfig) -> None:
    """Every bad input that can be found without loading a model or calling a judge."""
    check_config_and_model(config)
    check_judge_names((config.reward, config.eval_judge), "--reward/--eval_judge")
    prompt_specs = (config.prompts if config.reward else None, config.eval_prompts)
    for spec in filter(None, prompt_specs):
        load_prompt_list(spec)
    check_heldout_disjoint(*prompt_specs)
    if config.reward and len(load_prompt_list(config.prompts)) < config.feedback_rounds:
        raise ConfigError(f"--prompts {config.prompts!r} holds fewer prompts than --feedback_rounds ({config.feedback_rounds})")
    if config.dataset and not Path(config.dataset).exists() and config.dataset.startswith((".", "/", "~")):
        raise ConfigError(f"--dataset {config.dataset!r}: no such file or folder")


# ----------------------------------------------------------------------------------------------
# Batches: every random draw of step s comes from a generator seeded by (seed, s, micro-step,
# process), so an interrupted run resumes exactly without saving data-loader state.


def step_generator(seed: int, step: int, micro: int, process: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1009 + micro) * 101 + process)


class PairOrder:
    """Epoch-wise shuffled order of pair indices, addressable by a global sample counter."""

    def __init__(self, num_pairs: int, seed: int):
        self.num_pairs, self.seed, self._perms = num_pairs, seed, {}

    def index(self, counter: int) -> int:
        epoch, position = divmod(counter, self.num_pairs)
        if epoch not in self._perms:
            self._perms = {epoch: torch.randperm(self.num_pairs, generator=torch.Generator().manual_seed(self.seed + epoch))}
        return int(self._perms[epoch][position])


def micro_batch_keys(order: PairOrder, config: DPOConfig, step: int, micro: int, process: int, processes: int):
    """The generator of one micro-step and its items (pair, flip, caption dropped) drawn from it; the
    DataLoader's sampler calls this too, so what is read is a function of the step."""
    # Keyed by the micro-batch's global slot (micro-step x processes + process), not by the process: N
    # processes with accumulation A draw what one process with accumulation N x A draws, in the same order.
    gen = step_generator(config.seed, step, micro * processes + process, 0)
    counter = ((step * config.gradient_accumulation_steps + micro) * processes + process) * config.train_batch_size
    batch = [order.index(counter + k) for k in range(config.train_batch_size)]
    flips = (torch.rand(len(batch), generator=gen) < 0.5).tolist() if config.random_flip else [False] * len(batch)
    drops = (torch.rand(len(batch), generator=gen) < config.caption_dropout).tolist()
    return gen, list(zip(batch, flips, drops))


def round_prompts(prompts: list[str], round_index: int, rounds: int) -> list[str]:
    """The prompts of one feedback round: consecutive, near-equal slices of the prompt list."""
    n = len(prompts)
    return prompts[round_index * n // rounds : (round_index + 1) * n // rounds]


def feedback_file(run_path: Path, round_index: int, rounds: int) -> Path:
    if rounds == 1:
        return run_path / "feedback" / "pairs.parquet"
    return run_path / "feedback" / f"round_{round_index + 1}" / "pairs.parquet"


def label_round(accelerator, pipe, judge, config: DPOConfig, prompts, round_index: int, run_path: Path, steps, guidance):
    """AI feedback for one round from the pipeline's current UNet (main process), then its pairs on all."""
    path = feedback_file(run_path, round_index, config.feedback_rounds)
    stopped = None
    with full_weights_for_main(accelerator, family_of_pipeline(pipe).denoiser(pipe)) as here:  # main generates alone
        if here:
            stopped = label_on_main(pipe, judge, config, prompts, round_index, path, steps, guidance)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        stopped = broadcast_object_list([stopped], from_process=0)[0]
    if stopped:
        raise TrainingStopped(stopped)
    accelerator.wait_for_everyone()
    table = open_pairs(str(path), max_pairs=config.max_pairs)  # ties dropped, as the authors' code does
    if accelerator.is_main_process:
        print(f"[data] {table.stats.summary()}", flush=True)
    return table


def label_on_main(pipe, judge, config: DPOConfig, prompts, round_index: int, path: Path, steps, guidance) -> str | None:
    """Generate and judge one round's images into ``path``; returns why it stopped (degenerate images), or None."""
    rounds = config.feedback_rounds
    denoiser = family_of_pipeline(pipe).denoiser(pipe)
    was_training = denoiser.training
    denoiser.eval()
    generate_images = healthy_images_only(make_pipeline_generator(pipe, num_inference_steps=steps, guidance_scale=guidance))
    labelled = round_prompts(prompts, round_index, rounds)
    if judge.pointwise:
        asks = f"{len(labelled) * config.images_per_prompt:,} images to score"
    else:
        asks = f"{len(labelled) * len(pairwise_scheme(config.images_per_prompt)):,} comparisons (adjacent pairs)"
    print(f"[feedback] {len(labelled):,} prompts x {config.images_per_prompt} images: {judge.name} is asked {asks} "
          "(prompts labelled by an earlier, interrupted run are skipped)", flush=True)
    try:
        stats = generate_feedback(
            generate_images, judge, labelled, path,
            images_per_prompt=config.images_per_prompt, seed=config.seed + round_index,  # best vs worst of K
        )
        label = f" round {round_index + 1}/{rounds}" if rounds > 1 else ""
        print(f"[feedback]{label} {stats.summary()}", flush=True)
    except TrainingStopped as err:  # degenerate images: every process stops (none waits for the main one for ever)
        return str(err)
    finally:
        denoiser.train(was_training)
    return None


def healthy_images_only(generate_images):
    """The feedback image source, stopping training at a degenerate batch (NaN images, which the PIL
    conversion turns black, or blank ones: align/health.py): a diverged model's images are not judged."""
    def generate(prompts, seeds):
        images = generate_images(prompts, seeds)
        problem = degenerate_reason(images if isinstance(images, torch.Tensor) else to_tensor(images))
        if problem:
            raise TrainingStopped(f"degenerate images while labelling feedback ({problem}); stopped before judging "
                                  "them; the checkpoints written so far are kept")
        return images

    return generate


def run_store_path(run_path: Path, round_index: int, rounds: int) -> Path:
    """Where --latent_store run keeps the latents of a run's pairs (one store per feedback round)."""
    return run_path / "latents" if rounds == 1 else run_path / "latents" / f"round_{round_index + 1}"


def check_latent_store(config: DPOConfig, table, resolution: int) -> None:
    """A --latent_store that exists must fit the model, the resolution and (with --dataset) the pairs:
    checked from the model's files, before the run folder is written or the model loads."""
    if read_manifest(config.store_folder) is None and table is not None:
        return  # built after the model loads
    complete = table is None or read_manifest(config.store_folder).get("complete", False)
    check_store(config.store_folder, model_fingerprint(config.model), resolution,
                table_fingerprints(table), need_complete=complete)


def table_fingerprints(table) -> tuple[str, ...] | None:
    """The fingerprints a store of these pairs may hold: their content's, or (stores built before it) the older one."""
    return None if table is None else (table.fingerprint, table.legacy_fingerprint)


def training_data(accelerator, pipe, table, resolution: int, config: DPOConfig, store: Path | None, start: int = 0,
                  end: int | None = None):
    """The torch Dataset of this round's pairs and its epoch order. With a store (--latent_store: a store
    folder, or the run folder's) items are latents read from disk, else decoded images. A store folder that is
    missing or interrupted is first built whole; the run's own store (--latent_store run) is a write-through cache:
    the pairs that steps [start, end) read and it lacks are encoded first (a short run encodes a few pairs, not
    the dataset), by the main process, resumably."""
    if store is None:
        return PairPixels(table, resolution), PairOrder(len(table), config.seed)
    model_fp = model_fingerprint(config.model)
    own_store = config.store_folder is None
    if table is not None:
        dtype = "float32" if own_store else "float16"
        spec = StoreSpec(model_fp, resolution, table.fingerprint, len(table), 1024, dtype)
        if accelerator.is_main_process:
            held = read_manifest(store)
            if held is not None:  # an earlier (or interrupted) build: go on with its own settings
                check_store(store, model_fp, resolution, table_fingerprints(table), need_complete=False)
                spec = StoreSpec(**{k: held[k] for k in spec.as_dict()})
            if own_store or held is None or not held.get("complete"):
                wanted = consumed_pairs(PairOrder(len(table), config.seed), config, start, end, accelerator.num_processes)
                reads = f"{len(table):,}" if wanted is None else f"{len(wanted):,} of the {len(table):,}"
                print(f"[latents] this run reads {reads} pairs: those not yet in {store} are encoded first (both flips; "
                      "how long it takes is printed once it has started); --latent_store none skips this (each step "
                      "then encodes its own images)", flush=True)
                # The run's store encodes one pair per call: which pairs a run encodes together depends on where
                # it started, and a batch's latents differ in the last bits with its company (a resumed run must
                # equal an uninterrupted one bit for bit).
                build_store(pipe, table, store, spec, log=lambda line: print(line, flush=True),
                            pairs=wanted if own_store else None, batch_size=1 if own_store else 8)
        accelerator.wait_for_everyone()
    manifest = check_store(store, model_fp, resolution, table_fingerprints(table), need_complete=not own_store)
    return StoreLatents(store, manifest), PairOrder(manifest["num_pairs"], config.seed)


# A run that reads at most this many pairs has their images decoded before anything is written (a few seconds);
# a longer one meets an unreadable image when it encodes it, stops in one line and removes what it wrote.
UPFRONT_IMAGE_CHECK = 2000


def check_pairs_readable(config: DPOConfig, table, processes: int) -> None:
    """The images of the pairs this run reads decode (one line naming the row otherwise), when they are few."""
    wanted = consumed_pairs(PairOrder(len(table), config.seed), config, 0, config.max_steps, processes)
    pairs = range(len(table)) if wanted is None else wanted.tolist()
    if len(pairs) <= UPFRONT_IMAGE_CHECK:
        for k in pairs:
            table.pixels(k, 8, False)


def consumed_pairs(order: PairOrder, config: DPOConfig, start: int, end: int | None, processes: int):
    """The pair indices steps [start, end) read (micro_batch_keys' counters), or None when that is every pair."""
    per_step = config.train_batch_size * config.gradient_accumulation_steps * processes
    end = config.max_steps if end is None else end
    first, last = start * per_step, end * per_step
    if last - first >= order.num_pairs:
        return None
    return torch.tensor([order.index(counter) for counter in range(first, last)], dtype=torch.int64).unique()


def micro_batches(data, order: PairOrder, config: DPOConfig, accelerator, start: int, end: int):
    """An iterator over the micro-batches of steps [start, end), read by DataLoader workers."""
    def plan(step, micro):
        return micro_batch_keys(order, config, step, micro, accelerator.process_index, accelerator.num_processes)[1]

    sampler = PlannedBatches(plan, start, end, config.gradient_accumulation_steps)
    return iter(micro_batch_loader(data, sampler, config.dataloader_num_workers))


@torch.no_grad()
def batch_latents_and_conditioning(family, pipe, batch: dict, resolution: int):
    """(winner latents, loser latents, conditioning dict) of a micro-batch, on the CPU."""
    if "error" in batch:
        raise DataError(batch["error"])
    if "latents_w" in batch:  # from a latent store: conditioning under "cond.<key>"
        cond = {key[len(COND_PREFIX):]: value for key, value in batch.items() if key.startswith(COND_PREFIX)}
        return batch["latents_w"], batch["latents_l"], cond
    latents = family.encode_images(pipe, torch.cat([batch["pixels_w"], batch["pixels_l"]])).float().cpu()
    latents_w, latents_l = latents.chunk(2)
    cond = family.encode_prompts(pipe, list(batch["caption"]), resolution)
    return latents_w, latents_l, {key: value.float().cpu() for key, value in cond.items()}


# ----------------------------------------------------------------------------------------------
# Training


@restores_old_run_on_failure
def train(config: DPOConfig) -> Path:
    """Run Diffusion-DPO; returns the run folder."""
    from accelerate.utils import set_seed
    from diffusers.optimization import get_scheduler

    check_inputs(config)
    run = RunFolder(config.output_dir, resume=config.resume, overwrite=config.overwrite)
    check_resume_settings(run, config)  # a resumed run keeps its settings (or is refused in one line)
    log_with = None if config.report_to == "none" else config.report_to
    accelerator, config.mixed_precision = make_accelerator(  # the flag, else accelerate's setting; recorded resolved
        config.mixed_precision, "dpo", shardable=True, gradient_accumulation_steps=config.gradient_accumulation_steps,
        log_with=log_with, project_dir=str(run.path),
    )
    apply_matmul_switches(config.allow_tf32)
    main = accelerator.is_main_process

    # The judges before anything is written or generated: a missing API key stops us here.
    judge = load_judge(config.reward) if config.reward else None
    eval_judge_spec = config.eval_judge or config.reward
    eval_judge = None
    if config.eval_prompts and eval_judge_spec:
        eval_judge = judge if eval_judge_spec == config.reward else load_judge(eval_judge_spec)
        require_pointwise_eval_judge(eval_judge_spec, eval_judge.pointwise)

    if judge is not None:  # a rule judge that cannot parse a prompt stops here, not while labelling
        check_judges_take_prompts([judge], load_prompt_list(config.prompts), "--prompts")
    if eval_judge is not None:
        check_judges_take_prompts([eval_judge], load_prompt_list(config.eval_prompts), "--eval_prompts")

    # The paid judge calls, counted and priced before any is made (refused above --max_api_cost).
    feedback_prompts = len(load_prompt_list(config.prompts)) if judge is not None else 0
    eval_prompts = len(load_prompt_list(config.eval_prompts)) if eval_judge is not None else 0
    guard_api_cost(dpo_api_plan(config, judge, eval_judge, feedback_prompts, eval_prompts), config.max_api_cost, verbose=main)

    # Offline pairs are indexed (label columns only; images stay memory-mapped on disk) and a given
    # latent store is checked against the model's files before the model loads: bad data stops here.
    table = None
    if config.dataset:
        table = open_pairs(config.dataset, split=config.dataset_split, max_pairs=config.max_pairs)
        check_pairs_readable(config, table, accelerator.num_processes)
    if config.store_folder:

        check_latent_store(config, table, config.resolution or native_resolution(config.model))

    start_run(accelerator, run, config)
    keep_judge_answers(filter(None, (judge, eval_judge)), run.path, accelerator.process_index)
    set_seed(config.seed)

    pipe = load_pipeline(config.model, device=pipeline_device(accelerator))  # FSDP2: the CPU, then shards
    family = family_of_pipeline(pipe)  # what differs between SD, SDXL, SD3 and FLUX (align/families)
    place_frozen_parts(accelerator, family, pipe)
    defaults = testbed_settings(config.model)
    steps = config.num_inference_steps or defaults.get("num_inference_steps", 50)
    guidance = config.guidance_scale if config.guidance_scale is not None else defaults.get("guidance_scale", 7.5)
    resolution = config.resolution or family.native_resolution(pipe)
    for module in family.frozen_modules(pipe):
        module.requires_grad_(False)

    # 1. The prompts of AI feedback (labelled in step 5), or the offline pairs read above.
    rounds = config.feedback_rounds if judge is not None else 1
    steps_per_round = config.max_steps // rounds
    if judge is not None:
        prompts = load_prompt_list(config.prompts)
    elif main and table is not None:
        print(f"[data] {table.stats.summary()}", flush=True)

    # 2. The trained denoiser (UNet or transformer; named ``unet`` below) and its reference.
    unet = family.denoiser(pipe)
    if family.denoiser_name == "unet":  # transformers keep their own (joint) attention processors
        keep_default_attention(unet)
    if config.finetune == "lora":
        add_lora(unet, rank=config.lora_rank, alpha=config.lora_alpha, target_modules=family.lora_targets)
        reference = None  # same denoiser, adapter off
    else:
        unet.requires_grad_(True)
    use_family_blocks(accelerator, family, unet)  # FSDP2's units; nothing without sharding
    if config.finetune == "full":
        reference = shard_frozen(accelerator, frozen_copy(unet))  # sharded like the policy under FSDP2
    if config.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    params = [p for p in unet.parameters() if p.requires_grad]

    # 3. Optimiser (the derived batch sizes are printed in step 5).
    pairs_per_step = config.train_batch_size * accelerator.num_processes * config.gradient_accumulation_steps
    lr = config.learning_rate * pairs_per_step if config.scale_lr else config.learning_rate
    optimizer = adamw_class(config.use_8bit_adam)(params, lr=lr, weight_decay=config.adam_weight_decay)  # β 0.9 / 0.999, ε 1e-8
    lr_scheduler = get_scheduler(
        config.lr_scheduler, optimizer=optimizer,
        num_warmup_steps=config.lr_warmup_steps * accelerator.num_processes,
        num_training_steps=config.max_steps * accelerator.num_processes,
    )
    unet, optimizer, lr_scheduler = accelerator.prepare(unet, optimizer, lr_scheduler)
    params = [p for p in unet.parameters() if p.requires_grad]  # FSDP2 replaced them with their shards
    register_trainable_checkpoint_hooks(accelerator, config.finetune == "lora")
    noise_scheduler = pipe.scheduler

    # 4. Resume.
    start_step = resume_from_checkpoint(accelerator, run, "dpo")
    if start_step is None:
        start_step = 0
        if config.resume and main:
            run.truncate_metrics(0)
            print("[dpo] --resume latest: no checkpoint yet, starting from step 0", flush=True)

    # 5. The pairs of the current round: AI feedback from the model as it stands (the base model, or the
    #    resumed one; later online rounds are labelled in the loop), then the DataLoader over them: latents
    #    and text embeddings from a latent store (built first if needed), or images decoded by its workers.
    training_left = start_step < config.max_steps  # else only the final save, evaluation and report remain
    if judge is not None and training_left:
        table = label_round(accelerator, pipe, judge, config, prompts, start_step // steps_per_round, run.path, steps, guidance)

    def store_of_round(round_index):
        if config.store_folder:
            return Path(config.store_folder)
        return run_store_path(run.path, round_index, rounds) if config.latent_store == RUN_STORE else None

    def round_batches(table, step):
        """The data of the round holding ``step``, read from ``step`` to the round's end."""
        end = (step // steps_per_round + 1) * steps_per_round
        data, order = training_data(accelerator, pipe, table, resolution, config, store_of_round(step // steps_per_round),
                                    step, end)
        return micro_batches(data, order, config, accelerator, step, end), order

    if training_left:
        batches, order = round_batches(table, start_step)
    if main and training_left:  # derived batch sizes, printed so they can be checked against the paper's 2048
        print(
            f"[dpo] pairs: {order.num_pairs} | per process per micro-step: {config.train_batch_size} | processes: "
            f"{accelerator.num_processes} | accumulation: {config.gradient_accumulation_steps} | pairs per step: "
            f"{pairs_per_step} | steps: {config.max_steps} | learning rate: {lr:.3g}"
            f"{' (scaled by pairs per step)' if config.scale_lr else ''} | beta: {config.beta} | finetune: "
            f"{config.finetune} ({sum(p.numel() for p in params):,} trainable parameters)",
            flush=True,
        )

    if log_with:
        accelerator.init_trackers("dpo", config=tracker_config(config))

    # 6. Before: score held-out prompts with the starting model (fixed seeds, reused after).
    with full_weights_for_main(accelerator, unet, needed=eval_judge is not None and start_step == 0) as here:
        if here:
            evaluate_model(pipe, eval_judge, config, steps, guidance, run.path / "eval_before.json", "before")

    # 7. The loop.
    progress = progress_bar(range(start_step, config.max_steps), desc="dpo", unit="step", enabled=accelerator.is_local_main_process)
    last_good = run.latest_checkpoint()
    for step in progress:
        if step > start_step and step % steps_per_round == 0:  # online DPO: the next round's pairs
            table = label_round(accelerator, pipe, judge, config, prompts, step // steps_per_round, run.path, steps, guidance)
            batches, order = round_batches(table, step)
        step_start = time.perf_counter()
        logs: dict[str, float] = {}
        for micro in range(config.gradient_accumulation_steps):
            # The pairs, flips and dropped captions were drawn from ``gen`` by the DataLoader's sampler
            # (micro_batch_keys); redrawing them here leaves ``gen`` where the noise draws start.
            gen, batch = micro_batch_keys(order, config, step, micro, accelerator.process_index, accelerator.num_processes)
            latents_w, latents_l, cond = batch_latents_and_conditioning(family, pipe, next(batches), resolution)

            # One timestep (flow families: σ·1000) and one noise draw per pair, shared by winner and loser;
            # the family noises x0 and says what the denoiser regresses (ε, v or the flow velocity ε − x0).
            noise = torch.randn(latents_w.shape, generator=gen)
            timesteps = family.draw_training_timesteps(noise_scheduler, len(batch), gen)
            x0 = torch.cat([latents_w, latents_l]).to(accelerator.device)
            noise2 = torch.cat([noise, noise]).to(accelerator.device)
            t2 = torch.cat([timesteps, timesteps]).to(accelerator.device)
            # FLUX.1-dev's guidance input: the family's training value (3.5, diffusers' FLUX LoRA script).
            cond2 = conditioning_to(cat_conditioning([cond, cond]), device=accelerator.device)
            noisy, target = family.noisy_and_target(noise_scheduler, x0, noise2, t2)

            with accelerator.accumulate(unet):
                model_err = per_sample_mse(family.predict(unet, noisy, t2, cond2), target)
                model_err_w, model_err_l = model_err.chunk(2)
                # The reference runs exactly as the policy: the prepared denoiser's forward is under autocast.
                with torch.no_grad(), accelerator.autocast():
                    if reference is None:
                        with disabled_adapter(accelerator.unwrap_model(unet)) as ref_unet:
                            ref_pred = family.predict(ref_unet, noisy, t2, cond2)
                    else:
                        ref_pred = family.predict(reference, noisy, t2, cond2)
                ref_err_w, ref_err_l = per_sample_mse(ref_pred, target).chunk(2)
                loss, metrics = diffusion_dpo_loss(model_err_w, model_err_l, ref_err_w, ref_err_l, config.beta)
                finite = accelerator.gather(torch.isfinite(loss.detach()).float().reshape(1)).min()
                if finite < 1:
                    raise TrainingStopped(
                        f"non-finite loss at step {step}; stopped before the update. The last good checkpoint "
                        f"is {last_good or 'none (no checkpoint was written yet)'}; lower --learning_rate or --beta"
                    )
                accelerator.backward(loss)
                if accelerator.sync_gradients and config.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, config.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            for key, value in {"loss": loss.detach(), **metrics}.items():
                logs[key] = logs.get(key, 0.0) + float(value) / config.gradient_accumulation_steps
        stop_unless_weights_finite(params, f"step {step}", last_good, accelerator)

        logs = {k: float(accelerator.reduce(torch.tensor(v, device=accelerator.device), "mean")) for k, v in logs.items()}
        logs["lr"] = lr_scheduler.get_last_lr()[0]
        logs["pairs_per_second"] = pairs_per_step / (time.perf_counter() - step_start)
        done = step + 1
        with full_weights_for_main(accelerator, unet, needed=periodic_evaluation_due(config.eval_every_steps, done,
                                                                                     config.max_steps)) as here:
            if here:
                logs["heldout_score"] = periodic_evaluation(pipe, eval_judge, config, steps, guidance, run.path, done)
        if main:
            run.log(done, logs)
            progress.set_postfix(loss=f"{logs['loss']:.4f}", acc=f"{logs.get('implicit_acc', float('nan')):.2f}")
        accelerator.log(logs, step=done)

        # Every round ends with a checkpoint: a resumed run labels the next round from exactly this model.
        if done % config.checkpointing_steps == 0 or done == config.max_steps or (rounds > 1 and done % steps_per_round == 0):
            last_good = save_checkpoint(accelerator, run, done, config.checkpoints_total_limit)

    # 8. After-evaluation, final weights with their model card (one folder, written as a whole), report.
    #    Each step is redone by --resume latest from the last checkpoint if the run stops before its end.
    accelerator.wait_for_everyone()
    with full_weights_for_main(accelerator, unet, needed=eval_judge is not None) as here:
        if here:
            evaluate_model(pipe, eval_judge, config, steps, guidance, run.path / "eval_after.json", "after")
    trained = consolidated_model(accelerator, unet)  # every process: FSDP2 gathers the shards onto the main one
    if main:
        save_final_weights(trained, run.path, config.finetune, lambda final: write_model_card(final, config, run),
                           family=family)
        write_run_report(run, config)
        run.let_go_of_old_run()
    for used in {id(j): j for j in (judge, eval_judge) if j is not None}.values():
        used.close()  # API judges print their token and cost counts here
    del unet, trained, optimizer, lr_scheduler
    end_training(accelerator)
    return run.path


# ----------------------------------------------------------------------------------------------
# Model card, report


def write_model_card(folder: Path, config: DPOConfig, run: RunFolder) -> None:
    metrics = run.read_metrics()
    last = metrics[-1] if metrics else {}
    feedback = f"AI feedback from the judge `{config.reward}`" if config.reward else f"pairs from `{config.dataset}`"
    if config.reward and config.feedback_rounds > 1:
        feedback += f" in {config.feedback_rounds} online rounds (each labelling the model trained so far)"
    write_diffusion_model_card(folder, config.model, config.finetune, "Diffusion-DPO", "diffusion-dpo",
                               f"Trained with Diffusion-DPO (Wallace et al. 2024) on {feedback}.", {
        "objective": f"Diffusion-DPO (beta = {config.beta})",
        "fine-tuning": config.finetune,
        "steps": config.max_steps,
        "pairs per step": f"{config.train_batch_size} x processes x {config.gradient_accumulation_steps}",
        "learning rate": f"{config.learning_rate} {'x pairs per step' if config.scale_lr else ''}",
        "final loss": f"{last.get('loss', float('nan')):.4f}",
        "final implicit accuracy": f"{last.get('implicit_acc', float('nan')):.3f}",
    })


def write_run_report(run: RunFolder, config: DPOConfig) -> None:

    write_training_report(run.path, title=f"Diffusion-DPO: {config.model}", judge=config.eval_judge or config.reward,
                          metric_keys=("loss", "implicit_acc", "reward_margin", ("model_mse", "ref_mse")))


def main(argv: list[str] | None = None) -> None:
    run_trainer(DPOConfig, train, argv, __doc__)


if __name__ == "__main__":
    main()
