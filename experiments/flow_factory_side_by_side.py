"""Flow-Factory's own GRPO and DiffusionNFT trainers (X-GenGroup/Flow-Factory @ a0b2bc5, 2026) on the flow testbed with
the shapes oracle as their reward and the settings of configs/testbed_flow_{grpo,nft}.yaml, timed per epoch in CPU
seconds (sampling; reward and advantages; training), and their final LoRA scored on our held-out images, to compare
with ``python align/ddpo.py --config configs/testbed_flow_{grpo,nft}.yaml`` (docs/performance.md).

    OMP_NUM_THREADS=1 python -m experiments.flow_factory_side_by_side --flow-factory DIR --trainer grpo \\
        --epochs 162 --out runs/ff/grpo

DIR is a copy of their repository (``git --git-dir=<mirror> archive a0b2bc5 src | tar -x -C DIR``); their code runs
from it, imported from DIR/src; nothing of it is copied here. Their data loader imports imageio (not one of our
dependencies: install it beside, e.g. ``pip install --target D imageio`` and D on PYTHONPATH).

What runs as they wrote it: their ``Arguments`` (the YAML below), ``load_trainer`` (their Accelerator, their
``SD3_5Adapter``'s pipeline wrapper, LoRA through ``get_peft_model`` on their default targets, their SDE/ODE scheduler,
their dataset preprocessing that encodes every training prompt once), and their trainer's ``start()`` loop: sampling,
rewards, advantages, the GRPO (PPO-clip per timestep) or NFT update, EMA.

Adaptations, each the least that lets their code run on our testbed on a CPU:
1. The model adapter is their ``SD3_5Adapter`` subclassed (``TestbedSD3Adapter`` below): the testbed has no T5, so
   ``load_pipeline`` passes ``text_encoder_3=None`` (diffusers refuses a null entry otherwise), the prompt-id
   tokenizer is CLIP's (theirs is T5's), and ``encode_prompt`` passes the testbed's T5 length (2 zero tokens, as the
   testbed was trained and as our trainer encodes) where theirs leaves the pipeline's default of 256 zero tokens, which
   the testbed never saw (and which would make its joint attention 4x longer).
2. The reward is the shapes oracle (``rewards.load("shapes-oracle")``) in their ``PointwiseRewardModel`` interface.
3. Their data: the 256 training captions of ``testbed-train:256`` as train.txt; their evaluation is off (eval_freq 0)
   and their checkpoints too; we score their final LoRA (merged into the transformer) on our held-out images: the
   config's unseen captions ``testbed-heldout:200:1000`` x 2 seeds from 1234, the pipeline's sampler at 20 steps, as
   our runs' eval_before/eval_after, and save the merged pipeline (OUT/pipeline) for
   ``python -m experiments.paired_heldout --base testbed-flow OUT/pipeline ...`` on 4,000 unseen images.
4. Timing: ``time.process_time()`` (this process, all threads) around their trainer's ``sample()``,
   ``prepare_feedback()`` and ``optimize()``, one JSON line per epoch.

Settings where theirs and ours cannot be equal: their Flow-SDE keeps the last step deterministic (ours, as the
authors' flow_grpo, is stochastic there; neither trains it); their GRPO has no zero-advantage filter (ours drops them,
testbed_flow_grpo.yaml's drop_zero_advantage: true; run ours with --drop_zero_advantage false for the same samples).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import yaml
from diffusers import StableDiffusion3Pipeline

import rewards
from align.data.prompt_sets import load_prompt_list
from align.pipeline import generate_images, load_pipeline, resolve_model, testbed_settings

COMMIT = "a0b2bc5a2b4fbf9125429b3fb70c0c5d7631047c"
TRAIN, HELD_OUT, HELD_OUT_REPEATS, EVAL_SEED, EVAL_STEPS = "testbed-train:256", "testbed-heldout:200:1000", 2, 1234, 20


def common_settings(data_dir: Path, save_dir: Path) -> dict:
    """Their YAML sections shared by both trainers: configs/testbed_flow_*.yaml's model, sampling and batch."""
    return {
        "launcher": "accelerate", "num_processes": 1, "mixed_precision": "no",
        "data": {"dataset_dir": str(data_dir), "cache_dir": str(save_dir / "cache"), "preprocessing_batch_size": 16,
                 "dataloader_num_workers": 0, "force_reprocess": True, "sampler_type": "auto"},
        "model": {"finetune_type": "lora", "lora_rank": 32, "lora_alpha": 64, "target_modules": "default",
                  "model_name_or_path": resolve_model("testbed-flow"), "master_weight_dtype": "fp32",
                  "model_type": f"{__name__}.TestbedSD3Adapter"},
        "log": {"logging_backend": "none", "save_dir": str(save_dir), "save_freq": 0, "verbose": False},
        "eval": {"resolution": 32, "eval_freq": 0},
        "rewards": [{"name": "oracle", "reward_model": f"{__name__}.OracleReward", "batch_size": 16, "device": "cpu",
                     "dtype": "float32"}],
    }


def train_section(trainer: str, epochs: int) -> tuple[dict, dict]:
    """(their ``train`` section, their ``scheduler`` section) equal to configs/testbed_flow_{grpo,nft}.yaml."""
    shared = {"trainer_type": trainer, "max_epochs": epochs, "resolution": 32, "num_inference_steps": 10,
              "guidance_scale": 3.0, "per_device_batch_size": 16, "group_size": 8, "unique_sample_num_per_epoch": 8,
              "global_std": True, "advantage_aggregation": "sum", "adv_clip_range": 5.0, "learning_rate": 3.0e-4,
              "adam_weight_decay": 1.0e-4, "max_grad_norm": 1.0, "enable_gradient_checkpointing": False, "seed": 42,
              "latent_storage_dtype": "fp32", "ref_param_device": "cpu", "ema_device": "cpu"}
    if trainer == "grpo":  # 10 SDE steps at noise level 0.7, the first 9 trained, clip 1e-4, no KL, 2 steps an epoch
        return ({**shared, "gradient_step_per_epoch": 2, "clip_range": 1.0e-4, "kl_beta": 0.0, "ema_decay": 0.0},
                {"dynamics_type": "Flow-SDE", "noise_level": 0.7, "num_sde_steps": None, "sde_steps": None})
    # DiffusionNFT: ODE rollouts from the old policy (EMA, decay min(0.001 x step, 0.5)), 9 of the 10 grid steps,
    # beta 1, KL 1e-4 to the base (velocity), 2 steps an epoch
    return ({**shared, "gradient_step_per_epoch": 2, "nft_beta": 1.0, "off_policy": True, "ema_decay": 0.5,
             "ema_decay_schedule": "piecewise_linear", "flat_steps": 0, "ramp_rate": 0.001, "ema_update_interval": 1,
             "num_train_timesteps": 9, "time_sampling_strategy": "discrete", "timestep_range": 0.9, "kl_type": "v-based",
             "kl_beta": 1.0e-4},
            {"dynamics_type": "ODE"})


def their_classes(flow_factory: Path):
    """Their package, imported from the copy (``DIR/src``, put first on the path: an experiment, not the package)."""
    sys.path.insert(0, str(flow_factory / "src"))
    from flow_factory.hparams import Arguments
    from flow_factory.models.stable_diffusion.sd3_5 import SD3_5Adapter
    from flow_factory.rewards.abc import PointwiseRewardModel, RewardModelOutput
    from flow_factory.trainers import load_trainer

    return Arguments, SD3_5Adapter, PointwiseRewardModel, RewardModelOutput, load_trainer


def define_adaptations(SD3_5Adapter, PointwiseRewardModel, RewardModelOutput) -> None:
    """The two classes their config names by python path (adaptations 1 and 2 of the docstring)."""
    max_length = testbed_settings("testbed-flow")["max_sequence_length"]

    class TestbedSD3Adapter(SD3_5Adapter):
        def load_pipeline(self):
            return StableDiffusion3Pipeline.from_pretrained(self.model_args.model_name_or_path, low_cpu_mem_usage=False,
                                                            text_encoder_3=None, tokenizer_3=None)

        @property
        def tokenizer(self):
            return self.pipeline.tokenizer

        def encode_prompt(self, prompt, negative_prompt=None, guidance_scale=3.5, max_sequence_length=None, device=None):
            original = self.pipeline.encode_prompt

            def with_testbed_length(*args, **kwargs):
                return original(*args, **{**kwargs, "max_sequence_length": max_length})

            self.pipeline.encode_prompt = with_testbed_length
            try:
                return super().encode_prompt(prompt, negative_prompt, guidance_scale, self.tokenizer.model_max_length,
                                             device)
            finally:
                self.pipeline.encode_prompt = original

    class OracleReward(PointwiseRewardModel):
        use_tensor_inputs = True

        def __init__(self, config, accelerator):
            super().__init__(config, accelerator)
            self.judge = rewards.load("shapes-oracle")

        @torch.no_grad()
        def __call__(self, prompt, image=None, **kwargs):
            images = torch.stack([img.float().cpu() for img in image]).clamp(0, 1)
            return RewardModelOutput(rewards=self.judge.score(list(prompt), images).float(), extra_info={})

    globals().update(TestbedSD3Adapter=TestbedSD3Adapter, OracleReward=OracleReward)


def timed(trainer, records: list[dict]) -> None:
    """Their trainer's three epoch phases, each wrapped to add its CPU seconds to the epoch's record."""
    for phase in ("sample", "prepare_feedback", "optimize"):
        method = getattr(trainer, phase)

        def wrapped(*args, _method=method, _phase=phase, **kwargs):
            if _phase == "sample":
                records.append({"epoch": trainer.epoch})
            start = time.process_time()
            try:
                return _method(*args, **kwargs)
            finally:
                records[-1][f"{_phase}_cpu_seconds"] = time.process_time() - start

        setattr(trainer, phase, wrapped)


def held_out_scores(trainer, pipeline_dir: Path) -> list[float]:
    """Their final LoRA merged into the testbed transformer, saved as a pipeline and sampled on our held-out images."""
    transformer = trainer.accelerator.unwrap_model(trainer.adapter.transformer).merge_and_unload()
    pipe = load_pipeline("testbed-flow")
    pipe.transformer = transformer.float().eval()
    pipe.save_pretrained(pipeline_dir)
    (pipeline_dir / "flow_testbed.json").write_text(json.dumps(testbed_settings("testbed-flow")))
    prompts = load_prompt_list(HELD_OUT) * HELD_OUT_REPEATS
    seeds = [EVAL_SEED + i for i in range(len(prompts))]
    images = generate_images(pipe, prompts, seeds, num_inference_steps=EVAL_STEPS,
                             guidance_scale=testbed_settings("testbed-flow")["guidance_scale"], batch_size=32)
    return rewards.load("shapes-oracle").score(prompts, images).float().tolist()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flow-factory", type=Path, required=True, help="their repository's copy (DIR/src/flow_factory)")
    p.add_argument("--trainer", choices=("grpo", "nft"), required=True)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--out", type=Path, required=True, help="a folder: their config, epochs.jsonl, heldout.json")
    p.add_argument("--no-heldout", action="store_true", help="time the epochs only")
    args = p.parse_args(argv)
    if not (args.flow_factory / "src" / "flow_factory").is_dir():
        sys.exit(f"--flow-factory {args.flow_factory}: no src/flow_factory inside (a copy of X-GenGroup/Flow-Factory)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    Arguments, SD3_5Adapter, PointwiseRewardModel, RewardModelOutput, load_trainer = their_classes(args.flow_factory)
    define_adaptations(SD3_5Adapter, PointwiseRewardModel, RewardModelOutput)

    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "data"
    data.mkdir(exist_ok=True)
    (data / "train.txt").write_text("\n".join(load_prompt_list(TRAIN)) + "\n")
    settings = common_settings(data, args.out / "saves")
    settings["train"], settings["scheduler"] = train_section(args.trainer, args.epochs)
    (args.out / "their_config.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    config = Arguments.load_from_yaml(str(args.out / "their_config.yaml"))

    records: list[dict] = []
    trainer = load_trainer(config)
    timed(trainer, records)
    start = time.process_time()
    trainer.start()
    total = time.process_time() - start
    with open(args.out / "epochs.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    steady = records[1:] or records  # the first epoch also pays one-time costs
    mean = {key: sum(r[key] for r in steady) / len(steady) for key in steady[0] if key.endswith("cpu_seconds")}
    print(f"Flow-Factory {args.trainer} @ {COMMIT[:7]}: {len(records)} epochs in {total:.1f} CPU-s; per epoch after the "
          f"first: " + ", ".join(f"{k.removesuffix('_cpu_seconds')} {v:.2f} s" for k, v in mean.items()), flush=True)
    if not args.no_heldout:
        scores = held_out_scores(trainer, args.out / "pipeline")
        (args.out / "heldout.json").write_text(json.dumps({"prompts": HELD_OUT, "repeats": HELD_OUT_REPEATS,
                                                           "first_seed": EVAL_SEED, "scores": scores}))
        print(f"held-out ({HELD_OUT} x {HELD_OUT_REPEATS}): mean oracle score {sum(scores) / len(scores):.4f}")


if __name__ == "__main__":
    main()
