"""Load Stable Diffusion pipelines, attach LoRA, give a reference model, save in diffusers formats."""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import torch
import yaml

from align.families import UnknownFamilyError, check_pipeline_folder, family_of, family_of_pipeline
from align.families.base import LORA_WEIGHTS, ModelLoadError, dtype_argument, one_line
from align.families.sd import StableDiffusion
from align.progress import progress_bar
from align.run_folder import CONFIG_FILE
from align.testbed.edit_models import edit_testbed_pipeline_dir
from align.testbed.weights import (
    FLOW_TESTBED_SETTINGS_FILE,
    TESTBED_SETTINGS_FILE,
    MissingTestbedWeightsError,
    flow_testbed_pipeline_dir,
    testbed_pipeline_dir,
)
from align.validation import check_range

DENOISER_FOLDERS = ("unet", "transformer")  # a fully fine-tuned denoiser's folder, by family
DEFAULT_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


def resolve_model(model: str) -> str:
    """'testbed' / 'testbed-flow' / 'testbed-edit' -> the bundled shapes-testbed pipelines (SD v1.5 / SD3 / FLUX.1
    Kontext architecture); hub ids and local folders pass through."""
    bundled = {"testbed": testbed_pipeline_dir, "testbed-flow": flow_testbed_pipeline_dir,
               "testbed-edit": edit_testbed_pipeline_dir}
    if model in bundled:
        try:
            return str(bundled[model]())
        except MissingTestbedWeightsError as err:
            raise ModelLoadError(str(err)) from None
    return model


def check_model(model: str) -> str:
    """Cheap check before expensive work: a local path must be a diffusers pipeline folder."""
    resolved = resolve_model(model)
    path = Path(resolved).expanduser()
    looks_local = path.exists() or resolved.startswith((".", "/", "~")) or resolved.count("/") > 1
    if looks_local:
        if not path.is_dir():
            raise ModelLoadError(f"--model {model!r}: no such folder")
        if not (path / "model_index.json").is_file():
            raise ModelLoadError(
                f"--model {model!r} is not a diffusers pipeline folder (no model_index.json); "
                "give a hub id such as stable-diffusion-v1-5/stable-diffusion-v1-5, a folder saved with "
                "save_pretrained, or 'testbed' / 'testbed-flow'"
            )
        try:
            check_pipeline_folder(path)
        except UnknownFamilyError as err:
            raise ModelLoadError(f"--model {model!r}: {one_line(err)}") from None
    return resolved


def check_sampling_steps(model: str, steps: int | None, name: str = "num_inference_steps") -> None:
    """``steps`` sampling steps fit the model's scheduler (at most its num_train_timesteps; a local folder's
    scheduler config is read, a hub id is left to the scheduler)."""
    if steps is None:
        return
    check_range(name, steps, 1)
    config = Path(resolve_model(model)).expanduser() / "scheduler" / "scheduler_config.json"
    try:
        limit = int(json.loads(config.read_text()).get("num_train_timesteps", 1000))
    except (OSError, ValueError, TypeError, AttributeError):
        limit = 1000
    if steps > limit:
        raise ModelLoadError(f"--{name} {steps} is more than the scheduler's {limit} training timesteps; give at most {limit}")


def load_pipeline(model: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", quantization=None):
    """The model family's pipeline (``align.families``: SD 1.x/2.x with a DDIM scheduler, ...), safety
    checker off, progress bars off, on ``device``; ``quantization``: the components loaded quantized (diffusers'
    ``PipelineQuantizationConfig``: align/train/quantization.py)."""
    resolved = check_model(model)
    try:
        family = family_of(resolved)
    except (UnknownFamilyError, OSError, ValueError) as err:
        raise ModelLoadError(f"--model {model!r}: {one_line(err)}") from None
    if quantization is None:
        return family.load_pipeline(resolved, dtype, device)
    return family.load_pipeline(resolved, dtype, device, quantization=quantization)


def testbed_settings(model: str) -> dict:
    """Inference defaults stored beside a testbed pipeline (steps, guidance, resolution), if any
    (the flow testbed's file also holds its max_sequence_length)."""
    for name in (TESTBED_SETTINGS_FILE, FLOW_TESTBED_SETTINGS_FILE):
        path = Path(resolve_model(model)) / name
        if path.is_file():
            return json.loads(path.read_text())
    return {}


def add_lora(unet, rank: int = 4, alpha: float | None = None, target_modules=DEFAULT_LORA_TARGETS, dropout: float = 0.0):
    """Attach a PEFT LoRA adapter ("default") to the UNet; only its weights train."""
    from peft import LoraConfig

    unet.requires_grad_(False)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else rank,
        lora_dropout=dropout,
        init_lora_weights="gaussian",
        target_modules=list(target_modules),
    )
    unet.add_adapter(config)
    return unet


@contextlib.contextmanager
def disabled_adapter(unet):
    """The LoRA reference model: the same UNet with its adapter switched off (one UNet in memory)."""
    unet.disable_adapters()
    try:
        yield unet
    finally:
        unet.enable_adapters()


@contextlib.contextmanager
def merged_adapter(unet):
    """Inference with each LoRA update folded into its base weight: one matmul per adapted layer
    instead of three, the same outputs up to float rounding. Gradients do not reach the adapter
    inside. On exit the original weight tensors are put back as they were (restored, not
    un-merged by subtraction, which would drift over many merges)."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in unet.modules() if isinstance(m, LoraLayer)]
    if (not layers or any(any(m.use_dora.get(a, False) for a in m.active_adapters) for m in layers)
            or any(is_quantized(m.get_base_layer().weight) for m in layers)):
        yield unet  # nothing to merge, DoRA (its update is not a plain additive delta), or a quantized base
        return
    originals = []
    try:
        with torch.no_grad():
            for layer in layers:
                base = layer.get_base_layer()
                delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
                originals.append((base, base.weight.data))
                base.weight.data = base.weight.data + delta.to(base.weight.dtype)
        with disabled_adapter(unet):
            yield unet
    finally:
        for base, weight in originals:
            base.weight.data = weight


def is_quantized(weight: torch.Tensor) -> bool:
    """A weight loaded quantized (a torchao tensor, a bitsandbytes 4-bit parameter: a subclass of its own) rather than a
    plain tensor: nothing is folded into it and it is not cast."""
    return type(weight) not in (torch.nn.Parameter, torch.Tensor)


def cast_frozen(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """A loaded frozen part (a text encoder, a VAE) in ``dtype``, as ``from_pretrained(torch_dtype=dtype)`` would
    load it: the modules its class keeps in fp32 (``_keep_in_fp32_modules``, e.g. T5's ``wo``) stay in fp32, and
    quantized weights stay as they were loaded."""
    if dtype == torch.float32:
        return
    keep = set(getattr(module, "_keep_in_fp32_modules", None) or ())
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if tensor.is_floating_point() and not keep & set(name.split(".")) and not is_quantized(tensor):
                tensor.data = tensor.data.to(dtype)


def frozen_copy(unet):
    """The full fine-tuning reference model: a frozen copy of the starting UNet."""
    reference = copy.deepcopy(unet)
    reference.requires_grad_(False)
    reference.eval()
    return reference


def save_lora(unet, folder: str | Path, family=None) -> Path:
    """Write ``folder/pytorch_lora_weights.safetensors`` loadable by ``pipe.load_lora_weights(folder)`` of the
    denoiser's family (SD 1.x/2.x unless ``family`` says otherwise)."""
    return (family or StableDiffusion()).save_lora(unet, folder)


def save_full_unet(unet, folder: str | Path, family=None) -> Path:
    """Write a diffusers ``folder/unet/`` (or ``transformer/``, the family's denoiser folder; safetensors)
    for a fully fine-tuned denoiser."""
    target = Path(folder) / (family or StableDiffusion()).denoiser_name
    unet.save_pretrained(target, safe_serialization=True)
    return target


def run_base_model(path: str) -> str | None:
    """The pipeline a run folder was trained from (``model`` in its config.yaml), if it names one."""
    config_file = Path(path).expanduser() / CONFIG_FILE
    if not config_file.is_file():
        return None
    model = (yaml.safe_load(config_file.read_text()) or {}).get("model")
    return model if isinstance(model, str) else None


def base_of(path: str) -> str:
    """The pipeline a run folder was trained from, else ``path`` itself."""
    return run_base_model(path) or path


def load_trained(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", base: str | None = None):
    """A pipeline from a run folder, a LoRA folder, a full-UNet folder, or a pipeline/hub id.

    A run folder's config.yaml names its base model; ``base`` overrides it (needed for bare LoRA folders).
    """
    p = Path(path).expanduser()
    if p.is_dir() and (p / CONFIG_FILE).is_file() and (p / "final").is_dir():  # a run folder
        base = base or run_base_model(path)
        p = p / "final"
    if p.is_dir() and (p / LORA_WEIGHTS).is_file():
        if not base:
            raise ModelLoadError(f"{path}: a LoRA folder needs the base model (base=...)")
        pipe = load_pipeline(base, dtype=dtype, device=device)
        family = family_of_pipeline(pipe)
        try:
            family.load_lora(pipe, p)
        except Exception as err:  # safetensors' own error type for a truncated file is not an OSError
            raise ModelLoadError(f"cannot load the LoRA weights {p / LORA_WEIGHTS}: {one_line(err)}") from None
        if not getattr(family.denoiser(pipe), "peft_config", None):  # diffusers only warns when no key matches
            raise ModelLoadError(f"{p / LORA_WEIGHTS} holds no LoRA weights for the {family.denoiser_name} of {base!r} "
                                 f"(a {family.name} pipeline): a LoRA of another model family? give its base model")
        return pipe
    denoiser_folder = next((p / name for name in DENOISER_FOLDERS if (p / name / "config.json").is_file()), None)
    if p.is_dir() and denoiser_folder is not None and not (p / "model_index.json").is_file():
        if not base:
            raise ModelLoadError(f"{path}: a {denoiser_folder.name} folder needs the base model (base=...)")
        pipe = load_pipeline(base, dtype=dtype, device=device)
        family = family_of_pipeline(pipe)
        if denoiser_folder.name != family.denoiser_name:
            raise ModelLoadError(f"{denoiser_folder} does not fit {base!r}, whose denoiser is its {family.denoiser_name}/")
        denoiser_class = type(family.denoiser(pipe))
        try:
            setattr(pipe, family.denoiser_name, denoiser_class.from_pretrained(denoiser_folder, **dtype_argument(dtype)).to(device))
        except Exception as err:
            raise ModelLoadError(f"cannot load the {denoiser_folder.name} in {denoiser_folder}: {one_line(err)}") from None
        return pipe
    return load_pipeline(path, dtype=dtype, device=device)


def encode_prompts(pipe, prompts: list[str]) -> torch.Tensor:
    """Text-encoder hidden states [N, L, D] of the prompts (SD 1.x/2.x's whole conditioning; other
    families have more: ask ``align.families`` for it)."""
    return family_of_pipeline(pipe).encode_prompts(pipe, prompts)["prompt_embeds"]


def encode_images(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """Denoiser-space VAE latents (posterior mean, scaled) of pixels in [-1, 1]."""
    return family_of_pipeline(pipe).encode_images(pipe, pixels)


def decode_latents(pipe, latents: torch.Tensor) -> torch.Tensor:
    """Images [N, 3, H, W] in [0, 1] from denoiser-space latents."""
    return family_of_pipeline(pipe).decode_latents(pipe, latents)


@torch.no_grad()
def generate_images(
    pipe,
    prompts: list[str],
    seeds: list[int],
    num_inference_steps: int = 50,
    guidance_scale: float = 7.5,
    height: int | None = None,
    width: int | None = None,
    batch_size: int = 8,
    progress: str | None = None,
) -> torch.Tensor:
    """Images [N, 3, H, W] in [0, 1]; image i depends only on (prompt i, seed i), not on batching.
    ``progress``: the label of a progress bar over the batches (none without it)."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    family = family_of_pipeline(pipe)
    if family.edits and height is None and width is None:  # the size the family resizes the sources to (else the
        height = width = family.native_resolution(pipe)    # editing pipeline warns that it adjusted its default size)
    out = []
    for start in progress_bar(range(0, len(prompts), batch_size), desc=progress, unit="batch", enabled=progress is not None):
        chunk = slice(start, start + batch_size)
        generators = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds[chunk]]
        result = pipe(
            generator=generators,
            num_inference_steps=num_inference_steps,
            height=height,
            width=width,
            output_type="pt",
            **family.call_arguments(pipe, list(prompts[chunk]), guidance_scale, height),  # the prompts and their guidance
        )
        out.append(result.images[:, :3].float().cpu())  # Qwen-Image 2.1's pipeline returns RGBA; judges read RGB
    return torch.cat(out) if out else torch.empty(0, 3, 1, 1)
