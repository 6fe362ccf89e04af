"""A quantized frozen base (--quantize_base, --quantize_text_encoders), --offload and --cache_prompt_embeddings:
both trainers on tiny SD, SD3 (with T5) and FLUX pipelines with an int8 weight-only base (torchao), their first
step exactly on the reference (the adapter off, through the same quantized weights), their LoRA loading into the
unquantized pipeline with load_lora_weights; the quantized linears' backward keeping no dequantized weight; the
refusals in one line; the frozen parts visiting the device one at a time; each prompt encoded once."""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
from pathlib import Path

import diffusers
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from test_dpo import _png, small_config

from align.families import FAMILIES, family_of_pipeline
from align.pipeline import add_lora, load_pipeline, merged_adapter
from align.testing.tiny_flow import build_tiny_sd3
from align.train import ddpo, dpo, quantization
from align.train.ddpo_config import DDPOConfig
from align.train.memory_model import SavedStorages
from align.train.offload import FrozenPartsOffload
from align.train.prompt_cache import PromptEmbeddingCache

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao is not installed (pip install 't2i-align[quantization]')")
RESOLUTION = 32
PIPELINES = {"sd": "StableDiffusionPipeline", "sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model, family_models):
    """The tiny pipelines by family; SD3 with its T5 (the text encoder --quantize_text_encoders matters most for)."""
    return {"sd": tiny_model, "sd3": str(build_tiny_sd3(tmp_path_factory.mktemp("sd3_t5"), t5=True)),
            "flux": family_models("flux")}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    rows = [{"caption": f"shape number {i}", "jpg_0": _png((200, 30 * i, 40), size=RESOLUTION),
             "jpg_1": _png((0, 0, 0), size=RESOLUTION, noise_seed=i), "label_0": 1.0, "label_1": 0.0} for i in range(4)]
    path = tmp_path_factory.mktemp("pairs") / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red circle\na blue square\n")
    return str(path)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def unquantized_images(model: str, family: str, lora: Path | None) -> torch.Tensor:
    """Images of the family's own diffusers pipeline, loaded plain (``pipe.load_lora_weights`` for the LoRA)."""
    pipe = getattr(diffusers, PIPELINES[family]).from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora))
    extra = {} if family == "sd" else {"max_sequence_length": 8}
    return pipe(["shape number 1"], num_inference_steps=2, guidance_scale=2.0, height=RESOLUTION, width=RESOLUTION,
                generator=torch.Generator().manual_seed(0), output_type="pt", **extra).images


def test_every_family_loads_with_a_quantization_config():
    for family in FAMILIES:  # a family added without the keyword could not load a quantized base
        assert "quantization" in inspect.signature(family.load_pipeline).parameters, family.name


@pytest.mark.parametrize("trainer", [dpo, ddpo])
def test_full_fine_tuning_of_a_quantized_base_is_refused_in_one_line(trainer, tiny_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        trainer.main(["--model", tiny_model, "--finetune", "full", "--quantize_base", "int8", "--reward", "shapes-oracle",
                      "--prompts", "testbed:8:0", "--output_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert stopped.value.code == 2 and len(err.splitlines()) == 1
    assert "--quantize_base int8" in err and "--finetune lora" in err and not (tmp_path / "run").exists()


def test_a_missing_backend_or_gpu_is_refused_before_the_run_starts(tiny_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(quantization, "torchao_version", lambda: None)
    with pytest.raises(SystemExit) as stopped:
        dpo.main(["--model", tiny_model, "--finetune", "lora", "--quantize_base", "int8", "--reward", "shapes-oracle",
                  "--prompts", "testbed:8:0",
                  "--output_dir", str(tmp_path / "run")])
    assert stopped.value.code == 2 and "needs torchao >= 0.15" in capsys.readouterr().err
    if not torch.cuda.is_available():  # NF4: bitsandbytes, and diffusers' bitsandbytes quantizer loads on a GPU only
        with pytest.raises(SystemExit):
            ddpo.main(["--model", tiny_model, "--quantize_text_encoders", "nf4", "--reward", "shapes-oracle",
                       "--prompts", "testbed:8:0", "--output_dir", str(tmp_path / "run")])
        err = capsys.readouterr().err
        assert "--quantize_text_encoders nf4 needs" in err and ("CUDA" in err or "bitsandbytes" in err)
    assert not (tmp_path / "run").exists()


def test_each_scheme_is_the_config_diffusers_and_transformers_load_it_with():
    """float8 and NF4 need a GPU for their numbers; their wiring is checked here: the configs the pipeline loads with."""
    if importlib.util.find_spec("torchao") is not None:
        mapping = quantization.pipeline_quantization("float8", "int8", "transformer", ["text_encoder"], torch.bfloat16)
        assert type(mapping.quant_mapping["transformer"]).__module__.startswith("diffusers")
        assert type(mapping.quant_mapping["transformer"].quant_type).__name__ == "Float8WeightOnlyConfig"
        assert type(mapping.quant_mapping["text_encoder"]).__module__.startswith("transformers")
        assert type(mapping.quant_mapping["text_encoder"].quant_type).__name__ == "Int8WeightOnlyConfig"
    if importlib.util.find_spec("bitsandbytes") is not None:
        mapping = quantization.pipeline_quantization("nf4", "nf4", "transformer", ["text_encoder_2"], torch.bfloat16)
        for config in mapping.quant_mapping.values():
            assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
            assert config.bnb_4bit_compute_dtype == torch.bfloat16
    assert quantization.pipeline_quantization("none", "none", "unet", ["text_encoder"], torch.float32) is None


@needs_torchao
@pytest.mark.parametrize("family", ["sd", "sd3"])
def test_dpo_on_an_int8_base_starts_on_its_reference_and_its_lora_loads_unquantized(family, models, pairs, tmp_path):
    model = models[family]
    settings = dict(dataset=pairs, resolution=RESOLUTION, max_steps=2, caption_dropout=0.0)
    run = dpo.train(small_config(model, tmp_path / "quantized", quantize_base="int8", quantize_text_encoders="int8",
                                 offload=True, **settings))
    plain = dpo.train(small_config(model, tmp_path / "plain", **settings))
    first, first_plain = metrics(run)[0], metrics(plain)[0]
    # The reference is the adapter off on the same quantized weights: at step 0 both agree bit for bit.
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6) and first["model_mse"] == first["ref_mse"]
    assert first["model_mse"] != first_plain["model_mse"]  # the base really computed in int8
    assert metrics(run)[1]["model_mse"] != metrics(run)[1]["ref_mse"]  # the adapter trained
    before = unquantized_images(model, family, None)
    after = unquantized_images(model, family, run / "final")
    assert (before - after).abs().max() > 1e-4


@needs_torchao
def test_online_rl_on_an_int8_flux_base_is_on_policy_and_its_lora_loads_unquantized(models, prompt_file, tmp_path):
    model = models["flux"]
    config = DDPOConfig(model=model, reward="jpeg-compressibility", prompts=prompt_file, output_dir=str(tmp_path / "run"),
                        report_to="none", num_inference_steps=4, resolution=RESOLUTION, samples_per_epoch=4,
                        sample_batch_size=4, images_per_prompt=2, advantage="group", train_batch_size=4,
                        gradient_accumulation_steps=1, timestep_fraction=0.5, num_epochs=2, checkpointing_epochs=1,
                        learning_rate=3e-2, clip_range=0.2, guidance_scale=3.0, quantize_base="int8",
                        quantize_text_encoders="int8", offload=True, cache_prompt_embeddings=True)
    run = ddpo.train(config)
    first = metrics(run)[0]
    # Sampling (LoRA not folded into an int8 weight) and the training forward are the same computation.
    assert first["approx_kl"] == 0.0 and first["clipfrac"] == 0.0
    before = unquantized_images(model, "flux", None)
    assert (before - unquantized_images(model, "flux", run / "final")).abs().max() > 1e-4


def quantized_transformer(model: str, scheme: str = "int8"):
    q = quantization.pipeline_quantization(scheme, "none", "transformer", [], torch.float32)
    pipe = load_pipeline(model, quantization=q)
    return pipe, family_of_pipeline(pipe)


def saved_bytes_and_gradients(family, denoiser, seed: int = 0):
    """Bytes autograd keeps in one training forward of the denoiser with its LoRA, and the LoRA's gradients."""
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, 4, 16, 16, generator=gen)
    cond = {"prompt_embeds": torch.randn(2, 24, 32, generator=gen), "pooled_embeds": torch.randn(2, 32, generator=gen)}
    denoiser.zero_grad(set_to_none=True)
    kept = SavedStorages(list(denoiser.parameters()))
    with kept.hooks():
        out = family.predict(denoiser, latents, torch.tensor([300.0, 700.0]), cond)
    out.square().mean().backward()
    return kept.total, [p.grad.clone() for p in denoiser.parameters() if p.requires_grad]


def with_lora(family, denoiser):
    torch.manual_seed(0)
    add_lora(denoiser, rank=4, target_modules=family.lora_targets)
    for name, p in denoiser.named_parameters():  # a LoRA B of zero would leave A without gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return denoiser


@needs_torchao
def test_the_quantized_backward_keeps_what_a_plain_base_keeps_and_gives_the_same_gradients(models):
    pipe, family = quantized_transformer(models["sd3"])
    denoiser = with_lora(family, family.denoiser(pipe))
    plain = load_pipeline(models["sd3"])
    plain_bytes, _ = saved_bytes_and_gradients(family, with_lora(family, family.denoiser(plain)))
    as_loaded, grads = saved_bytes_and_gradients(family, denoiser)
    assert quantization.keep_dequantized_weights_out_of_autograd(denoiser) > 0
    ours, ours_grads = saved_bytes_and_gradients(family, denoiser)
    # torchao's own linear keeps each dequantized weight for the backward; ours keeps what a plain base keeps
    assert as_loaded > 1.1 * plain_bytes and ours == plain_bytes
    for ours_grad, grad in zip(ours_grads, grads):
        torch.testing.assert_close(ours_grad, grad, rtol=1e-4, atol=1e-6)


@needs_torchao
def test_merging_leaves_a_quantized_base_alone(models):
    pipe, family = quantized_transformer(models["flux"], "float8")
    denoiser = family.denoiser(pipe)
    add_lora(denoiser, rank=4, target_modules=family.lora_targets)
    layer = denoiser.transformer_blocks[0].attn.to_q
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    x = torch.randn(3, layer.in_features)
    weight, expected = layer.get_base_layer().weight, layer(x)
    with merged_adapter(denoiser):
        assert layer.get_base_layer().weight is weight
        torch.testing.assert_close(layer(x), expected)


def test_offloaded_parts_visit_the_device_one_at_a_time(models):
    pipe = load_pipeline(models["sd"])
    family = family_of_pipeline(pipe)
    moves = []
    for part in family.frozen_modules(pipe):
        original = part.to
        part.to = lambda *args, _part=part, _to=original, **kwargs: (moves.append((_part, str(args[0]))), _to(*args, **kwargs))[1]
    offload = FrozenPartsOffload(family.frozen_modules(pipe), "cpu")
    family.denoiser(pipe).register_forward_pre_hook(offload.before_denoiser)
    moves.clear()
    cond = family.encode_prompts(pipe, ["a red circle"])
    assert offload.on_device is pipe.text_encoder and moves == [(pipe.text_encoder, "cpu")]
    latents = torch.randn(1, 4, 8, 8)
    family.predict(family.denoiser(pipe), latents, torch.tensor([10]), cond)
    assert offload.on_device is None and moves[-1] == (pipe.text_encoder, "cpu")
    images = family.decode_latents(pipe, latents)
    assert offload.on_device is pipe.vae and images.shape[-1] == 16  # the tiny VAE halves
    family.encode_prompts(pipe, ["a blue square"])  # the VAE goes back before the text encoder comes
    assert offload.on_device is pipe.text_encoder and moves[-2][0] is pipe.vae


def test_the_prompt_cache_encodes_each_prompt_once_with_the_same_conditioning(models):
    pipe = load_pipeline(models["sd3"])
    family = family_of_pipeline(pipe)
    calls = []
    pipe.text_encoder_3.register_forward_pre_hook(lambda module, args, kwargs: calls.append(len(args[0] if args else kwargs["input_ids"])), with_kwargs=True)
    cache = PromptEmbeddingCache(family, pipe, RESOLUTION)
    prompts = ["a red circle", "a red circle", "a blue square", "a red circle"]
    cached = cache.conditioning(prompts)
    again = cache.conditioning(["a blue square", "a red circle"])
    direct = family.encode_prompts(pipe, prompts, RESOLUTION)
    assert calls[:1] == [2] and len(calls) == 2  # two new prompts in one call; the second batch encoded nothing
    for key, value in direct.items():
        torch.testing.assert_close(cached[key], value, rtol=0, atol=1e-6)
        torch.testing.assert_close(again[key], value[[2, 0]], rtol=0, atol=1e-6)
