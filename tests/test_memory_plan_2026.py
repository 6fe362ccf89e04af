"""The memory planner (--dry_run) on the 2026 families' tiny pipelines (Qwen-Image, Qwen-Image 2.1, FLUX.2 [klein],
Z-Image, FLUX.1 Kontext with its source latents; Qwen-Image-Edit(-Plus) in their own test files): the activations
autograd keeps in one real training forward (with and without gradient checkpointing) and the whole DPO setup, within
15% of the plan; and the dry run from Qwen-Image's, Qwen-Image 2.1's, Qwen-Image-Edit's, FLUX.2's, Z-Image's and
FLUX.1 Kontext's real config files (experiments/plan_2026_models.py)."""

from __future__ import annotations

import types

import pytest
import torch
from test_memory_plan import TOLERANCE, assert_close, nbytes

from align.families import family_of_pipeline
from align.pipeline import add_lora, load_pipeline
from align.testing.tiny_flux2 import build_tiny_flux2_klein
from align.testing.tiny_kontext import build_tiny_kontext
from align.testing.tiny_qwen import build_tiny_qwenimage
from align.testing.tiny_qwen21 import build_tiny_qwen21
from align.testing.tiny_zimage import build_tiny_zimage
from align.train.memory_model import SavedStorages, plan_run
from align.train.memory_plan import ddp_plan, total
from experiments.plan_2026_models import MODELS, check_totals, main

BUILDERS = {"qwenimage": build_tiny_qwenimage, "qwenimage21": build_tiny_qwen21, "flux2": build_tiny_flux2_klein,
            "zimage": build_tiny_zimage, "kontext": build_tiny_kontext}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tiny(request, tmp_path_factory):
    return str(BUILDERS[request.param](tmp_path_factory.mktemp(request.param)))


def settings(model: str, finetune: str, checkpointing: bool):
    return types.SimpleNamespace(model=model, finetune=finetune, lora_rank=4, lora_alpha=None, mixed_precision="no",
                                 use_8bit_adam=False, gradient_checkpointing=checkpointing, train_batch_size=2,
                                 resolution=32)


def training_inputs(pipe, model: str, samples: int) -> tuple[torch.Tensor, dict]:
    """Random latents and conditioning of the planner's shapes at 32 px (an editing family's source latents too)."""
    family = family_of_pipeline(pipe)
    config = dict(family.denoiser(pipe).config)
    cond = {key: torch.randn(shape)
            for key, shape in family.conditioning_shapes(config, samples, family.text_tokens(model)).items()}
    if family.edits:
        cond["source_latents"] = torch.randn(samples, *family.source_latent_shape_of(config, dict(pipe.vae.config), 32))
    return torch.randn(samples, *family.latent_shape(pipe, 32)), cond


def measured_activations(model: str, samples: int, checkpointing: bool) -> int:
    """Bytes autograd keeps after one real training forward of the family's prediction at the planned shapes (with
    checkpointing: the blocks' inputs and what stays outside them, plus the largest block's own saved tensors)."""
    pipe = load_pipeline(model)
    family = family_of_pipeline(pipe)
    denoiser = family.denoiser(pipe)
    params = list(denoiser.parameters())
    kept, blocks = SavedStorages(params), [0]

    def real_checkpoint(block, *args):
        for arg in args:
            if isinstance(arg, torch.Tensor):
                kept.add(arg)
        inside = SavedStorages(params)
        with inside.hooks():
            block(*args)
        blocks.append(inside.total)
        return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)

    if checkpointing:
        denoiser.enable_gradient_checkpointing(gradient_checkpointing_func=real_checkpoint)
    latents, cond = training_inputs(pipe, model, samples)
    with kept.hooks():
        out = family.predict(denoiser, latents, torch.rand(samples) * 1000, cond)
    out.square().mean().backward()
    return kept.total + max(blocks)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_planned_activations_are_the_measured(tiny, checkpointing):
    planned = plan_run(settings(tiny, "full", checkpointing))
    measured = measured_activations(tiny, planned.forward_batch, checkpointing)
    assert_close(planned.shape.activation_bytes, measured, f"activations (checkpointing {checkpointing})")


def measured_lora_setup(model: str) -> dict[str, int]:
    """Bytes of each part the trainers' LoRA setup holds after one AdamW step of a training forward."""
    pipe = load_pipeline(model)
    family = family_of_pipeline(pipe)
    denoiser = family.denoiser(pipe)
    add_lora(denoiser, rank=4, target_modules=family.lora_targets)
    params = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    latents, cond = training_inputs(pipe, model, 2)
    family.predict(denoiser, latents, torch.tensor([100.0, 900.0]), cond).square().mean().backward()
    optimizer.step()
    return {"trained parameters (fp32)": nbytes(params),
            "frozen denoiser weights": nbytes(p for p in denoiser.parameters() if not p.requires_grad),
            "gradients": nbytes(p.grad for p in params),
            "optimizer states": nbytes(t for state in optimizer.state.values() for t in state.values() if t.numel() > 1),
            "text encoders + VAE": nbytes(p for m in family.frozen_modules(pipe) for p in m.parameters())}


def test_planned_lora_setup_is_the_measured(tiny):
    plan = ddp_plan(plan_run(settings(tiny, "lora", False)).shape, 1)
    measured = measured_lora_setup(tiny)
    for part, value in measured.items():
        assert_close(plan[part], value, part)
    assert abs(total(plan) - plan["activations"] - sum(measured.values())) <= TOLERANCE * sum(measured.values())


def test_real_configs_give_the_published_sizes():
    check_totals()  # exits when a transformer is more than 5% off its published size
    assert set(MODELS) == {"qwen-image", "qwen-image-2.1", "qwen-image-edit", "flux2-dev", "flux2-klein-4b", "z-image-turbo",
                           "flux1-kontext-dev"}


@pytest.mark.slow  # about a minute: nine dry runs on the real models' meta-device parts
def test_dry_run_of_every_2026_config_from_the_real_config_files(capsys):
    main([])
    out = capsys.readouterr().out
    assert out.count("[dry run] this launch") == 9 and "qwenimage (20,430,401,088 denoiser parameters" in out
    assert "qwenimage-edit (20,430,401,088 denoiser parameters" in out
    assert "qwenimage21 (7,115,124,736 denoiser parameters" in out
