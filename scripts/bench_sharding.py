"""Memory of sharded full fine-tuning: what each process holds in parameters, gradients and optimiser states under
DDP and under FSDP2, measured with 1, 2 (and 4) CPU processes over gloo, next to the memory planner's estimate.

    python scripts/bench_sharding.py                          # the tiny SD UNet, 1 and 2 processes
    python scripts/bench_sharding.py --max-processes 4 --width 4

Each process trains the same UNet (SD v1.5's block types; --width multiplies its channels) with full fine-tuning and
AdamW for --steps steps: DDP wraps it whole; FSDP2 applies torch.distributed.fsdp.fully_shard to each transformer
and resnet block (the trainers' units, ModelFamily.shard_blocks) and then the root, reshard_after_forward=True.
Bytes held are the sums of the LOCAL tensors (a DTensor's shard, ``to_local()``), taken after each optimiser step while the gradients are still held (the step's peak of
these three); DDP's gradient buckets and FSDP2's transient all-gathers are not tensors of these three and are not
counted here (the planner's table shows them). The planner's column is align/train/memory_plan.py's parameters +
gradients + optimiser states for the same counts. Target: at 2 processes FSDP2 holds at most 0.6x of DDP's.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import UNet2DConditionModel
from torch.distributed.fsdp import fully_shard

from align.families.sd import StableDiffusion
from align.train.memory_plan import RunShape, ddp_plan, fsdp2_plan
from align.train.sharding import block_units

HELD_PARTS = ("trained parameters (fp32)", "gradients", "optimizer states")
TARGET_RATIO = 0.6


def build_unet(width: int):
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(16 * width, 32 * width), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16 * width, attention_head_dim=4,
        norm_num_groups=8,
    )


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def held(model, optimizer) -> dict[str, int]:
    params = list(model.parameters())
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params if p.grad is not None),
            "states": local_bytes(states)}


def worker(rank: int, world: int, strategy: str, width: int, steps: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    unet = build_unet(width)
    if strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(unet) if world > 1 else unet
    else:
        for block in block_units(unet, StableDiffusion.shard_blocks):  # the trainers' units
            fully_shard(block, reshard_after_forward=True)
        model = fully_shard(unet, reshard_after_forward=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    peak: dict[str, int] = {}
    for _ in range(steps):
        latents = torch.randn(2, 4, 8, 8, generator=generator)
        text = torch.randn(2, 8, 16 * width, generator=generator)
        timesteps = torch.randint(0, 1000, (2,), generator=generator)
        model(latents, timesteps, encoder_hidden_states=text).sample.square().mean().backward()
        optimizer.step()
        now = held(model, optimizer)
        if sum(now.values()) > sum(peak.values()):
            peak = now
        optimizer.zero_grad(set_to_none=True)
    results.put((strategy, world, rank, peak))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def planned_held(parameters: int, strategy: str, world: int) -> int:
    shape = RunShape(denoiser_params=parameters, trained_params=parameters, frozen_denoiser_bytes=4, other_params=0,
                     other_bytes=4, optimizer_bytes=8, reference_copies=0, old_policy_copies=0, compute_bytes=4,
                     largest_unit_params=0, root_params=0, activation_bytes=0)
    plan = ddp_plan(shape, world) if strategy == "ddp" else fsdp2_plan(shape, world)
    return sum(plan[part] for part in HELD_PARTS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-processes", type=int, default=2, help="1, 2, then 4 ... up to this many processes")
    parser.add_argument("--width", type=int, default=1, help="multiplies the UNet's channels (1: the tiny test UNet)")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    parameters = sum(p.numel() for p in build_unet(args.width).parameters())
    worlds = [n for n in (1, 2, 4, 8, 16) if n <= args.max_processes]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    measured: dict[tuple[str, int], dict[str, int]] = {}
    for world in worlds:
        for strategy in ("ddp", "fsdp2"):
            mp.start_processes(worker, args=(world, strategy, args.width, args.steps, free_port(), results),
                               nprocs=world, start_method="spawn")
            for _ in range(world):
                name, n, rank, peak = results.get()
                # Per process: the largest any rank held (FSDP2's shards differ by their padding).
                if sum(peak.values()) >= sum(measured.get((name, n), {"": -1}).values()):
                    measured[(name, n)] = peak
    print(f"UNet width {args.width}: {parameters:,} parameters, full fine-tuning, AdamW, {args.steps} steps; bytes held "
          "per process (the largest rank) after the optimiser step, in KiB")
    header = f"{'N':>2} {'strategy':<8} {'params':>9} {'grads':>9} {'AdamW':>9} {'peak':>9} {'planned':>9} {'FSDP2/DDP':>10}"
    print(header)
    for world in worlds:
        ddp_peak = sum(measured[("ddp", world)].values())
        for strategy in ("ddp", "fsdp2"):
            parts = measured[(strategy, world)]
            peak = sum(parts.values())
            ratio = f"{peak / ddp_peak:.3f}" if strategy == "fsdp2" else ""
            print(f"{world:>2} {strategy:<8} {parts['params'] / 1024:>9.1f} {parts['grads'] / 1024:>9.1f} "
                  f"{parts['states'] / 1024:>9.1f} {peak / 1024:>9.1f} {planned_held(parameters, strategy, world) / 1024:>9.1f} "
                  f"{ratio:>10}")
    if 2 in worlds:
        ratio = sum(measured[("fsdp2", 2)].values()) / sum(measured[("ddp", 2)].values())
        print(f"target at 2 processes: FSDP2 / DDP <= {TARGET_RATIO}: {ratio:.3f} "
              f"({'met' if ratio <= TARGET_RATIO else 'NOT met'})")


if __name__ == "__main__":
    main()
