"""scripts/bench_gpu.py at its tiny size on the CPU: every benchmark runs and its FLOPs are counted, not guessed."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from diffusers import AutoencoderKL
from script_loader import load_script

from align.pipeline import add_lora

bench_gpu = load_script("bench_gpu")


@pytest.mark.slow  # the suite's time budget on the 2-core CI machine
def test_tiny_benchmark_runs_and_counts_the_work_of_each_step(tmp_path, capsys):
    out = tmp_path / "bench.json"
    results = bench_gpu.main(["--tiny", "--steps", "1", "--warmup", "0", "--pairs", "2", "--ddpo_samples", "2",
                              "--ddpo_inference_steps", "2", "--grpo_samples", "2", "--grpo_inference_steps", "3",
                              "--nft_samples", "2", "--nft_inference_steps", "3", "--peak_tflops", "0.001",
                              "--json", str(out)])
    printed = capsys.readouterr().out
    assert [r["bench"] for r in results] == ["dpo_lora", "dpo_full", "ddpo_lora", "sdxl_dpo_lora", "sd35m_dpo_lora",
                                             "sd35m_grpo_lora", "sd35m_nft_lora", "flux_grpo_lora"]
    assert json.loads(out.read_text())["results"] == results
    assert "32 px | precision bf16" in printed and "| MFU" in printed and "| HFU" in printed
    for r in results:
        assert r["steps_per_s"] > 0 and r["flops_per_step"] > 0
        # HFU adds gradient checkpointing's recomputed forward (on by default) of the trained forwards to MFU's count
        assert r["hardware_flops_per_step"] == r["model_flops_per_step"] + r["trained_forward_flops_per_step"] > 0
        assert r["hfu"] / r["mfu"] == pytest.approx(r["hardware_flops_per_step"] / r["model_flops_per_step"])
    by_name = {r["bench"]: r for r in results}

    # The counts against one UNet forward on the 4 images of 2 pairs: full fine-tuning with checkpointing is the
    # policy's forward, its recomputation and a backward of twice a forward, plus the reference's forward (5x: counted,
    # and the hardware FLOPs); LoRA's backward skips the frozen weights' gradients (about half of it), so it counts less.
    models = bench_gpu.Models(tiny=True, device=torch.device("cpu"))
    forward = bench_gpu.unet_forward_flops(models, 4)
    assert by_name["dpo_full"]["flops_per_step"] == pytest.approx(5 * forward, rel=0.1)
    assert by_name["dpo_full"]["hardware_flops_per_step"] == pytest.approx(5 * forward, rel=1e-6)
    assert 3 * forward < by_name["dpo_lora"]["flops_per_step"] < by_name["dpo_full"]["flops_per_step"]
    # Model FLOPs: a trained forward 3x, a forward without gradient 1x, exactly; LoRA's forward has its own FLOPs.
    assert by_name["dpo_full"]["model_flops_per_step"] == pytest.approx(4 * forward, rel=1e-6)
    assert by_name["dpo_lora"]["model_flops_per_step"] == pytest.approx(
        3 * unet_forward_flops(models, 4, lora_rank=8) + forward, rel=1e-6)

    # SDXL and SD3.5 LoRA DPO: the policy's forward, its recomputation, its backward (input gradients only, about one
    # forward) and the reference's forward on the 4 images: between 3 and 5 forwards of the same denoiser.
    for bench, arch in (("sdxl_dpo_lora", "sdxl"), ("sd35m_dpo_lora", "sd35m")):
        forward = tiny_forward_flops(arch, 4)
        assert 3 * forward < by_name[bench]["flops_per_step"] < 5 * forward, bench

    # The online-RL steps run the trainer's sampler and objective: their model FLOPs are exactly the forwards they
    # should make (one-image forwards with the LoRA, or without it where the adapter is off) and the VAE's decode.
    vae = AutoencoderKL(**bench_gpu.TINY_SD3_VAE)
    with torch.no_grad():
        decode = bench_gpu.count_flops(lambda: vae.decode(torch.zeros(2, 16, bench_gpu.TINY_LATENT, bench_gpu.TINY_LATENT)))
    policy, reference = tiny_forward_flops("sd35m", 1, lora_rank=4), tiny_forward_flops("sd35m", 1)
    # Flow-GRPO on SD3.5: sampling 2 images x 3 steps x 2 (CFG); 2 trained steps x 2 images, each the guided policy
    # (2 rows, both with gradient: 3x) and the adapter-off reference for the KL (2 rows).
    grpo = by_name["sd35m_grpo_lora"]
    assert grpo["model_flops_per_step"] == 12 * policy + 2 * 2 * (3 * 2 * policy + 2 * reference) + decode
    assert grpo["trained_forward_flops_per_step"] == 2 * 2 * 2 * policy
    # DiffusionNFT on SD3.5: the old policy samples 2 images x 3 ODE steps without CFG; 2 trained steps x 2 images,
    # each the policy (3x), the old policy (the same LoRA, swapped in) and the adapter-off reference.
    nft = by_name["sd35m_nft_lora"]
    assert nft["model_flops_per_step"] == 6 * policy + 2 * 2 * (3 * policy + policy + reference) + decode
    assert nft["trained_forward_flops_per_step"] == 2 * 2 * policy
    # FLUX.1-dev's recipe: the guidance embedding instead of CFG (one forward a step) and no KL.
    policy = tiny_forward_flops("flux-dev", 1, lora_rank=4)
    assert by_name["flux_grpo_lora"]["model_flops_per_step"] == 6 * policy + 2 * 2 * 3 * policy + decode
    # DDPO on the SD v1.5 UNet: 2 images x 2 DDIM steps x 2 (CFG), the SD VAE's decode, every step trained with CFG.
    with torch.no_grad():
        decode = bench_gpu.count_flops(lambda: models.vae.decode(torch.zeros(2, 4, 16, 16)))
    policy = unet_forward_flops(models, 1, lora_rank=8)
    assert by_name["ddpo_lora"]["model_flops_per_step"] == 8 * policy + 2 * 2 * 3 * 2 * policy + decode


TINY_ARGS = ["--tiny", "--steps", "1", "--warmup", "0", "--pairs", "2", "--ddpo_samples", "2", "--ddpo_inference_steps", "2",
             "--grpo_samples", "2", "--grpo_inference_steps", "3", "--nft_samples", "2", "--nft_inference_steps", "3"]


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
def test_quantized_base_variants_run_and_the_planner_predicts_each_peak(capsys):
    only = ["--only", "dpo_lora,dpo_full,sd35m_grpo_lora"]
    plain = {r["bench"]: r for r in bench_gpu.main(TINY_ARGS + only)}
    quantized = {r["bench"]: r for r in bench_gpu.main(TINY_ARGS + only + ["--quantized_base", "int8"])}
    printed = capsys.readouterr().out
    assert "dpo_lora (int8 base)" in printed and "dpo_full (int8 base)" not in printed and "planned peak" in printed
    assert quantized["dpo_full"]["quantized_base"] == "none"  # a full fine-tuning has no frozen base
    for bench in ("dpo_lora", "sd35m_grpo_lora"):
        assert quantized[bench]["quantized_base"] == "int8" and quantized[bench]["steps_per_s"] > 0
        # an int8 base plans less than the plain one (DPO's frozen base is fp32, the online-RL trainer's bf16)
        assert 0 < quantized[bench]["planned_memory_gb"] < plain[bench]["planned_memory_gb"]
    assert quantized["dpo_full"]["planned_memory_gb"] == plain["dpo_full"]["planned_memory_gb"]


def unet_forward_flops(models, batch: int, lora_rank: int | None = None) -> int:
    """Counted FLOPs of the tiny UNet's forward on ``batch`` images, with the benchmark's LoRA when a rank is given."""
    if lora_rank is None:
        return bench_gpu.unet_forward_flops(models, batch)
    unet = add_lora(models.fresh_unet(), rank=lora_rank)
    latents, text = torch.zeros((batch, 4, 16, 16)), torch.zeros((batch, 77, bench_gpu.TINY_UNET["cross_attention_dim"]))
    with torch.no_grad():
        return bench_gpu.count_flops(lambda: unet(latents, torch.full((batch,), 500), text))


def tiny_forward_flops(arch_name: str, batch: int, lora_rank: int | None = None) -> float:
    """Counted FLOPs of the tiny denoiser's forward on ``batch`` images, as the benchmark builds and calls it (with
    the online-RL steps' LoRA, alpha 2 x rank on the family's targets, when a rank is given)."""
    arch = bench_gpu.ARCHS[arch_name]
    model = bench_gpu.build_denoiser(arch, True, "cpu")
    if lora_rank is not None:
        add_lora(model, rank=lora_rank, alpha=2 * lora_rank,
                 target_modules=bench_gpu.family_of_arch(arch, model).lora_targets)
    side = bench_gpu.TINY_LATENT
    latents = torch.zeros((batch, bench_gpu.latent_channels(arch, model), side, side))
    cond = bench_gpu.random_conditioning(arch, model, batch, side, True, "cpu")
    with torch.no_grad():
        return bench_gpu.count_flops(lambda: bench_gpu.predict(arch, model, latents, torch.full((batch,), 500.0), cond))


def test_model_and_hardware_flops_from_the_counted_parts():
    # a full fine-tuning step with checkpointing: forward F, recomputation F, backward 2F, a no-grad forward G
    flops = bench_gpu.StepFlops(counted=4 * 10 + 7, backward=3 * 10, trained_forward=10)
    assert flops.model == 3 * 10 + 7  # the backward taken as 2F whatever was counted in it, no recomputation
    assert flops.hardware(checkpointing=True) == 4 * 10 + 7 and flops.hardware(checkpointing=False) == flops.model


def test_peak_flops_from_the_table_or_the_flag():
    assert bench_gpu.peak_tflops(torch.device("cpu"), 500.0) == (500.0, "--peak_tflops")
    assert bench_gpu.peak_tflops(torch.device("cpu"), None)[0] is None


def test_without_a_gpu_the_full_size_run_is_refused(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit) as exit_:
        bench_gpu.main([])
    assert exit_.value.code == 2 and "--tiny" in capsys.readouterr().err


def test_forwards_are_counted_without_weights_or_compute(capsys):
    # the figures the one-GPU recipes' estimates start from (configs/*_1gpu.yaml: 803 GFLOP for SD v1.5 at 512 px)
    (result,) = bench_gpu.main(["--count_forward"])
    assert round(result["flops_per_step"] / 1e9) == 803
    assert "sd15 denoiser forward at 512 px: 803.3 GFLOP per image" in capsys.readouterr().out
    # SD3.5 Medium at 512 px on the meta device (configs/sd35_grpo_lora_1gpu.yaml); 1024 px has 4x the image tokens
    (small,) = bench_gpu.main(["--count_forward", "sd35m:512"])
    assert small["bench"] == "sd35m_forward_512" and 2e12 < small["flops_per_step"] < 1e13
    with pytest.raises(SystemExit, match="unknown architecture 'sd4'"):
        bench_gpu.main(["--count_forward", "sd4:512"])
