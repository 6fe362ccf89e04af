"""Pin HPSv3 reference values from the authors' own code (the ``hpsv3`` package) for tests/test_hpsv3.py.

The side environment: this project's Python with transformers 4.45.2, tokenizers 0.20.3, huggingface_hub 0.26.5
and omegaconf (what ``hpsv3`` 1.0.0 pins or needs) in a folder put first on the path, plus the ``hpsv3`` wheel
unpacked (``pip download --no-deps hpsv3``):

    pip install --no-deps --target SIDE "transformers==4.45.2" "tokenizers==0.20.3" "huggingface_hub==0.26.5" \
        omegaconf "antlr4-python3-runtime==4.9.3"
    python -m experiments.hpsv3_reference --side SIDE --hpsv3 UNPACKED_WHEEL

Training-only imports of the package (trl, peft, datasets, tensorboard, matplotlib, fire, torchvision, which
inference with PIL images never reaches) are stubbed. The authors' ``create_model_and_processor`` builds their
model on the tiny base of align/testing/tiny_hpsv3.py; its state dict, filled by ``tiny_hpsv3.fill`` key by key, is the
checkpoint; ``HPSv3RewardInferencer`` loads it (strictly) and scores the test images; mu and sigma are pinned.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "hpsv3_reference.json"
PROMPTS = ["a red cube", "two blue circle", "a cat - with {braces}"]
CONFIG = """
rm_head_type: "ranknet"
lora_enable: False
vision_lora: False
model_name_or_path: "{base}"
max_pixels: 200704
min_pixels: 200704
with_instruction: true
output_dir: {out}
use_special_tokens: true
reward_token: "special"
output_dim: 2
loss_type: "uncertainty"
disable_flash_attn2: True
bf16: False
torch_dtype: "float32"
report_to: none
"""


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__path__ = []
    sys.modules[name] = module
    return module


def stub_training_imports() -> None:
    class Anything:
        def __init__(self, *args, **kwargs):
            pass

    _stub("trl", RewardTrainer=Anything, get_kbit_device_map=lambda: None, get_quantization_config=lambda cfg: None)
    _stub("peft", LoraConfig=Anything, get_peft_model=None, PeftModel=Anything)
    _stub("fire")
    _stub("datasets")
    _stub("matplotlib")
    _stub("matplotlib.pyplot")
    _stub("matplotlib.patches")
    _stub("torch.utils.tensorboard", SummaryWriter=Anything)
    functional = _stub("torchvision.transforms.functional")
    transforms = _stub("torchvision.transforms", functional=functional, InterpolationMode=None)
    _stub("torchvision", io=None, transforms=transforms, __version__="0.0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", type=Path, required=True, help="folder with transformers 4.45.2 and friends")
    parser.add_argument("--hpsv3", type=Path, required=True, help="the unpacked hpsv3 wheel (holds hpsv3/)")
    args = parser.parse_args()
    sys.path[:0] = [str(args.side), str(args.hpsv3), str(ROOT)]
    import transformers

    assert transformers.__version__ == "4.45.2", transformers.__version__
    import torch
    from safetensors.torch import save_file

    from align.testing.tiny_hpsv3 import fill, hpsv3_images, write_base

    stub_training_imports()
    from hpsv3.inference import HPSv3RewardInferencer
    from hpsv3.train import create_model_and_processor
    from hpsv3.utils.parser import (
        DataConfig,
        ModelConfig,
        PEFTLoraConfig,
        TrainingConfig,
        parse_args_with_yaml,
    )

    with tempfile.TemporaryDirectory() as tmp:
        base, config_path, checkpoint = Path(tmp) / "base", Path(tmp) / "tiny.yaml", Path(tmp) / "HPSv3.safetensors"
        write_base(base)
        # the authors load the base weights first (then the checkpoint over all of them): any values do
        from transformers import AutoConfig, Qwen2VLForConditionalGeneration

        with torch.device("meta"):
            plain = Qwen2VLForConditionalGeneration(AutoConfig.from_pretrained(base))
        save_file({key: fill(key, tuple(t.shape)) for key, t in plain.state_dict().items()}, str(base / "model.safetensors"),
                  metadata={"format": "pt"})
        config_path.write_text(CONFIG.format(base=base, out=Path(tmp) / "out"))
        (_, training_args, model_config, lora_config), _ = parse_args_with_yaml(
            (DataConfig, TrainingConfig, ModelConfig, PEFTLoraConfig), str(config_path), is_train=False)
        model, _, _ = create_model_and_processor(model_config=model_config, peft_lora_config=lora_config,
                                                 training_args=training_args)
        shapes = {key: tuple(t.shape) for key, t in model.state_dict().items()}
        save_file({key: fill(key, shape) for key, shape in sorted(shapes.items())}, str(checkpoint))
        del model
        scorer = HPSv3RewardInferencer(str(config_path), str(checkpoint), device="cpu")
        paths = []
        for i, image in enumerate(hpsv3_images()):
            paths.append(str(Path(tmp) / f"{i}.png"))
            image.save(paths[-1])
        with torch.no_grad():
            out = scorer.reward(paths, PROMPTS).float()
    record = {"source": "hpsv3 1.0.0 (PyPI; MizzenAI/HPSv3) HPSv3RewardInferencer.reward under transformers 4.45.2, "
                        "run by experiments/hpsv3_reference.py",
              "prompts": PROMPTS, "mu": out[:, 0].tolist(), "sigma": out[:, 1].tolist(),
              "checkpoint_shapes": {key: list(shape) for key, shape in sorted(shapes.items())}}
    OUT.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "checkpoint_shapes"}, indent=1))


if __name__ == "__main__":
    main()
