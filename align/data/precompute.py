"""Encode preference pairs once into a latent store that `align/dpo.py --latent_store` trains from.

    python -m align.precompute --model stable-diffusion-v1-5/stable-diffusion-v1-5 \
        --dataset yuvalkirstain/pickapic_v2 --output latents/pickapic_512 --resolution 512

Writes sharded safetensors files and a manifest (align.data.latent_store). Interrupted? Run the same
command again: finished shards are kept and skipped. A folder holding another build, a dataset
without the Pick-a-Pic columns or an unreadable image (named by its row) stop with one line, exit 2,
and nothing already written is touched.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from align.cli import die, die_if_disk_full
from align.data.latent_store import (
    DTYPES,
    StoreSpec,
    build_store,
    model_fingerprint,
    native_resolution,
    prepare_store,
)
from align.data.pair_stream import open_pairs
from align.data.pairs import DataError
from align.pipeline import ModelLoadError, check_model, load_pipeline
from align.validation import SIZE_LIMITS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m align.precompute", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="hub id, local pipeline folder, or 'testbed'")
    parser.add_argument("--dataset", required=True, help="Pick-a-Pic-schema parquet file/folder, save_to_disk folder or hub id")
    parser.add_argument("--output", required=True, help="the store folder (new, empty, or an interrupted build of the same arguments)")
    parser.add_argument("--resolution", type=int, default=None, help="training resolution in pixels (default: the model's own)")
    parser.add_argument("--dataset_split", default="train")
    parser.add_argument("--max_pairs", type=int, default=None)
    parser.add_argument("--shard_size", type=int, default=1024, help="pairs per shard file")
    parser.add_argument("--batch_size", type=int, default=8, help="pairs per VAE call")
    parser.add_argument("--dtype", default="float16", choices=tuple(DTYPES), help="stored precision (float32: bitwise the trainer's own)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = parser.parse_args(argv)
    for name in ("shard_size", "batch_size"):
        if getattr(args, name) < 1:
            die(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.resolution is not None and not 8 <= args.resolution <= SIZE_LIMITS["resolution"]:
        die(f"--resolution must be in [8, {SIZE_LIMITS['resolution']}] pixels, got {args.resolution}")
    if not args.output.strip():
        die("--output is empty; give the store's folder")
    return args


def precompute(args: argparse.Namespace, after_shard=None) -> Path:
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
