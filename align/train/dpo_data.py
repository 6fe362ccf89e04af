"""Diffusion-DPO's data: which pairs each micro-step reads and how they become latents and conditioning.

Every random draw of step s comes from a generator seeded by (seed, s, micro-step, process), so an interrupted run
resumes exactly without saving data-loader state; the pairs come from a latent store (encoded once) or from images
decoded by the DataLoader's workers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from align.data.latent_store import (
    COND_PREFIX,
    StoreLatents,
    StoreSpec,
    build_store,
    check_store,
    model_fingerprint,
    read_manifest,
)
from align.data.pair_stream import PairPixels, PlannedBatches, micro_batch_loader
from align.data.pairs import DataError
from align.data.prompt_sets import load_prompt_list
from align.train.dpo_config import RUN_STORE, DPOConfig
from align.train.dpo_feedback import label_round


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


class RoundPairs:
    """The pairs a run trains on: offline pairs (one round), or AI feedback in --feedback_rounds rounds, each labelled
    by the judge from the model as it stands when its round starts (the first one from the base model, or from the
    resumed one). ``start_round(step)`` readies the micro-batches of the round holding ``step``, read from there to
    the round's end: latents and text embeddings from a latent store (built first if needed), or images decoded by
    the DataLoader's workers."""

    def __init__(self, run, pipe, judge, table, resolution: int, sampling: tuple[int, float]):
        self.run, self.config, self.pipe, self.judge, self.table = run, run.config, pipe, judge, table
        self.resolution, self.sampling = resolution, sampling
        self.rounds = self.config.feedback_rounds if judge is not None else 1
        self.steps_per_round = self.config.max_steps // self.rounds
        self.prompts = load_prompt_list(self.config.prompts) if judge is not None else None
        self.order, self.batches = None, None

    def round_starts(self, step: int, start: int) -> bool:
        """Whether ``step`` begins a later round than the run's (or the resumed run's) first."""
        return step > start and step % self.steps_per_round == 0

    def ends_round(self, done: int) -> bool:
        return self.rounds > 1 and done % self.steps_per_round == 0

    def store(self, round_index: int) -> Path | None:
        if self.config.store_folder:
            return Path(self.config.store_folder)
        return run_store_path(self.run.path, round_index, self.rounds) if self.config.latent_store == RUN_STORE else None

    def start_round(self, step: int) -> None:
        accelerator, config = self.run.accelerator, self.config
        round_index = step // self.steps_per_round
        if self.judge is not None:
            self.table = label_round(self.run, self.pipe, self.judge, self.prompts, round_index, self.sampling)
        end = (round_index + 1) * self.steps_per_round
        data, self.order = training_data(accelerator, self.pipe, self.table, self.resolution, config,
                                         self.store(round_index), step, end)
        self.batches = micro_batches(data, self.order, config, accelerator, step, end)

    def micro_batch(self, family, step: int, micro: int):
        """(the micro-step's generator, winner latents, loser latents, conditioning): the pairs, flips and dropped
        captions were drawn from the generator by the DataLoader's sampler (micro_batch_keys); redrawing them here
        leaves it where the noise draws start."""
        accelerator = self.run.accelerator
        gen, _ = micro_batch_keys(self.order, self.config, step, micro, accelerator.process_index,
                                  accelerator.num_processes)
        return (gen, *batch_latents_and_conditioning(family, self.pipe, next(self.batches), self.resolution))
