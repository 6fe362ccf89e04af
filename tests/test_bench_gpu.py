"""scripts/bench_gpu.py at its tiny size on the CPU: every benchmark runs and its FLOPs are counted, not guessed."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import AutoencoderKL
from script_loader import load_script

bench_gpu = load_script("bench_gpu")


def test_tiny_benchmark_runs_and_counts_the_work_of_each_step(tmp_path, capsys):
    out = tmp_path / "bench.json"
    results = bench_gpu.main(["--tiny", "--steps", "1", "--warmup", "0", "--pairs", "2", "--ddpo_samples", "2",
                              "--ddpo_inference_steps", "2", "--grpo_samples", "2", "--grpo_inference_steps", "3",
                              "--json", str(out)])
    printed = capsys.readouterr().out
    assert [r["bench"] for r in results] == ["dpo_lora", "dpo_full", "ddpo_lora", "sdxl_dpo_lora", "sd35m_dpo_lora",
                                             "sd35m_grpo_lora", "flux_grpo_lora"]
    assert json.loads(out.read_text())["results"] == results
    assert "32 px | precision bf16" in printed and "| MFU" not in printed  # no peak FLOP/s known for a CPU
    for r in results:
        assert r["steps_per_s"] > 0 and r["flops_per_step"] > 0

    # The counts against one UNet forward on the 4 images of 2 pairs: full fine-tuning with checkpointing is the
    # policy's forward, its recomputation and a backward of twice a forward, plus the reference's forward (5x);
    # LoRA's backward skips the frozen weights' gradients (about half of it), so it counts less.
    models = bench_gpu.Models(tiny=True, device=torch.device("cpu"))
    forward = bench_gpu.unet_forward_flops(models, 4)
    by_name = {r["bench"]: r["flops_per_step"] for r in results}
    assert by_name["dpo_full"] == pytest.approx(5 * forward, rel=0.1)
    assert 3 * forward < by_name["dpo_lora"] < by_name["dpo_full"]

    # SDXL and SD3.5 LoRA DPO: the policy's forward, its recomputation, its backward (input gradients only, about one
    # forward) and the reference's forward on the 4 images: between 3 and 5 forwards of the same denoiser.
    for bench, arch in (("sdxl_dpo_lora", "sdxl"), ("sd35m_dpo_lora", "sd35m")):
        forward = tiny_forward_flops(arch, 4)
        assert 3 * forward < by_name[bench] < 5 * forward, bench
    # Flow-GRPO: sampling runs 2 images x 3 steps x 2 (CFG) forwards, then the VAE decodes the 2 images; training
    # takes 2 trained steps x 2 images, each a conditional forward + recomputation + backward (~1 forward), an
    # unconditional forward and the reference's two: 5 to 8 forwards (measured: 6.5).
    one_image = tiny_forward_flops("sd35m", 1)

    vae = AutoencoderKL(**bench_gpu.TINY_SD3_VAE)
    with torch.no_grad():
        decode = bench_gpu.count_flops(lambda: vae.decode(torch.zeros(2, 16, bench_gpu.TINY_LATENT, bench_gpu.TINY_LATENT)))
    training = by_name["sd35m_grpo_lora"] - 2 * 3 * 2 * one_image - decode
    assert 2 * 2 * 5 * one_image < training < 2 * 2 * 8 * one_image
    # FLUX.1-dev's recipe: the guidance embedding instead of CFG (one forward a sampling step) and no KL, so a trained
    # step is the conditional forward, its recomputation and its backward: 2.5 to 5 forwards (measured: 3.6).
    one_image = tiny_forward_flops("flux-dev", 1)
    training = by_name["flux_grpo_lora"] - 2 * 3 * one_image - decode
    assert 2 * 2 * 2.5 * one_image < training < 2 * 2 * 5 * one_image


def tiny_forward_flops(arch_name: str, batch: int) -> float:
    """Counted FLOPs of the tiny denoiser's forward on ``batch`` images, as the benchmark builds and calls it."""
    arch = bench_gpu.ARCHS[arch_name]
    model = bench_gpu.build_denoiser(arch, True, "cpu")
    side = bench_gpu.TINY_LATENT
    latents = torch.zeros((batch, bench_gpu.latent_channels(arch, model), side, side))
    cond = bench_gpu.random_conditioning(arch, model, batch, side, True, "cpu")
    with torch.no_grad():
        return bench_gpu.count_flops(lambda: bench_gpu.predict(arch, model, latents, torch.full((batch,), 500.0), cond))


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
