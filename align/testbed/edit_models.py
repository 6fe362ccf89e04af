"""The editing testbed's model: FLUX.1 Kontext's architecture at 32 px, and where its bundled weights live.

The classes are FluxKontextPipeline's own (diffusers' FluxTransformer2DModel, FlowMatchEulerDiscreteScheduler;
transformers' CLIPTextModel and T5EncoderModel with CLIP and T5 tokenizers), only small, so code written for FLUX.1
Kontext runs unchanged on it. The VAE is the SD testbed's (32 px <-> 8 x 8 x 4 latents, 4 x 4 packed tokens), frozen.
No guidance embedding (FLUX.1 Kontext [dev] has one, distilled from classifier-free guidance; the testbed is trained
with instruction dropout and guided, if at all, by classifier-free guidance). Both tokenizers hold every word of the
editing world's instructions as one token.
"""

from __future__ import annotations

from pathlib import Path

from align.testbed.tokenizer import build_tokenizer, grammar_words
from align.testbed.weights import FLOW_TESTBED_SETTINGS_FILE, MissingTestbedWeightsError
from rewards.shapes_edit import DIRECTIONS

EDIT_TESTBED_PIPELINE_DIR = Path(__file__).parent / "weights" / "edit_pipeline"
SETTINGS_FILE = FLOW_TESTBED_SETTINGS_FILE  # sampling settings (resolution, steps, T5 length) beside model_index.json
INSTRUCTION_WORDS = ("make", "move", "remove", "the", "to", "left", "right", "up", "down")
MAX_SEQUENCE_LENGTH = 12  # T5 tokens: the longest instruction ("move the yellow triangle to the right") is 8 words
CLIP_MAX_LENGTH = 12
TEXT_WIDTH = 64  # T5 d_model = joint_attention_dim; CLIP width = pooled_projection_dim

# name -> transformer shape; "test" is for unit tests
SIZES: dict[str, dict] = {
    "test": dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2),
    "small": dict(num_layers=2, num_single_layers=4, attention_head_dim=32, num_attention_heads=4),
}


def edit_testbed_pipeline_dir() -> Path:
    """The bundled editing testbed's pipeline folder, or a clear error saying how to build it."""
    if not (EDIT_TESTBED_PIPELINE_DIR / "model_index.json").is_file():
        raise MissingTestbedWeightsError(
            f"the bundled editing testbed pipeline is missing ({EDIT_TESTBED_PIPELINE_DIR} has no model_index.json); "
            f"build it with `python scripts/build_edit_testbed.py --out {EDIT_TESTBED_PIPELINE_DIR}`, or pass a local "
            "editing testbed folder as --model instead of 'testbed-edit'")
    return EDIT_TESTBED_PIPELINE_DIR


def instruction_words() -> list[str]:
    words = set(grammar_words()) | set(INSTRUCTION_WORDS)
    for direction in DIRECTIONS:
        words.update(direction.split())
    return sorted(words)


def t5_tokenizer():
    """A T5 tokenizer (Unigram) whose pieces are the instruction words and single characters (any text tokenizes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789.,'-"
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -3.0)]
    pieces += [("\u2581" + w, -1.0) for w in instruction_words()] + [(c, -4.0) for c in chars]
    backend = Tokenizer(models.Unigram(pieces, unk_id=2))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                           extra_ids=0, model_max_length=MAX_SEQUENCE_LENGTH)


def text_encoder_configs(clip_tokenizer, t5_vocab: int) -> tuple[dict, dict]:
    clip = dict(vocab_size=len(clip_tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=4 * TEXT_WIDTH,
                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=CLIP_MAX_LENGTH,
                projection_dim=TEXT_WIDTH, bos_token_id=clip_tokenizer.bos_token_id,
                eos_token_id=clip_tokenizer.eos_token_id, pad_token_id=clip_tokenizer.eos_token_id)
    t5 = dict(vocab_size=t5_vocab, d_model=TEXT_WIDTH, d_kv=16, d_ff=4 * TEXT_WIDTH, num_layers=2, num_heads=4,
              relative_attention_num_buckets=16, decoder_start_token_id=0)
    return clip, t5


def transformer_config(size: str = "small") -> dict:
    if size not in SIZES:
        raise ValueError(f"unknown editing testbed size {size!r}; valid: {', '.join(SIZES)}")
    shape = SIZES[size]
    head = shape["attention_head_dim"]
    rope = (head // 4, 3 * head // 8, 3 * head // 8)  # FLUX's (16, 56, 56) of 128, scaled
    return dict(patch_size=1, in_channels=16, joint_attention_dim=TEXT_WIDTH, pooled_projection_dim=TEXT_WIDTH,
                guidance_embeds=False, axes_dims_rope=rope, **shape)


def scheduler_config() -> dict:
    """FLUX.1's scheduler (its resolution-dependent shift; at 16 image tokens it barely shifts)."""
    return dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                base_image_seq_len=256, max_image_seq_len=4096)


def build_pipeline(vae, size: str = "small"):
    """A random-weight FluxKontextPipeline of the testbed's architecture around ``vae``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    vae.register_to_config(shift_factor=0.0)  # FLUX pipelines subtract it; the SD testbed VAE's is None (no shift)
    clip_tokenizer = build_tokenizer(instruction_words())
    clip_tokenizer.model_max_length = CLIP_MAX_LENGTH
    t5 = t5_tokenizer()
    clip_config, t5_config = text_encoder_configs(clip_tokenizer, len(t5))
    return FluxKontextPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_config()), vae=vae,
        text_encoder=CLIPTextModel(CLIPTextConfig(**clip_config)), tokenizer=clip_tokenizer,
        text_encoder_2=T5EncoderModel(T5Config(**t5_config)), tokenizer_2=t5,
        transformer=FluxTransformer2DModel(**transformer_config(size)))
