"""Quiet logs: what third-party libraries print that a user can do nothing about, switched off in one place.

Every entry point calls ``quiet_output(config.quiet)`` first. Causes are fixed where they are ours
(dtype= for diffusers, UNet-only LoRA loading, our own progress bars); what is left here cannot be
fixed from our side, and each filter matches one module and one message.
"""

from __future__ import annotations

import logging
import re
import warnings

from align.progress import set_quiet


class _DropMessages(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


# diffusers imports transformers' CLIPImageProcessor / SiglipImageProcessor names at import time; without
# torchvision (which this project does not install) transformers falls back to the PIL processors, which
# is what we want, and says so once per name.
_TORCHVISION_FALLBACK = ("transformers.utils.import_utils",
                         r"requires torchvision \(not installed\); falling back to `\w+Pil`")


# torchao (--quantize_base) on a machine without CUDA: its CUDA kernels' libraries do not load, which the CPU's int8 /
# float8 weight-only paths never use; at import it also registers enums with torch's pytree, which torch 2.13 calls
# deprecated. diffusers 0.42 imports torchao tensor classes that torchao >= 0.17 moved, for torch.load of
# torchao-serialized files, which this project never loads (weights load from safetensors). Its quantizer also says that
# integer quantization supports only bf16: a float32 base (the CPU testbeds) loads and trains (tests/test_quantized_base.py).
_TORCHAO_IMPORT = (("torchao", r"^Failed to load .*\.so"),
                   ("torch.utils._pytree", r"is an Enum subclass and is now natively supported by torch\.compile"),
                   ("diffusers.quantizers.torchao.torchao_quantizer", r"Unable to import `torchao` Tensor objects"),
                   ("diffusers.quantizers.torchao.torchao_quantizer",
                    r"set torch_dtype to torch\.float32 for integer quantization"))


def _drop(logger_name: str, pattern: str) -> None:
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _DropMessages) and f.pattern.pattern == pattern for f in logger.filters):
        logger.addFilter(_DropMessages(pattern))


def _hide_weight_loading_bars() -> None:
    """transformers' "Loading weights" / "Writing model shards" and diffusers' "Loading pipeline components" bars:
    loading and saving take seconds and say nothing the user acts on. Download bars (huggingface_hub) stay."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    set_hook = getattr(transformers_logging, "set_tqdm_hook", None)
    if set_hook is not None:
        def hook(factory, args, kwargs):
            if kwargs.get("desc") in ("Loading weights", "Writing model shards"):
                kwargs = {**kwargs, "disable": True}
            return factory(*args, **kwargs)

        set_hook(hook)


def quiet_output(quiet: bool = False) -> None:
    """Drop the third-party messages listed above; ``quiet``: no progress bars either (``--quiet true``)."""
    _drop(*_TORCHVISION_FALLBACK)
    for logger_name, pattern in _TORCHAO_IMPORT:
        _drop(logger_name, pattern)
    # PEFT's get_peft_model reads transformers' deprecated `is_gradient_checkpointing` (peft 0.21 with
    # transformers 5); our code never calls it, so only the one message from that one module is dropped.
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning,
                            module=r"transformers\.modeling_utils")
    _hide_weight_loading_bars()
    set_quiet(quiet)
