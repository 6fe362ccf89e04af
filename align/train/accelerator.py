"""The Accelerator the trainers run under: mixed precision as the launcher says, the distributed modes
the trainers support (DDP and FSDP2; others refused in one line), TF32, the optimiser class, and a clean end."""

from __future__ import annotations

import gc
import os
from dataclasses import asdict

import torch

from align.cli import ConfigError
from align.run_folder import (
    scrub_secrets,
)
from align.train.sharding import check_fsdp_launch, enable_fsdp_on_cpu, fsdp_launch, is_sharded

PRECISIONS = ("no", "fp16", "bf16")


def resolve_mixed_precision(flag: str | None, environ=None) -> str:
    """The mixed precision a run uses: --mixed_precision if given, else what `accelerate launch` (its flag or
    its config file) put in ACCELERATE_MIXED_PRECISION, else "no"."""
    environ = os.environ if environ is None else environ
    if flag is not None:
        source, value = "--mixed_precision", flag
    else:
        source, value = "ACCELERATE_MIXED_PRECISION (accelerate launch / its config file)", environ.get("ACCELERATE_MIXED_PRECISION", "no")
    value = str(value).lower()
    if value not in PRECISIONS:
        raise ConfigError(f"{source} is {value!r}; the trainers run {', '.join(PRECISIONS)}")
    return value


UNSUPPORTED_LAUNCHERS = {
    "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM",
}


DISTRIBUTED_HELP = ("what works: one process, multi-process data parallel (DDP), e.g. "
                    "`accelerate launch --multi_gpu --num_processes 8 align/<trainer>.py ...`, or sharded FSDP2, "
                    "`accelerate launch --config_file configs/accelerate/fsdp2_bf16.yaml ...` (docs/scale.md)")


def refuse_unsupported_launch(environ=None, shardable: bool = True) -> None:
    """Before the Accelerator is built: DeepSpeed and Megatron-LM are not tested here, so refuse them; FSDP only
    as FSDP2 (align/train/sharding.py), and only for the trainers that shard (``shardable``)."""
    environ = os.environ if environ is None else environ
    if not shardable and fsdp_launch(environ):
        raise ConfigError("FSDP is not supported by this trainer (ACCELERATE_USE_FSDP is set by the launcher); it trains "
                          "with one process or data parallel (DDP); FSDP2 shards the diffusion trainers (docs/scale.md)")
    for variable, name in UNSUPPORTED_LAUNCHERS.items():
        if str(environ.get(variable, "")).lower() in ("1", "true", "yes"):
            raise ConfigError(f"{name} is not supported by this trainer ({variable} is set by the launcher); {DISTRIBUTED_HELP}")
    check_fsdp_launch(environ)
    if cpu_launch_lost_its_processes(environ):
        raise ConfigError(
            "`accelerate launch --cpu --num_processes N` starts one process whatever N says (accelerate runs --cpu "
            "alone), so this would train one process with N times fewer pairs per step; for N CPU processes use "
            "`ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes N align/<trainer>.py ...`, for one "
            "leave out --num_processes (docs/training.md#multi-process-and-multi-gpu)")


# Set in each process by torch's launcher (WORLD_SIZE, RANK) or by MPI: a process that has none of them is alone.
_WORLD_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_processes(environ=None) -> int:
    """The number of processes of this launch, as torch's launcher tells each one (WORLD_SIZE); 1 without one."""
    environ = os.environ if environ is None else environ
    try:
        return max(int(environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def cpu_launch_lost_its_processes(environ) -> bool:
    """accelerate's simple launcher (--cpu) starts the script once, and exports MASTER_ADDR only when more than
    one process was asked for: that trio without any world variable is a multi-process CPU launch run alone."""
    return (str(environ.get("ACCELERATE_USE_CPU", "")).lower() in ("1", "true", "yes") and "MASTER_ADDR" in environ
            and not any(v in environ for v in _WORLD_VARIABLES))


def refuse_unsupported_distribution(accelerator) -> None:
    """After the Accelerator is built (a plugin passed some other way): only no distribution, DDP or FSDP2."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind == "FSDP" and accelerator.is_fsdp2:
        return
    if kind not in ("NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA", "MULTI_HPU"):
        raise ConfigError(f"accelerate's distributed type {kind} is not supported by this trainer; {DISTRIBUTED_HELP}")


def make_accelerator(flag_precision: str | None, label: str, shardable: bool = False, **kwargs):
    """An Accelerator with the resolved mixed precision, refusing the untested distributed modes (FSDP2 where the
    trainer ``shardable``); logs the precision and the sharding."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    refuse_unsupported_launch(shardable=shardable)
    precision = resolve_mixed_precision(flag_precision)
    if AcceleratorState._shared_state and AcceleratorState().mixed_precision != precision:
        # A second train() in one Python process (a notebook, the tests) with another precision: accelerate keeps
        # its state process-wide and would refuse; reset the precision part, not the process group.
        AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(mixed_precision=precision, **kwargs)
    enable_fsdp_on_cpu(accelerator)
    refuse_unsupported_distribution(accelerator)
    if accelerator.is_main_process:
        source = "--mixed_precision" if flag_precision is not None else "accelerate's setting"
        scaler = " with accelerate's gradient scaler" if getattr(accelerator, "scaler", None) is not None else ""
        print(f"[{label}] mixed precision: {precision} (from {source}){scaler}", flush=True)
        if is_sharded(accelerator):
            print(f"[{label}] FSDP2: the trained model, its gradients and optimiser states sharded over "
                  f"{accelerator.num_processes} processes", flush=True)
    return accelerator, precision


def apply_matmul_switches(allow_tf32: bool) -> None:
    """--allow_tf32: TF32 tensor cores for fp32 matmuls and convolutions on Ampere and newer GPUs (as diffusers' scripts)."""
    if allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def adamw_class(use_8bit_adam: bool):
    """torch's AdamW, or bitsandbytes' 8-bit AdamW (refused in one line when bitsandbytes is missing)."""
    if not use_8bit_adam:
        return torch.optim.AdamW
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise ConfigError("--use_8bit_adam needs bitsandbytes, which is not installed (pip install bitsandbytes)") from None
    return bnb.optim.AdamW8bit


def tracker_config(config) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in scrub_secrets(asdict(config)).items()}


def end_training(accelerator) -> None:
    """Close the trackers and the process group once accelerate has let go of the prepared objects.

    A DDP model freed after its process group is destroyed tears the group down from its own
    destructor, and under gloo that hung about every other 2-process CPU run at exit (the destructor,
    run from Python, waits on gloo's loop thread for ever). Callers drop their own references to the
    prepared model, optimiser and scheduler before calling this.
    """
    accelerator.free_memory()
    gc.collect()  # DDP's hooks keep the wrapper in reference cycles
    accelerator.end_training()
