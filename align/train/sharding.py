"""Sharded training with FSDP2 (torch's ``fully_shard``) through accelerate's plugin (``fsdp_version: 2``).

accelerate shards the trained denoiser when it is prepared: one FSDP unit per block of the family
(``ModelFamily.shard_blocks``: the UNet's transformer and resnet blocks, the transformers' blocks) and one for the rest. This
file holds what the trainers add around that:

- the launch checks (FSDP2 only; activation checkpointing through the trainers' --gradient_checkpointing);
- CPU processes: accelerate 1.16 turns FSDP on only for accelerator devices, while FSDP2 itself trains over gloo,
  so a CPU launch (the tests, a laptop) gets the same plugin the GPU path does (``enable_fsdp_on_cpu``);
- the pipeline loaded on the CPU and the frozen text encoders and VAE moved to the device, so that the whole
  denoiser never sits on an accelerator (``pipeline_device``, ``place_frozen_parts``);
- frozen copies (Diffusion-DPO's full-fine-tuning reference, the online-RL KL reference) sharded like the policy,
  never held whole on every process (``shard_frozen``);
- the main process's own inference (held-out evaluation, AI feedback): every process all-gathers the weights once,
  the main one generates alone, then each drops the gathered copy (``full_weights_for_main``);
- the final weights: gathered from the shards into an unsharded copy of the model on the main process, which is
  saved as before (``consolidated_model``);
- agreement across processes where each holds a shard (finite weights).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.tensor import DTensor

from align.cli import ConfigError

TRUE = ("1", "true", "yes")


def fsdp_launch(environ=None) -> bool:
    """Whether the launcher asked for FSDP (``accelerate launch --use_fsdp`` or a config file's ``distributed_type:
    FSDP``)."""
    environ = os.environ if environ is None else environ
    return str(environ.get("ACCELERATE_USE_FSDP", "")).lower() in TRUE


def check_fsdp_launch(environ=None) -> None:
    """FSDP2 only, and activation checkpointing through the trainers' flag (one line each, before any model loads)."""
    environ = os.environ if environ is None else environ
    if not fsdp_launch(environ):
        return
    version = str(environ.get("FSDP_VERSION", "1"))
    if version != "2":
        raise ConfigError(f"FSDP version {version} (FSDP_VERSION, from the launcher's fsdp_version) is not supported; "
                          "the trainers shard with FSDP2: set fsdp_version: 2 (configs/accelerate/fsdp2_bf16.yaml)")
    if str(environ.get("FSDP_ACTIVATION_CHECKPOINTING", "")).lower() in TRUE:
        raise ConfigError("fsdp_activation_checkpointing is not used by the trainers: set it to false and pass "
                          "--gradient_checkpointing true (diffusers' own, per block; docs/scale.md)")


def enable_fsdp_on_cpu(accelerator) -> None:
    """A multi-process CPU launch that asked for FSDP2 runs it (accelerate 1.16 leaves such a launch as plain
    multi-CPU data parallel; torch's FSDP2 itself runs over gloo). The plugin is built from the launcher's settings
    as accelerate builds it on GPUs."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if not fsdp_launch() or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables the launcher set
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def is_sharded(accelerator) -> bool:
    """Whether the trained model is sharded over the processes (FSDP2 with more than one process)."""
    return bool(getattr(accelerator, "is_fsdp2", False)) and accelerator.num_processes > 1


def pipeline_device(accelerator):
    """Where the pipeline loads: under FSDP2 on the CPU, so that no process holds the whole denoiser (and its frozen
    copy) on its accelerator before sharding moves each process's shards there; else the run's device."""
    return "cpu" if is_sharded(accelerator) else accelerator.device


def place_frozen_parts(accelerator, family, pipe) -> None:
    """Under FSDP2 the text encoders and VAE (not sharded: every process runs them whole) go to the run's device."""
    if is_sharded(accelerator):
        for module in family.frozen_modules(pipe):
            module.to(accelerator.device)


def use_family_blocks(accelerator, family, denoiser) -> None:
    """One FSDP unit per block of the family (those this model has), and sharded checkpoints (each process writes
    its shard: exact resume without gathering, and on another number of processes, torch.distributed.checkpoint
    re-shards on load), gradients reduced in fp32 under mixed precision. A launcher that names its own classes
    (fsdp_transformer_layer_cls_to_wrap) keeps them."""
    if not is_sharded(accelerator):
        return
    plugin = accelerator.state.fsdp_plugin
    if not os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
        present = {type(m).__name__ for m in denoiser.modules()}
        plugin.auto_wrap_policy = transformer_auto_wrap_policy
        plugin.transformer_cls_names_to_wrap = [name for name in family.shard_blocks if name in present]
    plugin.set_state_dict_type("SHARDED_STATE_DICT")
    policy = plugin.mixed_precision_policy
    if isinstance(policy, MixedPrecisionPolicy) and policy.reduce_dtype in (torch.bfloat16, torch.float16):
        # accelerate reduces gradients in the compute dtype; torch's FSDP2 guidance (and DDP here, which all-reduces
        # the fp32 gradients of fp32 weights) reduce in fp32
        plugin.mixed_precision_policy = dataclasses.replace(policy, reduce_dtype=torch.float32)


def block_units(model, class_names) -> list[torch.nn.Module]:
    names = set(class_names)
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_frozen(accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy (a reference model) sharded with the policy's units and mixed precision; no optimiser, no
    checkpoint (it is the starting model, rebuilt on resume). Unsharded runs get it back as it is."""
    if not is_sharded(accelerator):
        return model
    plugin = accelerator.state.fsdp_plugin
    kwargs = {"reshard_after_forward": True, "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy()}
    for unit in block_units(model, plugin.transformer_cls_names_to_wrap or ()):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def fsdp_units(model) -> list:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def full_weights_for_main(accelerator, model, needed: bool = True):
    """Every process enters; yields whether this process does the work (``needed`` and it is the main one). Sharded,
    the weights are all-gathered once and kept whole until the block ends, so that the main process can run the
    model alone (held-out evaluation, AI feedback) while the others wait for it; the gathered copy is dropped on
    exit. Unsharded runs (and ``needed`` false) gather nothing."""
    runs_here = needed and accelerator.is_main_process
    if not (needed and is_sharded(accelerator)):
        yield runs_here
        return
    units = fsdp_units(model)
    resharding = bool(accelerator.state.fsdp_plugin.reshard_after_forward)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield runs_here
    finally:
        for unit in units:
            unit.reshard()
            # back as they were: the launcher's setting, and the root kept gathered from its forward to its backward
            # (torch's own choice for the root)
            unit.set_reshard_after_forward(resharding and unit is not model, recurse=False)
        accelerator.wait_for_everyone()


def unsharded_class(model) -> type:
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def consolidated_model(accelerator, model):
    """The trained model as one unsharded module on the main process (None on the others), for saving; every process
    must call it. Unsharded runs get the unwrapped model itself.

    The shards are gathered into a full state dict on the main process's CPU (torch.distributed.checkpoint's
    ``get_model_state_dict``, fp32 as trained) and loaded into a fresh module of the same class and config, with
    the same LoRA adapter where there is one."""
    if not is_sharded(accelerator):
        return accelerator.unwrap_model(model)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not accelerator.is_main_process:
        return None
    plain = unsharded_class(model).from_config(model.config)
    peft_config = getattr(model, "peft_config", None)
    if peft_config:
        for name, adapter in peft_config.items():
            plain.add_adapter(adapter, adapter_name=name)
    plain.load_state_dict(state, strict=True)
    return plain


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded tensor (a DTensor), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def all_processes_agree(accelerator, flag: bool) -> bool:
    """Whether ``flag`` holds on every process (each checks its own shard)."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(value, "sum") == accelerator.num_processes)
