"""Diffusion-DPO (Wallace et al., CVPR 2024) for SD 1.x/2.x, SDXL, SD3/SD3.5 and FLUX, with preference pairs
from a dataset or made on the fly by a judge.

    accelerate launch align/dpo.py --reward gpt4o --prompts prompts.txt
    accelerate launch align/dpo.py --dataset yuvalkirstain/pickapic_v2
    python align/dpo.py --config configs/testbed_dpo.yaml          # offline, on a CPU

The algorithm box, per optimisation step (the model family, align/families, supplies t, x_t and the target):
    1. take pairs (caption c, preferred x_w, rejected x_l) and encode them to latents and conditioning
       (align/train/dpo_data.py; AI feedback labels each round's pairs first: align/train/dpo_feedback.py);
    2. draw one timestep t and one noise ε per pair, shared by x_w and x_l;
    3. err(x) = ‖f_θ(x_t, t, c) − target‖² averaged over C, H, W, for the model and the frozen reference
       (target: ε, v, or the flow velocity ε − x for SD3/FLUX);
    4. loss = −log σ(−β/2 · [(err_θ(w) − err_ref(w)) − (err_θ(l) − err_ref(l))]).
Steps 2-4 are ``diffusion_dpo_step``; the run around them (folder, resume, checkpoints, evaluation, report) is
align/train/lifecycle.py's.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from align.api_cost import dpo_api_plan, guard_api_cost
from align.cli import ConfigError
from align.data.latent_store import native_resolution
from align.data.pair_stream import open_pairs
from align.data.prompt_overlap import check_heldout_disjoint
from align.data.prompt_sets import load_prompt_list
from align.families.base import cat_conditioning, conditioning_to
from align.judges import check_judge_names, check_judges_take_prompts, load_judge
from align.pipeline import disabled_adapter, testbed_settings
from align.run_folder import RunFolder, restores_old_run_on_failure
from align.train.accelerator import adamw_class, apply_matmul_switches
from align.train.checkpoints import stop_unless_weights_finite, write_diffusion_model_card
from align.train.command import TrainingStopped, check_config_and_model, run_trainer, way_on
from align.train.dpo_config import DPOConfig
from align.train.dpo_data import RoundPairs, check_latent_store, check_pairs_readable
from align.train.heldout import HeldOutCheck, require_pointwise_eval_judge
from align.train.lifecycle import TrainingRun
from align.train.losses import diffusion_dpo_loss, per_sample_mse
from align.train.report import Curve
from align.train.sharding import consolidated_model
from align.train.trained_model import detect_family, load_for_training, trainable_denoiser

CURVES = (Curve("DPO loss", ("loss",)), Curve("implicit accuracy", ("implicit_acc",)),
          Curve("implicit reward margin", ("reward_margin",)),
          Curve("denoising error on the pairs", ("model_mse", "ref_mse")))


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


def load_judges(config: DPOConfig, main: bool):
    """(the feedback judge, the held-out judge), either None, loaded and checked against their prompts, and their
    paid calls priced (refused above --max_api_cost): a missing API key or a prompt a rule judge cannot parse stops
    the run here, before anything is written."""
    judge = load_judge(config.reward) if config.reward else None
    eval_judge_spec = config.eval_judge or config.reward
    eval_judge = None
    if config.eval_prompts and eval_judge_spec:
        eval_judge = judge if eval_judge_spec == config.reward else load_judge(eval_judge_spec)
        require_pointwise_eval_judge(eval_judge_spec, eval_judge.pointwise)
    if judge is not None:
        check_judges_take_prompts([judge], load_prompt_list(config.prompts), "--prompts")
    if eval_judge is not None:
        check_judges_take_prompts([eval_judge], load_prompt_list(config.eval_prompts), "--eval_prompts")
    feedback_prompts = len(load_prompt_list(config.prompts)) if judge is not None else 0
    eval_prompts = len(load_prompt_list(config.eval_prompts)) if eval_judge is not None else 0
    guard_api_cost(dpo_api_plan(config, judge, eval_judge, feedback_prompts, eval_prompts), config.max_api_cost, verbose=main)
    return judge, eval_judge


def open_offline_pairs(config: DPOConfig, processes: int):
    """Offline pairs indexed (label columns only; images stay memory-mapped on disk), the images this run reads
    decoded when they are few, and a given latent store checked against the model's files: bad data stops here."""
    table = None
    if config.dataset:
        table = open_pairs(config.dataset, split=config.dataset_split, max_pairs=config.max_pairs)
        check_pairs_readable(config, table, processes)
    if config.store_folder:
        check_latent_store(config, table, config.resolution or native_resolution(config.model))
    return table


def diffusion_dpo_step(family, scheduler, policy, reference_prediction, pairs, generator, beta: float, device):
    """Steps 2-4 of the algorithm box on one micro-batch: ``pairs`` = (winner latents, loser latents, conditioning),
    on the CPU; ``reference_prediction(noisy, timesteps, cond)`` is the reference's output (no gradient). Returns
    the Diffusion-DPO loss and its metrics."""
    latents_w, latents_l, cond = pairs
    # One timestep (flow families: σ·1000) and one noise draw per pair, shared by winner and loser; the family noises
    # x0 and says what the denoiser regresses (ε, v or the flow velocity ε − x0).
    noise = torch.randn(latents_w.shape, generator=generator)
    timesteps = family.draw_training_timesteps(scheduler, len(latents_w), generator)
    x0 = torch.cat([latents_w, latents_l]).to(device)
    noise2 = torch.cat([noise, noise]).to(device)
    t2 = torch.cat([timesteps, timesteps]).to(device)
    # FLUX.1-dev's guidance input: the family's training value (3.5, diffusers' FLUX LoRA script).
    cond2 = conditioning_to(cat_conditioning([cond, cond]), device=device)
    noisy, target = family.noisy_and_target(scheduler, x0, noise2, t2)
    model_err_w, model_err_l = per_sample_mse(family.predict(policy, noisy, t2, cond2), target).chunk(2)
    ref_err_w, ref_err_l = per_sample_mse(reference_prediction(noisy, t2, cond2), target).chunk(2)
    return diffusion_dpo_loss(model_err_w, model_err_l, ref_err_w, ref_err_l, beta)


def reference_of(accelerator, family, policy, reference):
    """The reference's prediction, run exactly as the policy (the prepared denoiser's forward is under autocast):
    the same denoiser with its LoRA adapter off, or the frozen copy."""
    def predict(noisy, timesteps, cond):
        with torch.no_grad(), accelerator.autocast():
            if reference is not None:
                return family.predict(reference, noisy, timesteps, cond)
            with disabled_adapter(accelerator.unwrap_model(policy)) as adapter_off:
                return family.predict(adapter_off, noisy, timesteps, cond)

    return predict


def optimiser(run: TrainingRun, params):
    """AdamW (β 0.9 / 0.999, ε 1e-8) at --learning_rate, times the pairs per step with --scale_lr (the official
    code), and diffusers' learning-rate schedule; returns them and the pairs per optimiser step."""
    from diffusers.optimization import get_scheduler

    config, processes = run.config, run.accelerator.num_processes
    pairs_per_step = config.train_batch_size * processes * config.gradient_accumulation_steps
    lr = config.learning_rate * pairs_per_step if config.scale_lr else config.learning_rate
    optimizer = adamw_class(config.use_8bit_adam)(params, lr=lr, weight_decay=config.adam_weight_decay)
    schedule = get_scheduler(config.lr_scheduler, optimizer=optimizer,
                             num_warmup_steps=config.lr_warmup_steps * processes,
                             num_training_steps=config.max_steps * processes)
    return optimizer, schedule, pairs_per_step


@restores_old_run_on_failure
def train(config: DPOConfig) -> Path:
    """Run Diffusion-DPO; returns the run folder."""
    check_inputs(config)
    family = detect_family(config.model)  # what differs between SD, SDXL, SD3 and FLUX (align/families)
    run = TrainingRun(config, "dpo", shardable=True, accumulate=True)
    accelerator, main = run.accelerator, run.main
    apply_matmul_switches(config.allow_tf32)
    judge, eval_judge = load_judges(config, main)
    table = open_offline_pairs(config, accelerator.num_processes)
    run.start((judge, eval_judge))

    pipe = load_for_training(run, family, torch.float32)  # the frozen parts stay in float32
    defaults = testbed_settings(config.model)
    sampling = (config.num_inference_steps or defaults.get("num_inference_steps", 50),
                config.guidance_scale if config.guidance_scale is not None else defaults.get("guidance_scale", 7.5))
    resolution = config.resolution or family.native_resolution(pipe)
    unet, reference, params = trainable_denoiser(run, family, pipe, keep_reference=True)  # named unet: any denoiser
    unet.train()
    optimizer, lr_scheduler, pairs_per_step = optimiser(run, params)
    unet, optimizer, lr_scheduler = run.prepare(unet, optimizer, lr_scheduler, only_trainable=config.finetune == "lora")
    params = [p for p in unet.parameters() if p.requires_grad]  # FSDP2 replaced them with their shards
    predict_reference = reference_of(accelerator, family, unet, reference)
    start_step, _ = run.resume()

    pairs = RoundPairs(run, pipe, judge, table, resolution, sampling)
    if main and judge is None and table is not None:
        print(f"[data] {table.stats.summary()}", flush=True)
    if start_step < config.max_steps:  # else only the final save, evaluation and report remain
        pairs.start_round(start_step)
        run.say(f"pairs: {pairs.order.num_pairs} | per process per micro-step: {config.train_batch_size} | processes: "
                f"{accelerator.num_processes} | accumulation: {config.gradient_accumulation_steps} | pairs per step: "
                f"{pairs_per_step} | steps: {config.max_steps} | learning rate: {optimizer.param_groups[0]['initial_lr']:.3g}"
                f"{' (scaled by pairs per step)' if config.scale_lr else ''} | beta: {config.beta} | finetune: "
                f"{config.finetune} ({sum(p.numel() for p in params):,} trainable parameters)")
    run.init_trackers("dpo")
    held_out = HeldOutCheck(run, pipe, eval_judge, *sampling, config.eval_every_steps, config.max_steps)
    held_out.before(start_step)  # fixed seeds, reused after

    last_good = run.latest_checkpoint()
    progress = run.progress(start_step, config.max_steps)
    for step in progress:
        if pairs.round_starts(step, start_step):  # online DPO: the next round's pairs
            pairs.start_round(step)
        step_start = time.perf_counter()
        logs: dict[str, float] = {}
        for micro in range(config.gradient_accumulation_steps):
            gen, *micro_pairs = pairs.micro_batch(family, step, micro)
            with accelerator.accumulate(unet):
                loss, metrics = diffusion_dpo_step(family, pipe.scheduler, unet, predict_reference, micro_pairs, gen,
                                                   config.beta, accelerator.device)
                stop_unless_loss_finite(accelerator, loss, step, last_good)
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
        score = held_out.during(done)
        if score is not None:
            logs["heldout_score"] = score
        run.log(done, logs)
        if main:
            progress.set_postfix(loss=f"{logs['loss']:.4f}", acc=f"{logs.get('implicit_acc', float('nan')):.2f}")
        # Every round ends with a checkpoint: a resumed run labels the next round from exactly this model.
        if done % config.checkpointing_steps == 0 or done == config.max_steps or pairs.ends_round(done):
            last_good = run.checkpoint(done)

    # After-evaluation, final weights with their model card (one folder, written as a whole), report. Each is redone
    # by --resume latest from the last checkpoint if the run stops before its end.
    accelerator.wait_for_everyone()
    held_out.after()
    trained = consolidated_model(accelerator, unet)  # every process: FSDP2 gathers the shards onto the main one
    run.save_final(trained, family, lambda final: write_model_card(final, config, run.folder))
    run.report(f"Diffusion-DPO: {config.model}", CURVES, judge=config.eval_judge or config.reward)
    del unet, trained, optimizer, lr_scheduler, predict_reference
    run.end((judge, eval_judge))
    return run.path


def stop_unless_loss_finite(accelerator, loss: torch.Tensor, step: int, last_good) -> None:
    """A NaN/inf loss on any process stops every process before the update."""
    finite = accelerator.gather(torch.isfinite(loss.detach()).float().reshape(1)).min()
    if finite < 1:
        raise TrainingStopped(f"non-finite loss at step {step} (a --learning_rate or --beta too high for the model?); "
                              f"stopped before the update. {way_on(last_good)}")


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


def main(argv: list[str] | None = None) -> None:
    run_trainer(DPOConfig, train, argv, __doc__, check=check_inputs)


if __name__ == "__main__":
    main()
