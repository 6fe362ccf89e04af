"""LLaVA-Reward (Zhou et al., ICCV 2025): a multimodal LLM as a reward model.

Reward = value_head(SkipCA(h_last, image tokens))[final token], where h_last are the LLM's
last-layer hidden states, the image tokens are the projected image features as they enter the
LLM, and the final token is the EOS (Phi-3.5-vision) or <|im_end|> (Qwen2.5-VL) the input ends
with. P(a > b) = sigmoid((r_a - r_b) / tau) (tau 0.1), or for the authors' general-preference
checkpoints (2-d rewards) sigmoid((a0 b1 - a1 b0) / tau).

The authors' checkpoint layout (a folder; loaded as released):
    lora/                    PEFT adapter (adapter_config.json + adapter_model.*)
    pytorch_model.bin        value_head / W_q / W_k / W_v / ca_layernorm / projector tensors
                             (we write reward_head.safetensors with the same keys)
    reward_config.yaml       is_general_preference, add_cross_attention, value_head_dim,
                             general_preference_tau
The backbone is loaded separately: Phi-3.5-vision (rewards/phi3v.py, a native port of the model
repository's remote code: no trust_remote_code) or Qwen2.5-VL (native in transformers).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import yaml
from huggingface_hub import snapshot_download
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import load_peft_weights
from PIL import Image
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from rewards.base import Preference
from rewards.images import Images, num_images, to_pil
from rewards.phi3v import load_phi3v
from rewards.phi3v_processor import Phi3VInputs
from rewards.reward_heads import (
    SkipCrossAttention,
    general_preference_probability,
    preference_probability,
    read_last_token,
)
from rewards.reward_model_judge import TrainedRewardJudge
from rewards.vlm import load_processor

PHI35_VISION = "microsoft/Phi-3.5-vision-instruct"
QWEN25_VL = "Qwen/Qwen2.5-VL-7B-Instruct"
# The authors' released checkpoints live in this hub repository, one folder per perspective;
# the folder below is the README's example path (alignment perspective, Phi-3.5-vision).
CHECKPOINT_REPO = "smz8599/LLaVA-Reward"
DEFAULT_CHECKPOINT = f"{CHECKPOINT_REPO}/alignment/llavareward_phi_alignment"
HEAD_FILES = ("reward_head.safetensors", "pytorch_model.bin")
REWARD_CONFIG = "reward_config.yaml"
# model_type -> (our backbone kind, needs remote code)
BACKBONES = {"phi3_v": ("phi3v", False), "qwen2_5_vl": ("qwen2.5-vl", False)}  # phi3_v: rewards/phi3v.py
# RMSNorm eps of the SkipCA norm, as each backbone's own RMSNorm
NORM_EPS = {"phi3v": 1e-5, "qwen2.5-vl": 1e-6}
LORA_TARGETS = {
    # attention and MLP projections of the language model (not the vision tower)
    "phi3v": r".*model\.layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))",
    "qwen2.5-vl": r".*language_model\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))",
}


# The authors' image sizes (github.com/sjz5202/LLaVA-Reward, llava_reward/utils/utils.py and
# llava_reward/models/base_mllm/qwen_vl_utils/vision_process.py):
PHI35_NUM_CROPS = 16  # get_tokenizer: AutoProcessor.from_pretrained(..., num_crops=16)
QWEN_PATCH_FACTOR = 28  # 14 px patches merged 2 x 2
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 256 * 28 * 28, 1280 * 28 * 28  # get_tokenizer_qwen: the processor's limits
# before the processor, process_vision_info -> fetch_image resizes every image within these (its defaults)
QWEN_FETCH_MIN_PIXELS, QWEN_FETCH_MAX_PIXELS = 4 * 28 * 28, 16384 * 28 * 28
QWEN_MAX_RATIO = 200


class LlavaRewardError(ValueError):
    """A checkpoint or backbone that cannot be used (layout, remote code, unknown model type)."""


# --------------------------------------------------------------------------------- inputs (pure)


def phi3v_reward_text(caption: str, eos_token: str) -> str:
    """Phi-3.5-vision input: the user turn with the image and caption, no assistant header, EOS last
    (the authors cut '<|end|>\\n<|assistant|>\\n' off the chat template and append EOS)."""
    return f"<|user|>\n<|image_1|>\n{caption}{eos_token}"


def qwen_reward_text(caption: str) -> str:
    """Qwen2.5-VL input: the user turn (no system turn, no assistant header), ending with <|im_end|>;
    the processor expands <|image_pad|> to the image's token count."""
    return f"<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{caption}<|im_end|>"


def qwen_fetch_size(width: int, height: int, factor: int = QWEN_PATCH_FACTOR, min_pixels: int = QWEN_FETCH_MIN_PIXELS,
                    max_pixels: int = QWEN_FETCH_MAX_PIXELS) -> tuple[int, int]:
    """(width, height) Qwen's ``smart_resize`` gives: both sides multiples of ``factor`` (nearest), the
    area brought within [min_pixels, max_pixels] keeping the aspect ratio (floor when shrinking, ceil
    when growing)."""
    if max(width, height) / min(width, height) > QWEN_MAX_RATIO:
        raise ValueError(f"image of {width}x{height}: Qwen2.5-VL takes aspect ratios up to {QWEN_MAX_RATIO}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar, w_bar = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return w_bar, h_bar


def qwen_fetch_image(image):
    """The authors' ``fetch_image`` step before the Qwen processor: RGB, resized to ``qwen_fetch_size``
    with PIL's default filter (bicubic)."""
    image = image.convert("RGB")
    size = qwen_fetch_size(*image.size)
    return image if size == image.size else image.resize(size, Image.BICUBIC)


def use_authors_qwen_pixel_limits(processor) -> None:
    """The processor's resize bounds as the authors set them (min 256, max 1280 tokens of 28 x 28 px)."""
    processor.image_processor.size = {"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS}


def pack_image_tokens(embeddings: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row image tokens [n_i, H] -> padded [B, max n, H] and a [B, max n] validity mask."""
    longest = max(e.shape[0] for e in embeddings)
    hidden = embeddings[0].shape[-1]
    tokens = embeddings[0].new_zeros(len(embeddings), longest, hidden)
    mask = torch.zeros(len(embeddings), longest, dtype=torch.bool, device=embeddings[0].device)
    for i, e in enumerate(embeddings):
        tokens[i, : e.shape[0]] = e
        mask[i, : e.shape[0]] = True
    return tokens, mask


# ------------------------------------------------------------------------------------- backbone


def _model_type(model: str) -> str | None:
    """model_type from a local folder's config.json, else a guess from the hub id."""
    config = Path(model).expanduser() / "config.json"
    if config.is_file():
        return json.loads(config.read_text()).get("model_type")
    lowered = model.lower()
    if "phi-3" in lowered or "phi3" in lowered:
        return "phi3_v"
    if "qwen2.5-vl" in lowered or "qwen2_5_vl" in lowered:
        return "qwen2_5_vl"
    return None


def check_backbone(model: str, trust_remote_code: bool = False) -> str:
    """The backbone kind of ``model``, or one clear error (unknown type, remote code not allowed)."""
    model_type = _model_type(model)
    if model_type not in BACKBONES:
        raise LlavaRewardError(
            f"LLaVA-Reward backbone {model!r} has model_type {model_type!r}; supported: Phi-3.5-vision "
            f"(phi3_v, e.g. {PHI35_VISION}) and Qwen2.5-VL (qwen2_5_vl, e.g. {QWEN25_VL})"
        )
    kind, remote = BACKBONES[model_type]
    if remote and not trust_remote_code:
        raise LlavaRewardError(
            f"the LLaVA-Reward backbone {model!r} ({model_type}) is not part of transformers and runs the "
            "model repository's own Python code; pass trust_remote_code=True (--trust_remote_code true) "
            "if you trust that repository, or use a Qwen2.5-VL backbone"
        )
    return kind


class LlavaRewardModel(nn.Module):
    """An MLLM + optional SkipCA + a linear value head read at the final token."""

    def __init__(self, mllm, processor, kind: str, skip_cross_attention: bool = True, value_head_dim: int = 1, base_model: str = ""):
        super().__init__()
        if kind not in NORM_EPS:
            raise LlavaRewardError(f"unknown backbone kind {kind!r}; known: {', '.join(NORM_EPS)}")
        self.mllm, self.processor, self.kind, self.base_model = mllm, processor, kind, base_model
        config = mllm.config
        hidden = getattr(config, "text_config", config).hidden_size
        self.skipca = SkipCrossAttention(hidden, eps=NORM_EPS[kind]) if skip_cross_attention else None
        self.value_head = nn.Linear(hidden, value_head_dim, bias=False)
        self.value_head_dim = value_head_dim
        self.max_length = None

    # -- construction

    @classmethod
    def from_base(cls, model: str, skip_cross_attention: bool = True, trust_remote_code: bool = False,
                  value_head_dim: int = 1, dtype: torch.dtype = torch.float32, device=None, processor=None) -> LlavaRewardModel:
        """``processor``: an already built processor (default: the backbone folder's own)."""
        kind = check_backbone(model, trust_remote_code)
        try:
            if kind == "qwen2.5-vl":
                mllm = Qwen2_5_VLForConditionalGeneration.from_pretrained(model, dtype=dtype)
                if processor is None:
                    processor = load_processor(model)  # works without torchvision too
                    use_authors_qwen_pixel_limits(processor)
            else:
                # native port of the remote modelling/processing code (rewards/phi3v*.py), no remote code
                mllm = load_phi3v(model, dtype=dtype)
                # the authors' setting (16 crops; Phi-3.5-vision's model card suggests 4 for single images)
                processor = processor or Phi3VInputs(AutoTokenizer.from_pretrained(model), num_crops=PHI35_NUM_CROPS)
        except OSError as err:
            raise LlavaRewardError(f"cannot load the LLaVA-Reward backbone {model!r}: {err}") from err
        built = cls(mllm, processor, kind, skip_cross_attention, value_head_dim, base_model=model)
        return built.to(device=device or "cpu", dtype=dtype)

    def init_reward_head(self) -> None:
        """The authors' initialisation: N(0, 1/(H+1)) for the value head and the SkipCA projections."""
        nn.init.normal_(self.value_head.weight, mean=0.0, std=1.0 / (self.value_head.in_features + 1))
        if self.skipca is not None:
            self.skipca.reset_parameters()

    def projector(self) -> nn.Module:
        """The vision-to-LLM projector (trained fully in the paper's recipe)."""
        if self.kind == "qwen2.5-vl":
            return self.mllm.model.visual.merger
        return self.mllm.model.vision_embed_tokens.img_projection

    def vision_tower(self) -> nn.Module:
        return self.mllm.model.visual if self.kind == "qwen2.5-vl" else self.mllm.model.vision_embed_tokens

    def add_lora(self, rank: int = 128, alpha: float = 256.0, dropout: float = 0.05) -> None:
        """LoRA on the LLM's attention and MLP projections; vision tower frozen, projector trained."""
        self.mllm.requires_grad_(False)
        self._inject_lora(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=LORA_TARGETS[self.kind]))
        self.projector().requires_grad_(True)

    def _inject_lora(self, config) -> None:
        # peft directly (not transformers' add_adapter, which needs a newer peft than some installs have)

        inject_adapter_in_model(config, self.mllm, adapter_name="default")
        self.lora_config = config

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """Adapter tensors under PEFT's saved names (no adapter name), as in adapter_model.safetensors."""
        return {name: t.detach().cpu().contiguous() for name, t in get_peft_model_state_dict(self.mllm).items()}

    def save_lora(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.lora_config.save_pretrained(str(folder))
        save_file(self.lora_state_dict(), str(folder / "adapter_model.safetensors"))

    def load_lora(self, folder: str | Path) -> None:
        """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors/.bin) onto the backbone."""
        folder = Path(folder)
        config = LoraConfig.from_pretrained(str(folder))
        if not any((folder / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
            raise LlavaRewardError(f"LoRA folder {str(folder)!r} has no adapter_model.safetensors or adapter_model.bin")
        state = load_peft_weights(str(folder), device="cpu")
        self._inject_lora(config)
        renamed = {}
        for key, tensor in state.items():
            key = key.removeprefix("base_model.model.")
            if self.kind == "qwen2.5-vl":  # transformers < 5 names of Qwen2.5-VL modules
                if key.startswith("model.layers."):
                    key = "model.language_model." + key.removeprefix("model.")
                elif key.startswith("visual."):
                    key = "model." + key
            renamed[key] = tensor
        result = set_peft_model_state_dict(self.mllm, renamed)  # adds the adapter name to the keys
        missing = [k for k in result.missing_keys if "lora_" in k]
        if result.unexpected_keys or missing:
            raise LlavaRewardError(
                f"LoRA adapter {str(folder)!r} does not fit the {self.kind} backbone: "
                f"unexpected {sorted(result.unexpected_keys)[:3]}, missing {sorted(missing)[:3]}"
            )

    def set_adapters_enabled(self, enabled: bool) -> None:

        for module in self.mllm.modules():
            if isinstance(module, BaseTunerLayer):
                module.enable_adapters(enabled)

    def freeze_backbone(self) -> None:
        self.mllm.requires_grad_(False)

    # -- forward

    def build_inputs(self, prompts: list[str], images: list):
        if self.kind == "qwen2.5-vl":
            texts = [qwen_reward_text(p) for p in prompts]
        else:
            texts = [phi3v_reward_text(p, self.processor.tokenizer.eos_token) for p in prompts]
        if self.kind == "phi3v":  # the Phi-3.5-vision processor takes one prompt at a time
            return [self.processor(text=t, images=[img], return_tensors="pt") for t, img in zip(texts, images)]
        images = [qwen_fetch_image(img) for img in images]  # the authors' resize before the processor
        return self.processor(text=texts, images=images, padding=True, return_tensors="pt")

    def rewards_from_inputs(self, input_ids, attention_mask, **vision_inputs) -> torch.Tensor:
        """Rewards [B] (or [B, D] for D-dim heads) from processor outputs."""
        device = self.value_head.weight.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        vision_inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in vision_inputs.items()}
        if self.kind == "qwen2.5-vl":
            base = self.mllm.model
            image_out = base.get_image_features(vision_inputs["pixel_values"], vision_inputs["image_grid_thw"])
            extra = {k: vision_inputs[k] for k in ("mm_token_type_ids",) if k in vision_inputs}
            outputs = base(input_ids=input_ids, attention_mask=attention_mask, image_grid_thw=vision_inputs["image_grid_thw"],
                           mm_encoder_outputs={"image": image_out}, use_cache=False, **extra)
            last = outputs.last_hidden_state
            image_tokens, image_mask = pack_image_tokens(list(image_out.pooler_output))
        else:
            # Phi-3-vision marks image positions with negative ids; the input embeddings there are
            # the projected image tokens at the LLM input.
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
            embeds = self.mllm.model.embed_inputs(input_ids, vision_inputs["pixel_values"], vision_inputs["image_sizes"])
            outputs = self.mllm.model(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
                                      use_cache=False)
            last = outputs.last_hidden_state
            image_tokens, image_mask = pack_image_tokens([embeds[i][input_ids[i] < 0] for i in range(len(input_ids))])
        if self.skipca is not None:
            last = self.skipca(last, image_tokens.to(last.dtype), image_mask)
        values = self.value_head(last.to(self.value_head.weight.dtype))
        rewards = read_last_token(values, attention_mask)
        return rewards.squeeze(-1) if self.value_head_dim == 1 else rewards

    def forward(self, prompts: list[str], images: list) -> torch.Tensor:
        inputs = self.build_inputs(prompts, images)
        if isinstance(inputs, list):  # one image per call (Phi-3.5-vision)
            return torch.cat([self.rewards_from_inputs(**dict(x)) for x in inputs])
        return self.rewards_from_inputs(**dict(inputs))

    def rewards(self, prompts: list[str], images: list) -> torch.Tensor:
        return self(prompts, images)

    # -- checkpoint (the authors' layout)

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """value_head, SkipCA and projector tensors under the authors' key names."""
        state = {"value_head.weight": self.value_head.weight}
        if self.skipca is not None:
            state.update({f"{k}": v for k, v in self.skipca.state_dict().items()})
        prefix = "model.visual.merger." if self.kind == "qwen2.5-vl" else "model.vision_embed_tokens.img_projection."
        state.update({prefix + k: v for k, v in self.projector().state_dict().items()})
        return {k: v.detach().cpu().contiguous() for k, v in state.items()}

    def load_head_state_dict(self, state: dict[str, torch.Tensor], source: str = "checkpoint") -> None:
        """Map the authors' keys (any prefix) onto value head, SkipCA and projector; every key must be used."""
        value, skipca, projector, unused = {}, {}, {}, []
        marker = "merger." if self.kind == "qwen2.5-vl" else "img_projection."
        for key, tensor in state.items():
            leaf = key.rsplit(".", 1)[-1]
            if "value_head" in key:
                value[leaf] = tensor
            elif any(f"{name}." in key for name in ("W_q", "W_k", "W_v", "ca_layernorm")):
                skipca[".".join(key.split(".")[-2:])] = tensor
            elif marker in key:
                projector[key.split(marker, 1)[1]] = tensor
            else:
                unused.append(key)
        if unused:
            raise LlavaRewardError(f"{source}: unexpected tensors {unused[:5]} for a {self.kind} LLaVA-Reward head")
        if set(value) != {"weight"} or value["weight"].shape != self.value_head.weight.shape:
            raise LlavaRewardError(
                f"{source}: value head must be one weight of shape {tuple(self.value_head.weight.shape)}, got "
                f"{ {k: tuple(v.shape) for k, v in value.items()} }"
            )
        self.value_head.load_state_dict(value)
        if self.skipca is not None:
            if not skipca:
                raise LlavaRewardError(f"{source}: reward_config says add_cross_attention but the file has no SkipCA tensors")
            self.skipca.load_state_dict(skipca)
        elif skipca:
            raise LlavaRewardError(f"{source}: SkipCA tensors present but reward_config says add_cross_attention: false")
        if projector:
            self.projector().load_state_dict(projector)

    def save(self, folder: str | Path) -> dict:
        """The authors' layout: lora/, reward_head.safetensors (their keys), reward_config.yaml."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if getattr(self, "lora_config", None) is not None:
            self.save_lora(folder / "lora")
        save_file(self.head_state_dict(), str(folder / "reward_head.safetensors"))
        config = {
            "is_general_preference": self.value_head_dim > 1,
            "add_cross_attention": self.skipca is not None,
            "value_head_dim": self.value_head_dim,
            "general_preference_tau": 0.1,
        }
        (folder / REWARD_CONFIG).write_text(yaml.safe_dump(config))
        return {"kind": "mllm-skipca", "base_model": self.base_model, "backbone_kind": self.kind}


# ------------------------------------------------------------------------------------- loading


def resolve_checkpoint(checkpoint: str) -> Path:
    """A local folder, or '<owner>/<repo>/<subfolder>' on the hub (only that folder is fetched)."""
    path = Path(checkpoint).expanduser()
    if path.is_dir():
        return path
    parts = checkpoint.split("/")
    if len(parts) < 2 or checkpoint.startswith((".", "/", "~")):
        raise LlavaRewardError(f"LLaVA-Reward checkpoint {checkpoint!r}: no such folder (and not '<owner>/<repo>[/<subfolder>]')")

    repo, sub = "/".join(parts[:2]), "/".join(parts[2:])
    try:
        root = snapshot_download(repo, allow_patterns=[f"{sub}/*", f"{sub}/**"] if sub else None)
    except Exception as err:  # hub errors come in many classes; all mean "not available"
        raise LlavaRewardError(f"cannot fetch LLaVA-Reward checkpoint {checkpoint!r}: {err}") from err
    return Path(root) / sub


def read_reward_config(folder: Path) -> dict:
    path = folder / REWARD_CONFIG
    if not path.is_file():
        raise LlavaRewardError(f"LLaVA-Reward checkpoint {str(folder)!r} has no {REWARD_CONFIG}")
    config = yaml.safe_load(path.read_text()) or {}
    missing = [k for k in ("add_cross_attention", "is_general_preference") if k not in config]
    if missing:
        raise LlavaRewardError(f"{path} lacks {', '.join(missing)}")
    return config


def load_head_file(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    for name in HEAD_FILES:
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                return load_file(str(path)), str(path)
            # the authors' torch pickle: read tensors only, never run pickled code
            return torch.load(path, map_location="cpu", weights_only=True), str(path)
    raise LlavaRewardError(f"LLaVA-Reward checkpoint {str(folder)!r} has none of {', '.join(HEAD_FILES)}")


def _base_model_of(folder: Path, base_model: str | None) -> str:
    """Explicit option > our marker > the checkpoint's config.json model_type (Phi-3.5-vision default)."""
    if base_model:
        return base_model
    marker = folder / "reward_model.json"
    if marker.is_file():
        recorded = json.loads(marker.read_text()).get("base_model")
        if recorded:
            return recorded
    config = folder / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        if data.get("model_type") == "qwen2_5_vl":
            return data.get("_name_or_path") or QWEN25_VL
    return PHI35_VISION


def load_reward_checkpoint(checkpoint: str | Path, base_model: str | None = None, trust_remote_code: bool = False,
                           device=None, dtype: torch.dtype = torch.float32, processor=None) -> LlavaRewardModel:
    """An LLaVA-Reward model from a checkpoint folder in the authors' layout and its base MLLM."""
    if not Path(str(checkpoint)).expanduser().is_dir():
        # a hub checkpoint: refuse a remote-code backbone before downloading anything
        check_backbone(base_model or PHI35_VISION, trust_remote_code)
    folder = resolve_checkpoint(str(checkpoint))
    config = read_reward_config(folder)
    base = _base_model_of(folder, base_model)
    check_backbone(base, trust_remote_code)  # before any weights load
    head, head_source = load_head_file(folder)
    dim = int(config.get("value_head_dim", 2)) if config["is_general_preference"] else 1
    model = LlavaRewardModel.from_base(base, skip_cross_attention=bool(config["add_cross_attention"]),
                                       trust_remote_code=trust_remote_code, value_head_dim=dim, dtype=dtype, device=device,
                                       processor=processor)
    if (folder / "lora").is_dir():
        model.load_lora(folder / "lora")
    model.load_head_state_dict(head, head_source)
    model.tau = float(config.get("general_preference_tau", 0.1))
    return model.to(device=device or "cpu", dtype=dtype).eval()


class LlavaRewardJudge(TrainedRewardJudge):
    """LLaVA-Reward as a judge. Bradley-Terry checkpoints score pointwise; general-preference
    (2-d) checkpoints only compare pairs."""

    def score(self, prompts: list[str], images: Images) -> torch.Tensor:
        if self.model.value_head_dim != 1:
            raise NotImplementedError(
                f"judge {self.name!r} is a general-preference checkpoint (2-d rewards): it only compares pairs; use compare()"
            )
        return super().score(prompts, images)

    def compare(self, prompts: list[str], images_a: Images, images_b: Images) -> list[Preference]:
        if self.model.value_head_dim == 1:
            return super().compare(prompts, images_a, images_b)
        if num_images(images_a) != len(prompts) or num_images(images_b) != len(prompts):
            raise ValueError("compare needs one prompt per pair of images")
        with torch.no_grad():
            reward_a = self.model(list(prompts), to_pil(images_a)).float().cpu()
            reward_b = self.model(list(prompts), to_pil(images_b)).float().cpu()
        probs = general_preference_probability(reward_a, reward_b, self.tau * self.temperature)
        out = []
        for p, a, b in zip(probs.tolist(), reward_a, reward_b):
            raw = {"reward_a": a.tolist(), "reward_b": b.tolist()}
            logit = torch.logit(torch.tensor(p), eps=1e-12).item()
            if abs(logit) <= self.tie_margin:  # the same rule as pointwise: a margin on the logit
                out.append(Preference(0.5, tie=True, raw=raw))
            else:
                out.append(Preference(p, raw=raw))
        return out


def LlavaReward(model: str = DEFAULT_CHECKPOINT, base_model: str | None = None, trust_remote_code: bool = False,
                device=None, dtype: str | torch.dtype = "float32", tau: float | None = None, batch_size: int = 4,
                tie_margin: float = 0.0, processor=None) -> LlavaRewardJudge:
    """The 'llava-reward' judge: ``model`` is a checkpoint folder (or hub '<owner>/<repo>/<folder>');
    ``base_model`` the backbone (default: Phi-3.5-vision, run natively by rewards/phi3v.py)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    reward_model = load_reward_checkpoint(model, base_model=base_model, trust_remote_code=trust_remote_code, device=device,
                                          dtype=dtype, processor=processor)
    return LlavaRewardJudge(reward_model, name="llava-reward", tau=tau or reward_model.tau, batch_size=batch_size, tie_margin=tie_margin)


__all__ = [
    "LlavaReward",
    "LlavaRewardJudge",
    "LlavaRewardModel",
    "check_backbone",
    "load_reward_checkpoint",
    "pack_image_tokens",
    "phi3v_reward_text",
    "preference_probability",
    "qwen_reward_text",
]
