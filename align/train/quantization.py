"""A quantized frozen base for LoRA training (--quantize_base, --quantize_text_encoders): the schemes, the
quantization configs diffusers and transformers load them with, and the backward that keeps no dequantized weight.

As diffusers' low-memory LoRA scripts do (train_dreambooth_lora_flux.py with a bitsandbytes config, the torchao
configs of its quantization docs): the frozen denoiser's (and, when asked, the text encoders') ``nn.Linear`` weights
load quantized through ``PipelineQuantizationConfig``; the LoRA weights and their optimiser states stay fp32; the
reference (the adapter off) runs through the same quantized weights. The VAE is never quantized (diffusers' scripts
leave it whole: it is small and convolutional).

One difference from running torchao's weight-only tensors as they come: under autograd their linear dequantizes the
weight and saves that full-precision copy for the backward, so a training forward would keep a dequantized copy of
every frozen weight (the saving gone). ``keep_dequantized_weights_out_of_autograd`` gives each quantized linear a
backward that dequantizes again instead, as bitsandbytes' 4-bit matmul does.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from importlib.metadata import version

import torch

from align.cli import ConfigError

TORCHAO_MIN_VERSION = (0, 15)  # diffusers' TorchAoConfig refuses older releases


@dataclass(frozen=True)
class Scheme:
    """One quantization of ``nn.Linear`` weights: the backend that loads it and what a weight costs."""

    name: str
    summary: str
    backend: str            # the package that quantizes: torchao or bitsandbytes
    weight_bits: float      # bits per quantized weight, its scales included (the planner's count)
    row_scale_bytes: int    # bytes per output row besides (torchao's per-row scale and zero point)
    needs_cuda: bool        # diffusers' bitsandbytes quantizer refuses to load without a GPU

    def config_object(self, library: str, compute_dtype: torch.dtype):
        """The quantization config ``library`` (diffusers or transformers) loads a component with."""
        if library == "diffusers":
            from diffusers import BitsAndBytesConfig, TorchAoConfig
        else:
            from transformers import BitsAndBytesConfig, TorchAoConfig
        if self.backend == "bitsandbytes":
            # diffusers' FLUX LoRA script's NF4: 4-bit NormalFloat, blocks of 64, computing in the training dtype
            return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

        return TorchAoConfig({"int8": Int8WeightOnlyConfig, "float8": Float8WeightOnlyConfig}[self.name]())


# bitsandbytes' NF4 without double quantization: 4 bits + one fp32 absmax per 64 weights (0.5 bit)
SCHEMES = {scheme.name: scheme for scheme in (
    Scheme("int8", "torchao int8 weight-only (per-row scale; any device)", "torchao", 8, 5, False),
    Scheme("float8", "torchao float8 (e4m3) weight-only (per-row scale)", "torchao", 8, 4, False),
    Scheme("nf4", "bitsandbytes 4-bit NormalFloat (QLoRA; a CUDA GPU)", "bitsandbytes", 4.5, 0, True),
)}
NONE = "none"
CHOICES = (NONE, *SCHEMES)


def choices_help() -> str:
    return "; ".join(f"{scheme.name}: {scheme.summary}" for scheme in SCHEMES.values())


def check_scheme_names(quantize_base: str, quantize_text_encoders: str, finetune: str) -> None:
    """The flags' values (config checks: no package needed, so --dry_run plans any scheme on any machine)."""
    for flag, value in (("quantize_base", quantize_base), ("quantize_text_encoders", quantize_text_encoders)):
        if value not in CHOICES:
            raise ConfigError(f"--{flag} must be one of {', '.join(CHOICES)}, got {value!r}")
    if quantize_base != NONE and finetune != "lora":
        raise ConfigError(f"--quantize_base {quantize_base} freezes the denoiser's weights in {quantize_base}, and "
                          f"--finetune {finetune} trains them: use --finetune lora, or --quantize_base none")


def torchao_version() -> tuple[int, ...] | None:
    if importlib.util.find_spec("torchao") is None:
        return None
    return tuple(int(part) for part in version("torchao").split(".")[:2] if part.isdigit())


def check_backends(quantize_base: str, quantize_text_encoders: str) -> None:
    """Before anything loads: the package of each scheme asked for is installed, and NF4 has its GPU."""
    for flag, value in (("quantize_base", quantize_base), ("quantize_text_encoders", quantize_text_encoders)):
        scheme = SCHEMES.get(value)
        if scheme is None:
            continue
        if scheme.backend == "torchao":
            found = torchao_version()
            if found is None or found < TORCHAO_MIN_VERSION:
                have = "not installed" if found is None else f"version {'.'.join(map(str, found))}"
                raise ConfigError(f"--{flag} {value} needs torchao >= 0.15 ({have}): pip install 't2i-align[quantization]'")
        elif importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(f"--{flag} {value} needs bitsandbytes, which is not installed (pip install bitsandbytes)")
        if scheme.needs_cuda and not torch.cuda.is_available():
            raise ConfigError(f"--{flag} {value} needs a CUDA GPU (diffusers' bitsandbytes quantizer loads on one); "
                              "on a CPU use int8 or float8")


def pipeline_quantization(quantize_base: str, quantize_text_encoders: str, denoiser_name: str,
                          text_encoder_names: list[str], compute_dtype: torch.dtype):
    """diffusers' ``PipelineQuantizationConfig`` for the pipeline's ``from_pretrained``: the denoiser through
    diffusers' config of the scheme, each text encoder through transformers' (None: nothing quantized)."""
    mapping = {}
    if quantize_base != NONE:
        mapping[denoiser_name] = SCHEMES[quantize_base].config_object("diffusers", compute_dtype)
    if quantize_text_encoders != NONE:
        for name in text_encoder_names:
            mapping[name] = SCHEMES[quantize_text_encoders].config_object("transformers", compute_dtype)
    if not mapping:
        return None
    from diffusers import PipelineQuantizationConfig

    return PipelineQuantizationConfig(quant_mapping=mapping)


def is_torchao_weight(weight) -> bool:
    if importlib.util.find_spec("torchao") is None:
        return False
    from torchao.utils import TorchAOBaseTensor

    return isinstance(weight, TorchAOBaseTensor)


class _FrozenQuantizedLinear(torch.autograd.Function):
    """``x @ W.T + b`` for a frozen quantized W: nothing saved but a reference to W; the backward dequantizes W again
    for the input's gradient (W and b get none)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.weight, ctx.input_dtype = weight, x.dtype
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        dequantized = ctx.weight.dequantize().to(grad_output.dtype)
        return grad_output.matmul(dequantized).to(ctx.input_dtype), None, None


def _frozen_quantized_forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled() or not x.requires_grad:
        return torch.nn.functional.linear(x, layer.weight, layer.bias)
    return _FrozenQuantizedLinear.apply(x, layer.weight, layer.bias)


def keep_dequantized_weights_out_of_autograd(model: torch.nn.Module) -> int:
    """Every ``nn.Linear`` of ``model`` with a torchao-quantized weight computes its input's gradient by dequantizing
    again in the backward instead of keeping the dequantized weight from the forward. Returns how many."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and is_torchao_weight(m.weight)]
    for layer in layers:
        layer.forward = functools.partial(_frozen_quantized_forward, layer)
    return len(layers)


def quantize_linear_weights(model: torch.nn.Module, scheme: str, dtype: torch.dtype) -> None:
    """A model built in memory (the GPU benchmark's random weights) quantized as diffusers' TorchAoConfig quantizes one
    at load: torchao's ``quantize_`` with the scheme's config on every ``nn.Linear`` weight."""
    from torchao.quantization import quantize_

    quantize_(model, SCHEMES[scheme].config_object("diffusers", dtype).quant_type)


def _floating_to(value, dtype: torch.dtype):
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def cast_inputs_to(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """A base loaded quantized in the compute dtype takes its floating inputs in that dtype (a forward pre-hook), as
    diffusers' scripts cast the latents and prompt embeddings to the weight dtype: Diffusion-DPO feeds float32 latents
    and embeddings (its frozen parts stay float32), which a bf16 base's normalisations refuse on a CPU."""
    if dtype == torch.float32:
        return

    def cast(module, args, kwargs):
        return tuple(_floating_to(a, dtype) for a in args), {k: _floating_to(v, dtype) for k, v in kwargs.items()}

    model.register_forward_pre_hook(cast, with_kwargs=True)
