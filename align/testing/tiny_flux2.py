"""Tiny FLUX.2 pipelines ([klein] with a Qwen3 text encoder, [dev] with Mistral Small 3.1's Mistral3 and its Pixtral
processor) built from scaled-down configs, for tests.

The classes are the real ones (Flux2Transformer2DModel, AutoencoderKLFlux2, Qwen3ForCausalLM, Mistral3ForConditionalGeneration,
Qwen2Tokenizer, PixtralProcessor, FlowMatchEulerDiscreteScheduler) at random weights, saved with ``save_pretrained`` and
loaded back through ``align.pipeline.load_pipeline`` like real weights. The transformer and VAE configs are diffusers'
test configs (tests/pipelines/flux2); the text encoders keep the real number of layers up to the deepest one the
pipelines read (Qwen3: hidden states 9, 18, 27; Mistral: 10, 20, 30) at a width of 16. Tokenizers are byte-level and
written here, with chat templates of the real form, so nothing is downloaded.

The FLUX.2 [dev] pipeline's tokenizer is the Pixtral processor's tokenizer alone (``mistral_tokenizer``).

Sizes: 32 px images <-> 1 x 16 x 16 VAE latents <-> 4 x 8 x 8 patchified latents, 64 image tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from align.testing.tiny_qwen import qwen_tokenizer, save_tiny

TEXT_HIDDEN = 16
MAX_SEQUENCE_LENGTH = 64  # stored beside the tiny pipelines (the pipelines pad every prompt to 512)
# Qwen3's chat template, reduced to what the pipelines use: turns, the generation prompt, thinking switched off
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# Mistral Small 3.1's template, reduced to text turns with a system prompt (the pipeline sends no images)
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}[/SYSTEM_PROMPT]{% elif message['role'] == 'user' %}"
    "[INST]{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}[IMG]{% endif %}"
    "{% endfor %}[/INST]{% endif %}{% endfor %}"
)
MISTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[IMG]", "[IMG_BREAK]", "[IMG_END]")


def tiny_flux2_transformer(guidance_embeds: bool) -> Flux2Transformer2DModel:
    return Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=3 * TEXT_HIDDEN, timestep_guidance_channels=256,
                                   axes_dims_rope=[4, 4, 4, 4], guidance_embeds=guidance_embeds)


def tiny_flux2_vae() -> AutoencoderKLFlux2:
    vae = AutoencoderKLFlux2(sample_size=32, in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(4, 8), layers_per_block=1,
                             latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False)
    with torch.no_grad():  # batch-norm statistics away from (0, 1), so that code forgetting them is caught
        vae.bn.running_mean.copy_(torch.tensor([0.2, -0.1, 0.05, 0.3]))
        vae.bn.running_var.copy_(torch.tensor([1.5, 0.7, 2.0, 1.1]))
    return vae


def scheduler() -> FlowMatchEulerDiscreteScheduler:
    # FLUX.2's scheduler_config.json: dynamic shifting (the pipeline gives μ), shift 3
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                           base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


def build_tiny_flux2_klein(folder: str | Path, is_distilled: bool = False, seed: int = 0) -> Path:
    """Save a tiny random Flux2KleinPipeline (base, guided; ``is_distilled``: step-distilled, never guided)."""
    torch.manual_seed(seed)
    tokenizer = qwen_tokenizer(QWEN3_CHAT_TEMPLATE)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        hidden_size=TEXT_HIDDEN, intermediate_size=16, num_hidden_layers=27, num_attention_heads=2, num_key_value_heads=2,
        head_dim=8, vocab_size=len(tokenizer), max_position_embeddings=1024, bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id))
    pipe = Flux2KleinPipeline(scheduler=scheduler(), vae=tiny_flux2_vae(), text_encoder=text_encoder.eval(),
                              tokenizer=tokenizer, transformer=tiny_flux2_transformer(False), is_distilled=is_distilled)
    return save_tiny(pipe, folder, MAX_SEQUENCE_LENGTH)


def mistral_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with Mistral's special tokens and chat-template form: the tokenizer of Mistral Small 3.1's
    Pixtral processor. The tiny pipeline holds it alone: the processor class needs torchvision (not installed on the
    machines that built this), and for text prompts the processor's ``apply_chat_template`` is its tokenizer's."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(MISTRAL_SPECIAL_TOKENS)}
    vocab.update({symbol: len(MISTRAL_SPECIAL_TOKENS) + i for i, symbol in enumerate(alphabet)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(MISTRAL_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", model_max_length=1024, chat_template=MISTRAL_CHAT_TEMPLATE)


def build_tiny_flux2_dev(folder: str | Path, seed: int = 0) -> Path:
    """Save a tiny random Flux2Pipeline (FLUX.2 [dev]: guidance-distilled transformer, Mistral3 text encoder)."""
    torch.manual_seed(seed)
    tokenizer = mistral_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    config = Mistral3Config(
        text_config={"model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": TEXT_HIDDEN,
                     "intermediate_size": 16, "max_position_embeddings": 1024, "num_attention_heads": 2,
                     "num_hidden_layers": 30, "num_key_value_heads": 1, "head_dim": 8, "rms_norm_eps": 1e-05,
                     "rope_theta": 1000000000.0, "sliding_window": None, "bos_token_id": ids("<s>"),
                     "eos_token_id": ids("</s>"), "pad_token_id": ids("<pad>")},
        vision_config={"model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "intermediate_size": 16, "image_size": 32, "patch_size": 8, "num_channels": 3, "head_dim": 8},
        image_token_index=ids("[IMG]"), spatial_merge_size=1, vision_feature_layer=-1,
    )
    pipe = Flux2Pipeline(scheduler=scheduler(), vae=tiny_flux2_vae(), text_encoder=Mistral3ForConditionalGeneration(config).eval(),
                         tokenizer=tokenizer, transformer=tiny_flux2_transformer(True))
    return save_tiny(pipe, folder, MAX_SEQUENCE_LENGTH)
