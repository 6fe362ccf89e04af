"""scripts/bench_gpu.py at its tiny size on the CPU: every benchmark runs and its FLOPs are counted, not guessed."""

from __future__ import annotations

import json

import pytest
from script_loader import load_script

bench_gpu = load_script("bench_gpu")


def test_tiny_benchmark_runs_and_counts_the_work_of_each_step(tmp_path, capsys):
    out = tmp_path / "bench.json"
    results = bench_gpu.main(["--tiny", "--steps", "1", "--warmup", "0", "--pairs", "2", "--ddpo_samples", "2",
                              "--ddpo_inference_steps", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert [r["bench"] for r in results] == ["dpo_lora", "dpo_full", "ddpo_lora"]
    assert json.loads(out.read_text())["results"] == results
    assert "32 px | precision bf16" in printed and "| MFU" not in printed  # no peak FLOP/s known for a CPU
    for r in results:
        assert r["steps_per_s"] > 0 and r["flops_per_step"] > 0

    # The counts against one UNet forward on the 4 images of 2 pairs: full fine-tuning with checkpointing is the
    # policy's forward, its recomputation and a backward of twice a forward, plus the reference's forward (5x);
    # LoRA's backward skips the frozen weights' gradients (about half of it), so it counts less.
    models = bench_gpu.Models(tiny=True, device=__import__("torch").device("cpu"))
    forward = bench_gpu.unet_forward_flops(models, 4)
    by_name = {r["bench"]: r["flops_per_step"] for r in results}
    assert by_name["dpo_full"] == pytest.approx(5 * forward, rel=0.1)
    assert 3 * forward < by_name["dpo_lora"] < by_name["dpo_full"]


def test_peak_flops_from_the_table_or_the_flag():
    import torch

    assert bench_gpu.peak_tflops(torch.device("cpu"), 500.0) == (500.0, "--peak_tflops")
    assert bench_gpu.peak_tflops(torch.device("cpu"), None)[0] is None


def test_without_a_gpu_the_full_size_run_is_refused(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit) as exit_:
        bench_gpu.main([])
    assert exit_.value.code == 2 and "--tiny" in capsys.readouterr().err


def test_sd15_forward_is_counted_without_weights_or_compute(capsys):
    # the figure the one-GPU recipes' estimates start from (configs/*_1gpu.yaml: 803 GFLOP)
    (result,) = bench_gpu.main(["--count_forward"])
    assert round(result["flops_per_step"] / 1e9) == 803
    assert "803.3 GFLOP per image" in capsys.readouterr().out
