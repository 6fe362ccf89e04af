"""fp16 uses accelerate's gradient scaler: the DPO and DDPO steps go through accelerator.backward (the loss scaled),
accelerator.clip_grad_norm_ (the gradients unscaled first) and the prepared optimiser (scaler.step, update).

accelerate 1.16 creates the GradScaler for fp16 only off the CPU (accelerator.py: the fp16 branch of
Accelerator.__init__ requires `self.device.type != "cpu"`; on a CPU fp16 means no autocast and no scaler). So the
trainers' runs here get what accelerate builds on a GPU: an Accelerator whose fp16 set-up is the GPU one (native
autocast in float16, which torch runs on a CPU, and a torch.amp.GradScaler) with every scaler call recorded."""

from __future__ import annotations

import json
import math

import accelerate
import pytest
import torch

from align.testing.noise_pairs import write_noise_pairs
from align.train import ddpo, dpo
from align.train.accelerator import make_accelerator
from align.train.ddpo import DDPOConfig
from align.train.dpo import DPOConfig

INIT_SCALE = 2.0**10


class RecordingScaler(torch.amp.GradScaler):
    """A GradScaler that records its calls, whether each step found an overflow, and its scale after each update.
    ``overflow_at`` names optimiser steps (1-based) at which an inf is put into one gradient before it is
    unscaled: an overflow made on purpose, the same on every machine (whether a real loss overflows fp16
    depends on the CPU's kernels)."""

    def __init__(self, overflow_at: tuple[int, ...] = ()):
        super().__init__("cpu", init_scale=INIT_SCALE)
        self.events: list[str] = []
        self.overflow_at, self.unscales = overflow_at, 0
        self.found_inf: list[bool] = []
        self.scales: list[float] = []
        self.optimizers: list = []

    def scale(self, outputs):
        self.events.append("scale")
        return super().scale(outputs)

    def unscale_(self, optimizer):
        self.events.append("unscale")
        self.unscales += 1
        if self.unscales in self.overflow_at:
            grad = next(p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
            grad.view(-1)[0] = math.inf
        return super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        self.events.append("step")
        self.optimizers.append(optimizer)
        result = super().step(optimizer, *args, **kwargs)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        self.found_inf.append(sum(v.item() for v in found.values()) > 0)
        return result

    def update(self, new_scale=None):
        self.events.append("update")
        result = super().update(new_scale)
        self.scales.append(self.get_scale())
        return result


@pytest.fixture
def fp16_as_on_a_gpu(monkeypatch, request):
    """accelerate.Accelerator with a recording GradScaler for fp16, as accelerate sets it up on a GPU (indirect
    parametrisation may name the steps at which it overflows, see RecordingScaler)."""
    scalers: list[RecordingScaler] = []
    overflow_at = getattr(request, "param", ())

    class Fp16AsOnAGpu(accelerate.Accelerator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.state.mixed_precision == "fp16":
                assert self.scaler is None and not self.native_amp  # what accelerate itself does on a CPU
                self.native_amp, self.scaler = True, RecordingScaler(overflow_at)
                scalers.append(self.scaler)

        def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
            if self.scaler is not None:
                self.scaler.events.append("clip")
            return super().clip_grad_norm_(parameters, max_norm, norm_type)

    monkeypatch.setattr(accelerate, "Accelerator", Fp16AsOnAGpu)
    return scalers


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_noise_pairs(tmp_path_factory.mktemp("pairs"), 4)


def expected_events(micro_batches_per_step: int, steps: int) -> list[str]:
    # the loss scaled at every backward; before the step the gradients unscaled by the clipping; then step, update
    return (["scale"] * micro_batches_per_step + ["clip", "unscale", "step", "update"]) * steps


def test_accelerate_itself_gives_no_scaler_for_fp16_on_a_cpu(capsys):
    """Why the tests below stand in for the GPU set-up (if accelerate starts to scale on a CPU, this says so)."""
    accelerator, precision = make_accelerator("fp16", "probe", cpu=True)
    assert precision == "fp16" and accelerator.scaler is None and not accelerator.native_amp
    assert "mixed precision: fp16 (from --mixed_precision)\n" in capsys.readouterr().out


def assert_the_scalers_rule(scaler: RecordingScaler) -> None:
    """Every step that found an overflow halved the scale and left AdamW where it was; every other step kept the
    scale (growth comes after 2000 clean steps) and was taken."""
    before = [INIT_SCALE, *scaler.scales[:-1]]
    assert scaler.scales == [s / 2 if inf else s for s, inf in zip(before, scaler.found_inf)]
    assert taken_steps(scaler.optimizers[-1]) == scaler.found_inf.count(False)


def taken_steps(optimizer) -> int:
    """How many steps AdamW really took (its per-parameter step count; a skipped step leaves it as it was)."""
    return max((int(state["step"]) for state in optimizer.state.values() if "step" in state), default=0)


@pytest.mark.parametrize("fp16_as_on_a_gpu", [(1,)], indirect=True, ids=["overflow-at-step-1"])
@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_fp16_dpo_steps_go_through_the_gradient_scaler(fp16_as_on_a_gpu, tiny_model, pairs, tmp_path, finetune, capsys):
    config = DPOConfig(model=tiny_model, dataset=pairs, output_dir=str(tmp_path / "run"), finetune=finetune, lora_rank=4,
                       mixed_precision="fp16", resolution=None, train_batch_size=1, gradient_accumulation_steps=2, max_steps=2,
                       learning_rate=1e-3, scale_lr=False, lr_warmup_steps=0, beta=5000.0, caption_dropout=0.0,
                       num_inference_steps=2, checkpointing_steps=10, report_to="none")
    run = dpo.train(config)
    assert "[dpo] mixed precision: fp16 (from --mixed_precision) with accelerate's gradient scaler" in capsys.readouterr().out
    (scaler,) = fp16_as_on_a_gpu
    assert scaler.events == expected_events(2, 2)
    # What the scaler is for, asserted as a property (whether β 5000 overflows fp16 by itself depends on the CPU's
    # kernels): step 1 overflows (an inf put into a gradient) and is skipped; every step that finds an overflow
    # halves the scale and leaves AdamW where it was; a step without one keeps the scale (growth comes after 2000).
    assert scaler.found_inf[0] is True
    assert_the_scalers_rule(scaler)
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["loss"] - math.log(2)) < 1e-3  # the reference under the same fp16 autocast as the policy


def test_fp16_ddpo_updates_go_through_the_gradient_scaler(fp16_as_on_a_gpu, tiny_model, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\n")
    config = DDPOConfig(model=tiny_model, prompts=str(prompts), output_dir=str(tmp_path / "run"), reward="jpeg-compressibility",
                        mixed_precision="fp16", report_to="none", num_inference_steps=2, samples_per_epoch=4,
                        sample_batch_size=2, train_batch_size=1, gradient_accumulation_steps=2, timestep_fraction=1.0,
                        num_epochs=1, checkpointing_epochs=1, learning_rate=1e-3, clip_range=0.2)
    run = ddpo.train(config)
    assert "[ddpo] mixed precision: fp16 (from --mixed_precision) with accelerate's gradient scaler" in capsys.readouterr().out
    (scaler,) = fp16_as_on_a_gpu
    # 4 samples, 2 per update: 2 updates of 2 micro-batches x 2 trained timesteps (one backward each)
    assert scaler.events == expected_events(4, 2)
    assert_the_scalers_rule(scaler)  # whether a step overflows by itself depends on the CPU's kernels
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file()
