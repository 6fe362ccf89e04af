"""--offload: the pipeline's text encoders and VAE wait on the CPU and visit the device one at a time, as diffusers'
LoRA scripts' ``--offload`` keeps them off the GPU between uses.

Each frozen part is moved to the run's device when it is called (its ``forward``; the VAE's ``encode`` and
``decode``), with its tensor arguments, and the part that was there before goes back; every part goes back when the
denoiser runs. So at most one of them is on the device at a time, and never while the denoiser holds its
activations. The callers (the families' encoders and decoders, the pipeline's own ``__call__``) run unchanged:
their outputs come back on the device as before.
"""

from __future__ import annotations

import functools

import torch

CALLED_METHODS = ("forward", "encode", "decode")  # a VAE is called through encode/decode, a text encoder's forward
HOME = "cpu"


class FrozenPartsOffload:
    """The frozen parts of one pipeline and which of them is on the device now (``on_device``, or None)."""

    def __init__(self, parts: list[torch.nn.Module], device):
        self.parts, self.device, self.on_device = parts, torch.device(device), None
        for part in parts:
            part.to(HOME)
            for name in CALLED_METHODS:
                if callable(getattr(part, name, None)):
                    setattr(part, name, self._bringing(part, getattr(part, name)))

    def bring(self, part: torch.nn.Module) -> None:
        if self.on_device is part:
            return
        self.send_back()
        part.to(self.device)
        self.on_device = part

    def send_back(self) -> None:
        if self.on_device is not None:
            self.on_device.to(HOME)
            self.on_device = None

    def _bringing(self, part: torch.nn.Module, method):
        @functools.wraps(method)
        def called(*args, **kwargs):
            self.bring(part)
            moved = [a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args]
            return method(*moved, **{k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

        return called

    def before_denoiser(self, module, args) -> None:  # a forward pre-hook of the denoiser
        self.send_back()


def offload_frozen_parts(parts: list[torch.nn.Module], denoiser: torch.nn.Module, device) -> FrozenPartsOffload:
    """Put ``parts`` (the family's frozen modules) on the CPU, moved to ``device`` only while called."""
    offload = FrozenPartsOffload(parts, device)
    denoiser.register_forward_pre_hook(offload.before_denoiser)
    return offload
