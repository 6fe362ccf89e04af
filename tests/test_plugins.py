"""Algorithms, samplers and model families as plug-ins: each registry entry is complete and read by the trainer, the
config checks and --help; the flags users type are those of 25f6eaf; nothing outside the registries names an
algorithm, sampler or family; the trainers' functions stay short; the Diffusion-DPO step runs on its own."""

from __future__ import annotations

import ast
import dataclasses
import json
import typing
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from align.cli import build_parser
from align.families import FAMILIES, family_of_pipeline
from align.pipeline import frozen_copy, load_pipeline
from align.sampling import ddim_sampler, flow_ode_sampler, flow_sde_sampler
from align.sampling.base import Sampler
from align.sampling.registry import SAMPLERS, sampler_entry, sampler_names
from align.train import ddpo
from align.train.ddpo_config import DDPOConfig
from align.train.dpo import diffusion_dpo_step
from align.train.dpo_config import DPOConfig
from align.train.losses import per_sample_mse
from align.train.objectives import ALGORITHMS, OPTIONS, algorithm
from align.train.objectives.base import Objective
from align.train.reward_model import RewardTrainConfig

ROOT = Path(__file__).resolve().parent.parent
PINNED = json.loads((ROOT / "tests" / "data" / "trainer_flags_25f6eaf.json").read_text())


# ------------------------------------------------------------------ the registries


def test_every_algorithm_entry_is_complete_and_its_options_are_the_trainers_flags():
    names = [entry.name for entry in ALGORITHMS]
    assert len(set(names)) == len(names)
    config_fields = {f.name for f in dataclasses.fields(DDPOConfig)}
    for entry in ALGORITHMS:
        assert issubclass(entry.objective, Objective) and entry.summary and entry.method.paper
        for flow in (False, True):  # its default sampler exists for both kinds of family and suits it
            sampler = sampler_entry(entry.defaults(flow)["sampler"], flow)
            assert sampler is not None and (sampler.stochastic or not entry.needs_log_probs)
        assert entry.curves and all(curve.keys for curve in entry.curves)
        for field in dataclasses.fields(entry.options) if entry.options is not None else ():
            assert field.name in config_fields and field.metadata["group"] == f"--algorithm {entry.name}"
    assert set(OPTIONS) <= set(DDPOConfig.__mro__)


def test_every_sampler_entry_names_a_sampler_of_one_kind_of_family():
    assert len({(e.name, e.flow) for e in SAMPLERS}) == len(SAMPLERS)
    assert set(sampler_names(False)) == {"ddim", "ode"}
    assert set(sampler_names(True)) == {"sde", "cps", "ode", "dpm2", "dance", "mix"}
    for entry in SAMPLERS:
        assert entry.title and callable(entry.build)


def test_the_objectives_and_samplers_implement_their_interfaces():
    for cls in (ddim_sampler.DDIMSampler, flow_sde_sampler.FlowSampler, flow_ode_sampler.ODESampler):
        assert issubclass(cls, Sampler) and not getattr(cls, "__abstractmethods__", None)
    for entry in ALGORITHMS:
        assert not entry.objective.__abstractmethods__


def test_unset_options_take_the_algorithms_values_for_the_family():
    for entry in ALGORITHMS:
        for flow in (False, True) if not entry.flow_only else (True,):
            config = DDPOConfig(prompts="x", algorithm=entry.name)
            config.resolve_for_family(flow)
            for name, value in entry.defaults(flow).items():
                assert getattr(config, name) == value


# ------------------------------------------------------------------ the flags of 25f6eaf


@pytest.mark.parametrize("config_class", [DDPOConfig, DPOConfig, RewardTrainConfig], ids=lambda c: c.__name__)
def test_the_flags_of_25f6eaf_keep_their_names_defaults_and_types(config_class):
    """Every flag users typed on 25f6eaf (tests/data/trainer_flags_25f6eaf.json) is still there, with its default and
    type; flags added since (a new algorithm's) are extra."""
    hints = typing.get_type_hints(config_class)
    now = {f.name: {"default": f.default if f.default is not dataclasses.MISSING else f.default_factory(),
                    "type": str(hints[f.name]).replace("typing.", "")}
           for f in dataclasses.fields(config_class) if f.init}
    pinned = PINNED[config_class.__name__]
    assert {name: now.get(name) for name in pinned} == pinned


def test_help_shows_each_algorithms_options_in_a_section_of_their_own():
    text = build_parser(DDPOConfig, prog="align-ddpo").format_help()
    for entry in ALGORITHMS:
        for field in dataclasses.fields(entry.options) if entry.options is not None else ():
            section = text[text.index(f"options of --algorithm {entry.name}:"):]
            assert f"--{field.name}" in section.split("\n\n")[0]
        assert f"{entry.name}: {entry.summary}" in " ".join(text.split())


# ------------------------------------------------------------------ fences


REGISTRY_FILES = {"align/train/objectives", "align/sampling", "align/families"}


def _is_registry_file(path: Path) -> bool:
    return any(str(path.relative_to(ROOT)).startswith(prefix) for prefix in REGISTRY_FILES)


def test_no_family_algorithm_or_sampler_is_named_as_a_string_outside_the_registries():
    """``family.name == "flux"``, ``config.algorithm == "nft"``, ``config.sampler in ("ode", ...)``: what differs
    is asked of the registry entry instead."""
    names = ({f.name for f in FAMILIES} | {e.name for e in ALGORITHMS} | {e.name for e in SAMPLERS}
             | {n for f in FAMILIES for n in f.pipeline_class_names} | {"unet", "transformer"})
    found = []
    for path in sorted((ROOT / "align").rglob("*.py")):
        if _is_registry_file(path):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            attribute = any(isinstance(s, ast.Attribute) and s.attr in ("name", "algorithm", "sampler", "denoiser_name")
                            for s in sides)
            strings = {c.value for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            if attribute and strings & names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found


def test_the_trainers_functions_stay_short():
    """No function in align/train/ over 100 lines or 8 parameters (self and cls aside)."""
    too_long = []
    for path in sorted((ROOT / "align" / "train").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs) + bool(args.vararg) + bool(args.kwarg)
                count -= bool(args.args and args.args[0].arg in ("self", "cls"))
                if node.end_lineno - node.lineno + 1 > 100 or count > 8:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not too_long


# ------------------------------------------------------------------ the Diffusion-DPO step on its own


def test_the_dpo_step_alone_is_the_papers_loss_on_its_draws(tiny_model):
    pipe = load_pipeline(tiny_model)
    family = family_of_pipeline(pipe)
    policy, reference = pipe.unet, frozen_copy(pipe.unet)
    shape = (2, *family.latent_shape(pipe, family.native_resolution(pipe)))
    latents_w, latents_l = torch.randn(shape, generator=torch.Generator().manual_seed(1)).chunk(2)
    cond = family.encode_prompts(pipe, ["a red circle"], 32)

    def reference_prediction(noisy, timesteps, c):
        with torch.no_grad():
            return family.predict(reference, noisy, timesteps, c)

    def step(beta):
        return diffusion_dpo_step(family, pipe.scheduler, policy, reference_prediction, (latents_w, latents_l, cond),
                                  torch.Generator().manual_seed(7), beta, "cpu")

    loss, metrics = step(100.0)
    assert float(loss.detach()) == pytest.approx(float(torch.log(torch.tensor(2.0))), abs=1e-6)  # the policy is the reference
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 1e-2)
    loss, metrics = step(100.0)
    gen = torch.Generator().manual_seed(7)  # the same draws, by hand: one noise and one timestep per pair
    noise = torch.randn(latents_w.shape, generator=gen)
    t = family.draw_training_timesteps(pipe.scheduler, 1, gen)
    noisy, target = family.noisy_and_target(pipe.scheduler, torch.cat([latents_w, latents_l]), torch.cat([noise, noise]),
                                            torch.cat([t, t]))
    cond2 = {k: torch.cat([v, v]) for k, v in cond.items()}
    with torch.no_grad():
        err_w, err_l = per_sample_mse(family.predict(policy, noisy, torch.cat([t, t]), cond2), target).chunk(2)
        ref_w, ref_l = per_sample_mse(family.predict(reference, noisy, torch.cat([t, t]), cond2), target).chunk(2)
    expected = -F.logsigmoid(-0.5 * 100.0 * ((err_w - ref_w) - (err_l - ref_l))).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-7)
    loss.backward()
    assert all(p.grad is not None for p in policy.parameters() if p.requires_grad)
    assert all(p.grad is None for p in reference.parameters())


def test_dry_run_checks_what_the_run_checks(tiny_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        ddpo.main(["--model", tiny_model, "--prompts", "testbed:4", "--sampler", "sde", "--dry_run", "true",
                   "--output_dir", str(tmp_path / "run")])
    assert exit_.value.code == 2 and "--sampler sde is not a sampler of DDIM models" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert algorithm("nft").objective.keeps_old_policy(DDPOConfig(prompts="x"))
