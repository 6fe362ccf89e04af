"""Train a reward model from preference feedback (VisionPrefer's distillation, LLaVA-Reward's heads).

    python -m align.train_reward --dataset runs/dpo/feedback/pairs.parquet      # an expensive judge's labels
    python -m align.train_reward --config configs/testbed_reward.yaml           # offline, on a CPU
    accelerate launch -m align.train_reward --backbone mllm --model Qwen/Qwen2.5-VL-7B-Instruct ...

The algorithm box, per optimisation step:
    1. take preference pairs (caption c, preferred x_w, rejected x_l) in the Pick-a-Pic schema;
    2. r_w = R(c, x_w), r_l = R(c, x_l) with R a CLIP backbone + MLP head, or an MLLM + SkipCA +
       value head at the final token (LLaVA-Reward); LoRA on the backbone;
    3. loss = -log sigmoid((r_w - r_l) / tau)  [+ w * BCE(sigmoid(r), y) on unpaired labels, the authors'
       BCEWithLogits on the raw reward: tau scales the pairwise term only];
    4. every epoch: pairwise accuracy on held-out pairs; at the end a temperature T is fitted on them
       so that P(a > b) = sigmoid((r_a - r_b) / (tau T)) is calibrated (reliability plot in final/).

The result, <output_dir>/final, loads with ``rewards.load("<output_dir>/final")`` and plugs into
align/dpo.py and align/ddpo.py as ``--reward <output_dir>/final``.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import torch

import rewards
from align.cli import ConfigError, option
from align.data.pair_stream import load_pairs
from align.data.pairs import PAIR_COLUMNS, TIE_POLICIES, DataError, check_pair_file
from align.declared import (
    ADAM_BETA,
    BATCH,
    COEFFICIENT,
    COUNT,
    LEARNING_RATE,
    POSITIVE,
    SEED,
    SHARE,
    WEIGHT_DECAY,
)
from align.eval.report import Section, img_tag, table_html
from align.run_folder import (
    RunFolder,
    atomic_folder,
    atomic_write_bytes,
    atomic_write_text,
    restores_old_run_on_failure,
)
from align.testbed.models import build_shapes_clip, shapes_clip_image_processor
from align.testbed.pairs import rendered_pairs, write_parquet
from align.testbed.tokenizer import testbed_tokenizer
from align.train.command import TrainingStopped, lr_schedules, run_trainer, way_on
from align.train.lifecycle import TrainingRun
from align.train.options import LORA_ALPHAS, LORA_RANKS, TRACKERS, RunOptions
from align.train.report import Curve
from align.train.reward_losses import (
    binary_cross_entropy_loss,
    bradley_terry_loss,
    expected_calibration_error,
    fit_temperature,
    logit_nll,
    pairwise_accuracy,
    reliability_bins,
)
from align.validation import check_common_inputs, check_parquet_columns
from rewards.clip import SHAPES_CLIP_FOLDER
from rewards.images import decode_image
from rewards.llava_reward import LlavaRewardModel, check_backbone
from rewards.trained import BlipRewardModel, ClipRewardModel, write_marker

BACKBONES = ("clip", "blip", "mllm")
FINETUNE = ("lora", "full", "head")
TESTBED_SCRATCH = "testbed:scratch"
TESTBED_ORACLE = "testbed-oracle:"
CURVES = (Curve("Bradley-Terry loss", ("loss",)), Curve("training pairwise accuracy", ("train_acc",)),
          Curve("held-out pairwise accuracy", ("eval_acc",)), Curve("held-out Bradley-Terry loss", ("eval_bt_loss",)))


UNPAIRED_COLUMNS = ("caption", "jpg", "label")


def check_unpaired_file(path: str) -> None:
    """--unpaired's declared reader: a parquet file of labelled images (its footer)."""
    check_parquet_columns("unpaired images", path, UNPAIRED_COLUMNS)


@dataclass
class RewardTrainConfig(RunOptions):
    # --- data (Pick-a-Pic schema: caption, jpg_0, jpg_1, label_0, label_1)
    dataset: str | None = option(
        None, "preference pairs (required): a parquet/folder/HF id (e.g. a dpo run's feedback/pairs.parquet), or "
        "testbed-oracle:<n>[:<seed>]: n shapes-world pairs (render vs near miss) labelled by shapes-oracle", "data",
        path="any", or_name=True, formats=(".parquet",), reads=check_pair_file)
    dataset_split: str = option("train", "split of --dataset", "data")
    eval_dataset: str | None = option(None, "held-out pairs (the same forms as --dataset); None: --eval_fraction "
                                      "of --dataset", "data", path="any", or_name=True, formats=(".parquet",),
                                      reads=check_pair_file)
    eval_fraction: float = option(0.1, "share of --dataset held out when no --eval_dataset is given", "data",
                                  within=SHARE)
    max_pairs: int | None = option(None, "cap on the pairs used (None: all)", "data", within=COUNT)
    tie_policy: str = option("drop", "tied pairs: drop or keep_first", "data", choices=TIE_POLICIES)
    unpaired: str | None = option(None, "parquet with caption, jpg, label (1 good / 0 bad) for a BCE term", "data",
                                  path="file", formats=(".parquet",), reads=check_unpaired_file)
    bce_weight: float = option(1.0, "weight of the BCE term on --unpaired labels", "optimisation", within=COEFFICIENT)
    # --- model
    backbone: str = option("clip", "clip or blip (an MLP head, VP-Score / ImageReward style) or mllm "
                           "(LLaVA-Reward)", "model", choices=BACKBONES)
    model: str = option("openai/clip-vit-large-patch14", "the backbone: a hub id, a folder, 'testbed' (shapes-clip) "
                        "or testbed:scratch", "model", path="folder", or_name=True)
    trust_remote_code: bool = option(False, "run the model repository's own code (mllm backbones transformers lacks; Phi-3.5-vision is native); off unless "
                                     "asked", "model")
    skip_cross_attention: bool = option(True, "mllm: SkipCA before the value head (LLaVA-Reward)", "model",
                                        applies="--backbone mllm")
    head_hidden: str = option("256,64", "clip/blip: the MLP head's hidden sizes", "model", applies="--backbone clip,blip")
    head_dropout: float = option(0.1, "dropout of the MLP head", "model", within=SHARE, applies="--backbone clip,blip")
    finetune: str = option("lora", "lora (the paper), full, or head (the backbone frozen)", "model", choices=FINETUNE)
    lora_rank: int = option(128, "LoRA rank (LLaVA-Reward: r 128, alpha 256, dropout 0.05)", "model",
                            within=LORA_RANKS)
    lora_alpha: float = option(256.0, "LoRA alpha", "model", within=LORA_ALPHAS)
    lora_dropout: float = option(0.05, "LoRA dropout", "model", within=SHARE)
    # --- objective
    tau: float = option(0.1, "Bradley-Terry temperature: P(a > b) = sigmoid((r_a - r_b) / tau)", "optimisation",
                        within=POSITIVE)
    # --- optimisation
    learning_rate: float = option(2e-4, "AdamW learning rate (LLaVA-Reward's LoRA recipe)", "optimisation",
                                  within=LEARNING_RATE)
    weight_decay: float = option(0.0, "AdamW weight decay", "optimisation", within=WEIGHT_DECAY)
    adam_beta1: float = option(0.9, "AdamW β1", "optimisation", within=ADAM_BETA)
    adam_beta2: float = option(0.95, "AdamW β2", "optimisation", within=ADAM_BETA)
    lr_scheduler: str = option("cosine", "diffusers' get_scheduler: cosine, constant, linear, ...", "optimisation",
                               choices=lr_schedules)
    lr_warmup_ratio: float = option(0.03, "share of the steps spent warming the learning rate up", "optimisation",
                                    within="[0, 1]")
    max_grad_norm: float = option(1.0, "gradient-norm clipping (0: none)", "optimisation", within=COEFFICIENT)
    train_batch_size: int = option(8, "pairs per process per micro-step", "optimisation", within=BATCH)
    gradient_accumulation_steps: int = option(1, "micro-steps per optimiser step", "optimisation", within=BATCH)
    num_epochs: float = option(3.0, "passes over the training pairs (fractions allowed)", "optimisation",
                               within=POSITIVE)
    max_steps: int | None = option(None, "optimiser steps in all; overrides --num_epochs", "optimisation", within=COUNT)
    mixed_precision: str | None = option(
        None, "no, fp16 or bf16; unset: accelerate's setting (accelerate launch --mixed_precision, its config file), "
        "else no", "optimisation", choices=("no", "fp16", "bf16"))
    # --- output
    output_dir: str = option("runs/reward", "the run folder; final/ loads with rewards.load(folder)", "output",
                             path="output")
    seed: int = option(0, "seed of the split, pair order and initialisation", "optimisation", within=SEED)
    report_to: str = option("none", "tracker: tensorboard, wandb, all, or none", "output", choices=TRACKERS)
    checkpointing_steps: int = option(200, "save a resumable checkpoint every N optimiser steps", "output", within=COUNT)
    checkpoints_total_limit: int = option(2, "checkpoints kept (older ones are deleted)", "output", within=COUNT)
    calibrate: bool = option(True, "fit a temperature on the held-out pairs at the end so that P(a > b) is "
                             "calibrated", "evaluation")
    name: str | None = option(None, "the judge's name (None: the output folder's name)", "output")

    def validate(self) -> None:
        check_common_inputs(self)  # every value against its declaration: types, ranges, choices, paths, what applies
        if not self.dataset:
            raise ConfigError("--dataset is required: a Pick-a-Pic-schema parquet/folder/HF dataset of preference pairs")
        if self.eval_fraction == 0 and not self.eval_dataset:
            raise ConfigError("held-out pairs are needed (accuracy, calibration): set --eval_fraction > 0 or --eval_dataset")
        try:
            hidden = [int(h) for h in self.head_hidden.split(",") if h.strip()]
        except ValueError:
            raise ConfigError(f"--head_hidden must be comma-separated integers, got {self.head_hidden!r}") from None
        if any(h < 1 for h in hidden):
            raise ConfigError(f"--head_hidden sizes must be >= 1, got {self.head_hidden!r}")
        for spec in filter(None, (self.dataset, self.eval_dataset)):
            if spec.startswith(TESTBED_ORACLE):
                parse_testbed_oracle(spec)
        for name, source in (("dataset", self.dataset), ("eval_dataset", self.eval_dataset), ("unpaired", self.unpaired)):
            if source and source.startswith((".", "/", "~")) and not Path(source).expanduser().exists():
                raise ConfigError(f"--{name} {source!r}: no such file or folder")


# ----------------------------------------------------------------------------------------------
# Data


@dataclass
class Example:
    """One unpaired labelled image."""

    caption: str
    image: bytes
    label: float


def split_pairs(pairs: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """A fixed random held-out share (at least one pair each side)."""
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = min(max(1, round(len(pairs) * eval_fraction)), len(pairs) - 1)
    if len(pairs) < 2:
        raise ConfigError(f"need at least 2 pairs to hold some out, got {len(pairs)}")
    held = set(order[:n_eval])
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]


def parse_testbed_oracle(spec: str) -> tuple[int, int]:
    parts = spec.split(":")
    try:
        n, seed = int(parts[1]), int(parts[2]) if len(parts) > 2 else 0
    except (ValueError, IndexError):
        raise ConfigError(f"dataset spec {spec!r} must be testbed-oracle:<pairs>[:<seed>]") from None
    if n < 2 or len(parts) > 3:
        raise ConfigError(f"dataset spec {spec!r} must be testbed-oracle:<pairs >= 2>[:<seed>]")
    return n, seed


def make_oracle_pairs(spec: str, path: Path, batch: int = 256) -> Path:
    """Shapes-world pairs (correct render vs near-miss render) relabelled by the shapes-oracle judge.

    The oracle's verdict, not the construction, is the label (ties -> 0.5, dropped later): this is
    the distillation set-up, an expensive judge's labels for a cheap model. The construction's
    label is kept in ``label_0_ground_truth`` for reference.
    """
    n, seed = parse_testbed_oracle(spec)
    table = rendered_pairs(n, seed)
    oracle = rewards.load("shapes-oracle")
    labels = []
    for start in range(0, len(table), batch):
        part = table.iloc[start : start + batch]
        images_0 = [decode_image(b) for b in part["jpg_0"]]
        images_1 = [decode_image(b) for b in part["jpg_1"]]
        labels += [p.prob_a if p.winner is not None else 0.5 for p in oracle.compare(list(part["caption"]), images_0, images_1)]
    table["label_0_ground_truth"] = table["label_0"]
    table["label_0"] = labels
    table["label_1"] = [1.0 - x for x in labels]
    table["judge"] = oracle.name
    return write_parquet(table, path)


def oracle_pairs_file(spec: str, run: RunFolder, accelerator) -> str:
    """A data source as given, or for testbed-oracle:<n>:<seed> the parquet made (once) in the run folder."""
    if not spec.startswith(TESTBED_ORACLE):
        return spec
    n, seed = parse_testbed_oracle(spec)
    path = run.path / "feedback" / f"testbed-oracle_{n}_{seed}.parquet"
    if accelerator.is_main_process and not path.is_file():
        make_oracle_pairs(spec, path)
    accelerator.wait_for_everyone()
    return str(path)


def load_unpaired(source: str) -> list[Example]:
    """Unpaired labels for the BCE term: a parquet with caption, jpg (image bytes) and label in [0, 1]."""
    import pyarrow.parquet as pq  # heavy; only for --unpaired

    path = Path(source).expanduser()
    if not path.is_file() or path.suffix != ".parquet":
        raise DataError(f"--unpaired {source!r} must be a .parquet file with columns caption, jpg, label")
    names = pq.read_schema(path).names
    missing = [c for c in ("caption", "jpg", "label") if c not in names]
    if missing:
        raise DataError(f"--unpaired {source!r} lacks column(s) {', '.join(missing)}; needed: caption, jpg, label")
    rows = pq.read_table(path, columns=["caption", "jpg", "label"]).to_pylist()
    out = []
    for i, row in enumerate(rows):
        image = row["jpg"]["bytes"] if isinstance(row["jpg"], dict) else row["jpg"]
        label = float(row["label"])
        if not 0.0 <= label <= 1.0:
            raise DataError(f"--unpaired {source!r} row {i}: label must be in [0, 1], got {label}")
        out.append(Example(row["caption"] or "", bytes(image), label))
    if not out:
        raise DataError(f"--unpaired {source!r} holds no rows")
    return out


def decode(data: bytes, where: str):
    return decode_image(data, where)


# ----------------------------------------------------------------------------------------------
# Models


def build_model(config: RewardTrainConfig):
    """A model with ``forward(prompts, pil_images) -> rewards[N]`` and ``save(folder) -> dict``."""
    if config.backbone == "mllm":
        model = LlavaRewardModel.from_base(
            config.model, skip_cross_attention=config.skip_cross_attention, trust_remote_code=config.trust_remote_code
        )
        model.init_reward_head()
        if config.finetune == "lora":
            model.add_lora(rank=config.lora_rank, alpha=config.lora_alpha, dropout=config.lora_dropout)
        elif config.finetune == "head":
            model.freeze_backbone()
        return model

    model_class = ClipRewardModel if config.backbone == "clip" else BlipRewardModel
    backbone, processor = load_embedding_backbone(config.model, model_class)
    hidden = tuple(int(h) for h in config.head_hidden.split(",") if h.strip())
    model = model_class(backbone, processor, hidden=hidden, dropout=config.head_dropout)
    if config.finetune == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                          target_modules=list(model_class.lora_targets))
        model.backbone = get_peft_model(backbone, lora)
    elif config.finetune == "head":
        backbone.requires_grad_(False)
    return model


def load_embedding_backbone(spec: str, model_class):
    """(backbone, processor) from a hub id / folder, or for CLIP "testbed" (shapes-clip) / testbed:scratch."""
    from transformers import CLIPProcessor

    if spec in (TESTBED_SCRATCH, "testbed") and model_class.kind != "clip-mlp":
        raise ConfigError(f"--model {spec} is a CLIP model; use it with --backbone clip")
    if spec == TESTBED_SCRATCH:
        tokenizer = testbed_tokenizer()
        return build_shapes_clip(tokenizer), CLIPProcessor(image_processor=shapes_clip_image_processor(), tokenizer=tokenizer)
    if spec == "testbed":

        if not (SHAPES_CLIP_FOLDER / "config.json").is_file():
            raise ConfigError(
                f"--model testbed needs the bundled shapes-clip weights ({SHAPES_CLIP_FOLDER}); build them with "
                f"the testbed scripts, or use --model {TESTBED_SCRATCH} for a randomly initialised tiny CLIP"
            )
        spec = str(SHAPES_CLIP_FOLDER)
    try:
        return model_class.load_backbone(spec)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--model {spec!r}: cannot load a {model_class.backbone_class} backbone and its processor: {err}") from err


# ----------------------------------------------------------------------------------------------
# Batches: sample k of step s is a pure function of (seed, global counter), so resume is exact.


class Order:
    """Epoch-wise shuffled indices addressed by a global counter."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self._perm = size, seed, (None, None)

    def __getitem__(self, counter: int) -> int:
        epoch, position = divmod(counter, self.size)
        if self._perm[0] != epoch:
            self._perm = (epoch, torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch)))
        return int(self._perm[1][position])


def pair_batch(pairs, order: Order, start: int, size: int):
    chosen, rejected, captions = [], [], []
    for k in range(start, start + size):
        pair = pairs[order[k]]
        captions.append(pair.caption)
        chosen.append(decode(pair.chosen, f"pair {pair.source_index} chosen"))
        rejected.append(decode(pair.rejected, f"pair {pair.source_index} rejected"))
    return captions, chosen, rejected


@torch.no_grad()
def pair_rewards(model, pairs, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards of winners and losers of ``pairs`` (eval mode)."""
    was_training = model.training
    model.eval()
    chosen, rejected = [], []
    for start in range(0, len(pairs), batch_size):
        part = pairs[start : start + batch_size]
        captions = [p.caption for p in part]
        images = [decode(p.chosen, f"pair {p.source_index} chosen") for p in part]
        images += [decode(p.rejected, f"pair {p.source_index} rejected") for p in part]
        rewards = model(captions + captions, images).float().cpu()
        chosen.append(rewards[: len(part)])
        rejected.append(rewards[len(part) :])
    model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected)


# ----------------------------------------------------------------------------------------------
# Training


def check_inputs(config: RewardTrainConfig) -> None:
    config.validate()
    # Local parquet files: readable, with their columns, before the run folder is made (rows are read later).
    for flag_name, source, columns in (("dataset", config.dataset, PAIR_COLUMNS), ("eval_dataset", config.eval_dataset, PAIR_COLUMNS),
                                       ("unpaired", config.unpaired, ("caption", "jpg", "label"))):
        if source and str(source).lower().endswith(".parquet") and not source.startswith(TESTBED_ORACLE):
            check_parquet_columns(flag_name, source, columns)
    if config.backbone == "mllm":
        try:
            check_backbone(config.model, trust_remote_code=config.trust_remote_code)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def training_pairs(run: TrainingRun):
    """(training pairs, held-out pairs, unpaired labels): the pairs winner first, a held-out split of them unless
    --eval_dataset names its own, and LLaVA-Reward's unpaired labels where given."""
    config = run.config
    source = oracle_pairs_file(config.dataset, run.folder, run.accelerator)
    pairs, stats = load_pairs(source, split=config.dataset_split, tie_policy=config.tie_policy, max_pairs=config.max_pairs)
    if config.eval_dataset:
        train_pairs = pairs
        eval_source = oracle_pairs_file(config.eval_dataset, run.folder, run.accelerator)
        eval_pairs, _ = load_pairs(eval_source, split=config.dataset_split, tie_policy="drop")
    else:
        train_pairs, eval_pairs = split_pairs(pairs, config.eval_fraction, config.seed)
    unpaired = load_unpaired(config.unpaired) if config.unpaired else []
    run.say(f"{stats.summary()}; train pairs {len(train_pairs)}, held-out pairs {len(eval_pairs)}, unpaired labels "
            f"{len(unpaired)}", tag="data")
    return train_pairs, eval_pairs, unpaired


def trainable_reward_model(config: RewardTrainConfig, train_pairs):
    """The reward model in training mode (a CLIP/BLIP backbone's feature normalisation fitted on the first pairs)."""
    model = build_model(config)
    if config.backbone in ("clip", "blip"):
        sample = train_pairs[:128]
        model.fit_feature_norm(
            [p.caption for p in sample] * 2,
            [decode(p.chosen, "pair") for p in sample] + [decode(p.rejected, "pair") for p in sample],
        )
    model.train()
    return model


@dataclass
class RewardData:
    """The pairs and unpaired labels a step reads, in the run's seeded orders."""

    pairs: list
    order: Order
    unpaired: list
    unpaired_order: Order | None


def train_step(run: TrainingRun, model, optimizer, scheduler, data: RewardData, step: int) -> dict[str, float]:
    """One optimiser step over the accumulated micro-steps: the Bradley-Terry loss (plus the BCE on unpaired labels);
    returns its averaged metrics."""
    config, accelerator = run.config, run.accelerator
    accumulation = config.gradient_accumulation_steps
    rank, world = accelerator.process_index, accelerator.num_processes
    totals = {"loss": 0.0, "bt_loss": 0.0, "bce_loss": 0.0, "train_acc": 0.0}
    for micro in range(accumulation):
        counter = ((step * accumulation + micro) * world + rank) * config.train_batch_size
        with accelerator.accumulate(model):
            captions, chosen, rejected = pair_batch(data.pairs, data.order, counter, config.train_batch_size)
            rewards = model(captions + captions, chosen + rejected)
            r_w, r_l = rewards.float().chunk(2)
            bt = bradley_terry_loss(r_w, r_l, config.tau)
            loss = bt
            if data.unpaired:
                picks = [data.unpaired[data.unpaired_order[counter + j]] for j in range(config.train_batch_size)]
                images = [decode(e.image, "unpaired image") for e in picks]
                scores = model([e.caption for e in picks], images).float()
                labels = torch.tensor([e.label for e in picks], device=scores.device)
                bce = binary_cross_entropy_loss(scores, labels)  # LLaVA-Reward's Binary_Cls_loss: no tau
                loss = loss + config.bce_weight * bce
                totals["bce_loss"] += float(bce.detach()) / accumulation
            if not torch.isfinite(loss):
                raise TrainingStopped(f"loss became {float(loss)} at step {step} (a --learning_rate too high?); "
                                      f"{way_on(run.latest_checkpoint())}")
            accelerator.backward(loss)
            if accelerator.sync_gradients and config.max_grad_norm > 0:
                accelerator.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        totals["loss"] += float(loss.detach()) / accumulation
        totals["bt_loss"] += float(bt.detach()) / accumulation
        totals["train_acc"] += pairwise_accuracy(r_w.detach(), r_l.detach()) / accumulation
    if not data.unpaired:
        totals.pop("bce_loss")
    return totals


@restores_old_run_on_failure
def train(config: RewardTrainConfig) -> Path:
    """Train a reward model; returns the final folder (loadable with rewards.load)."""
    from transformers import get_scheduler

    check_inputs(config)
    run = TrainingRun(config, "reward", accumulate=True)
    accelerator = run.accelerator
    run.start()

    # 1. Data: pairs (winner first), a held-out split, optional unpaired labels.
    train_pairs, eval_pairs, unpaired = training_pairs(run)

    # 2. Model, optimiser, schedule (sizes printed so they can be checked).
    model = trainable_reward_model(config, train_pairs)
    params = [p for p in model.parameters() if p.requires_grad]
    per_step = config.train_batch_size * accelerator.num_processes * config.gradient_accumulation_steps
    steps_per_epoch = max(1, math.ceil(len(train_pairs) / per_step))
    max_steps = config.max_steps or max(1, math.ceil(config.num_epochs * steps_per_epoch))
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), weight_decay=config.weight_decay)
    scheduler = get_scheduler(
        config.lr_scheduler, optimizer,
        num_warmup_steps=math.ceil(config.lr_warmup_ratio * max_steps) * accelerator.num_processes,
        num_training_steps=max_steps * accelerator.num_processes,
    )
    run.say(f"backbone {config.backbone} ({config.model}) | finetune {config.finetune} | trainable parameters "
            f"{sum(p.numel() for p in params):,} | pairs per step {per_step} | steps per epoch {steps_per_epoch} | "
            f"steps {max_steps} | tau {config.tau} | lr {config.learning_rate}")
    model, optimizer, scheduler = run.prepare(model, optimizer, scheduler, only_trainable=config.finetune != "full")
    run.init_trackers("train_reward")

    # 3. Resume: model, optimiser, schedule and RNG states; the data position follows from the step.
    start_step, _ = run.resume()
    data = RewardData(train_pairs, Order(len(train_pairs), config.seed), unpaired,
                      Order(len(unpaired), config.seed + 1) if unpaired else None)
    for step in range(start_step, max_steps):
        logs = train_step(run, model, optimizer, scheduler, data, step)
        done = step + 1
        logs.update(lr=scheduler.get_last_lr()[0], epoch=done / steps_per_epoch)
        if done % steps_per_epoch == 0 or done == max_steps:
            r_w, r_l = pair_rewards(accelerator.unwrap_model(model), eval_pairs, config.train_batch_size * 2)
            logs["eval_acc"] = pairwise_accuracy(r_w, r_l)
            logs["eval_bt_loss"] = float(bradley_terry_loss(r_w, r_l, config.tau))
            run.say(f"step {done} epoch {done / steps_per_epoch:.2f}: held-out pairwise accuracy {logs['eval_acc']:.4f} "
                    f"on {len(eval_pairs)} pairs, BT loss {logs['eval_bt_loss']:.4f}", tag="eval")
        run.log(done, logs)
        if done % config.checkpointing_steps == 0 or done == max_steps:
            run.checkpoint(done)

    # 4. Calibration on the held-out pairs, final weights and marker (written last), report.
    accelerator.wait_for_everyone()
    final = run.path / "final"
    if run.main:
        meta = save_reward_model(accelerator.unwrap_model(model), config, run.path, eval_pairs, len(train_pairs))
        run.report(f"Reward model: {config.model}", CURVES, extra_sections=[calibration_section(meta, final / "reliability.png")])
    del model, optimizer, scheduler
    run.end()
    return final


def save_reward_model(trained, config: RewardTrainConfig, run_path: Path, eval_pairs, train_pairs: int) -> dict:
    """final/ as a whole: the weights, the calibration fitted on the held-out pairs, its reliability plot, the model
    card and the marker that makes the folder a judge (written last); returns its metadata."""
    final = run_path / "final"
    r_w, r_l = pair_rewards(trained, eval_pairs, config.train_batch_size * 2)
    calibration = calibrate(r_w, r_l, config.tau, fit=config.calibrate)
    with atomic_folder(final) as staged:  # the whole final/ at once: a half-written one never loads
        meta = trained.save(staged)
        save_reliability_plot(calibration, staged / "reliability.png")
        meta.update(name=config.name or run_path.name, tau=config.tau, calibration=calibration,
                    eval_accuracy=pairwise_accuracy(r_w, r_l), eval_pairs=len(eval_pairs), train_pairs=train_pairs,
                    trained_on=config.dataset, backbone_model=config.model)
        write_model_card(staged, config, meta, final)
        write_marker(staged, meta)
    print(f"[reward] held-out accuracy {meta['eval_accuracy']:.4f}; calibration temperature "
          f"{calibration['temperature']:.4g} (ECE {calibration['ece_before']:.4f} -> {calibration['ece_after']:.4f}); "
          f"load it with rewards.load({str(final)!r})", flush=True)
    return meta


def calibrate(r_w: torch.Tensor, r_l: torch.Tensor, tau: float, fit: bool = True, num_bins: int = 10) -> dict:
    """Temperature scaling on held-out pairs and the reliability bins before and after.

    Alternate pairs are presented mirrored (loser first) so predictions cover [0, 1] and the
    diagram has both outcomes; the fitted temperature does not depend on the presentation.
    """
    logits = (r_w - r_l) / tau
    temperature = fit_temperature(logits) if fit else 1.0
    sign = torch.ones_like(logits)
    sign[1::2] = -1.0
    first_wins = (sign > 0).double()
    before = reliability_bins(torch.sigmoid(sign * logits), first_wins, num_bins)
    after = reliability_bins(torch.sigmoid(sign * logits / temperature), first_wins, num_bins)
    return {
        "temperature": temperature,
        "fitted": fit,
        "ece_before": expected_calibration_error(before),
        "ece_after": expected_calibration_error(after),
        "nll_before": logit_nll(logits, 1.0),
        "nll_after": logit_nll(logits, temperature),
        "bins_before": before,
        "bins_after": after,
        "pairs": int(logits.numel()),
    }


def save_reliability_plot(calibration: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 4))
    ax.plot([0, 1], [0, 1], color="grey", lw=1, ls="--", label="perfect")
    for key, label in (("bins_before", "tau only"), ("bins_after", f"T = {calibration['temperature']:.3g}")):
        points = [(b["mean_predicted"], b["observed"]) for b in calibration[key] if b["count"]]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", lw=1.2, label=label)
    ax.set_xlabel("predicted P(first image better)")
    ax.set_ylabel("observed share first better")
    ax.set_title(f"held-out pairs: {calibration['pairs']}")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def calibration_section(meta: dict, plot: Path):
    """The report section with the held-out accuracy, the calibration and the reliability diagram."""
    cal = meta["calibration"]
    rows = [
        {"": "pairwise accuracy", "value": f"{meta['eval_accuracy']:.4f} ({meta['eval_pairs']} pairs)"},
        {"": "temperature T", "value": f"{cal['temperature']:.4g}"},
        {"": "ECE before / after", "value": f"{cal['ece_before']:.4f} / {cal['ece_after']:.4f}"},
        {"": "NLL before / after", "value": f"{cal['nll_before']:.4f} / {cal['nll_after']:.4f}"},
    ]
    return Section("Held-out pairs and calibration", table_html(rows) + img_tag(plot.read_bytes(), alt="reliability diagram"))


def write_model_card(folder: Path, config: RewardTrainConfig, meta: dict, final: Path | None = None) -> None:
    """README.md in ``folder``; ``final``: where the folder will live (it is written in a staging folder)."""
    calibration = meta["calibration"]
    shown = final or folder
    text = f"""# Reward model `{meta['name']}`

Trained with `python -m align.train_reward` on preference pairs from `{config.dataset}`.
Load it with `rewards.load("{shown}")`; use it in training with `--reward {shown}`.

| setting | value |
|---|---|
| backbone | {config.backbone}: `{config.model}` |
| fine-tuning | {config.finetune} (LoRA r {config.lora_rank}, alpha {config.lora_alpha}) |
| objective | Bradley-Terry, tau = {config.tau}{' + BCE on unpaired labels' if config.unpaired else ''} |
| train / held-out pairs | {meta['train_pairs']} / {meta['eval_pairs']} |
| held-out pairwise accuracy | {meta['eval_accuracy']:.4f} |
| calibration temperature | {calibration['temperature']:.4g} (ECE {calibration['ece_before']:.4f} -> {calibration['ece_after']:.4f}) |

Scores are calibrated logits r / (tau T): P(a better than b) = sigmoid(score_a - score_b).
The reliability diagram of the held-out pairs is `reliability.png`.
"""
    atomic_write_text(folder / "README.md", text)


def main(argv: list[str] | None = None) -> None:
    run_trainer(RewardTrainConfig, train, argv, __doc__, check=refuse_dry_run)


def refuse_dry_run(config: RewardTrainConfig) -> None:
    raise ConfigError("--dry_run plans the memory of the diffusion trainers (align/dpo.py, align/ddpo.py); a reward "
                      "model's run has no plan: leave it out")


if __name__ == "__main__":
    main()
