"""Encode preference pairs once into a latent store that `align/dpo.py --latent_store` trains from.

    python -m align.precompute --model stable-diffusion-v1-5/stable-diffusion-v1-5 \
        --dataset yuvalkirstain/pickapic_v2 --output latents/pickapic_512 --resolution 512

Writes sharded safetensors files and a manifest (align.data.latent_store). Interrupted? Run the same
command again: finished shards are kept and skipped. A folder holding another build, a dataset
without the Pick-a-Pic columns or an unreadable image (named by its row) stop with one line, exit 2,
and nothing already written is touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from align.cli import die, die_if_disk_full, option, parse_config
from align.data.latent_store import (
    DTYPES,
    StoreSpec,
    build_store,
    model_fingerprint,
    native_resolution,
    prepare_store,
)
from align.data.pair_stream import open_pairs
from align.data.pairs import DataError, check_pair_file
from align.declared import BATCH, COUNT, DEVICE, RESOLUTION
from align.pipeline import ModelLoadError, check_model, load_pipeline


@dataclass
class PrecomputeConfig:
    model: str = option(help="hub id, local pipeline folder, or 'testbed' (required)", group="model", path="folder",
                        or_name=True)
    dataset: str = option(help="Pick-a-Pic-schema parquet file/folder, save_to_disk folder or hub id (required)",
                          group="data", path="any", or_name=True, formats=(".parquet",), reads=check_pair_file)
    output: str = option(help="the store folder (new, empty, or an interrupted build of the same arguments; required)",
                         group="output", path="output")
    resolution: int | None = option(None, "training resolution in pixels (default: the model's own)", "data",
                                    within=RESOLUTION)
    dataset_split: str = option("train", "split of --dataset", "data")
    max_pairs: int | None = option(None, "cap on the pairs stored (None: all)", "data", within=COUNT)
    shard_size: int = option(1024, "pairs per shard file", "output", within="[1, 1048576]")
    batch_size: int = option(8, "pairs per VAE call", "model", within=BATCH)
    dtype: str = option("float16", "stored precision (float32: bitwise the trainer's own)", "output",
                        choices=tuple(DTYPES))
    device: str | None = option(None, "default: cuda if available, else cpu", "model", pattern=DEVICE)


def parse_args(argv: list[str] | None = None) -> PrecomputeConfig:
    """The command's flags (align.cli.parse_config: one line and exit 2 for a bad one, checked from the
    declarations above)."""
    return parse_config(PrecomputeConfig, argv, description=__doc__)


def precompute(args: PrecomputeConfig, after_shard=None) -> Path:
    """Check everything cheap first (model folder, dataset columns, the output folder), then encode."""
    import torch  # noqa: PLC0415 - --help stays torch-free

    try:
        check_model(args.model)
    except ModelLoadError as err:
        raise DataError(str(err)) from None
    table = open_pairs(args.dataset, split=args.dataset_split, max_pairs=args.max_pairs)
    print(f"[data] {table.stats.summary()}", flush=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pipe = None
    try:
        model_fp = model_fingerprint(args.model)
    except DataError:  # a hub id not downloaded yet: load it, then its files are in the cache
        pipe = load_pipeline(args.model, device=device)
        model_fp = model_fingerprint(args.model)
    resolution = args.resolution or native_resolution(args.model)
    spec = StoreSpec(model_fp, resolution, table.fingerprint, len(table), args.shard_size, args.dtype)
    prepare_store(args.output, spec)  # refuses another build before the model loads
    if pipe is None:
        pipe = load_pipeline(args.model, device=device)
    build_store(pipe, table, args.output, spec, batch_size=args.batch_size, after_shard=after_shard)
    print(f"[latents] {len(table):,} pairs at {resolution} px in {spec.num_shards} shards: {args.output}", flush=True)
    return Path(args.output)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        precompute(args)
    except DataError as err:
        die(str(err))
    except OSError as err:  # a full disk: one line
        die_if_disk_full(err)


if __name__ == "__main__":
    main()
