"""The online-RL trainer's algorithms end to end on tiny models: DiffusionNFT and AWM on an epsilon-prediction UNet (SD)
and a flow transformer (SD3), Flow-CPS on-policy, the old policy through a resume, and the refusals of combinations
that cannot run. The objectives' maths against the authors' code: tests/test_nft_reference.py,
tests/test_awm_reference.py, tests/test_flow_grpo_reference.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from align.train import ddpo
from align.train.ddpo_config import DDPOConfig
from align.train.old_policy import OldPolicy


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red circle\na blue square\n")
    return str(path)


def config(model, prompt_file, out, **overrides) -> DDPOConfig:
    settings = dict(model=model, reward="jpeg-compressibility", prompts=prompt_file, output_dir=str(out), report_to="none",
                    num_inference_steps=4, resolution=32, samples_per_epoch=4, sample_batch_size=4, images_per_prompt=2,
                    advantage="global-std", train_batch_size=2, gradient_accumulation_steps=1, timestep_fraction=0.5,
                    num_epochs=2, checkpointing_epochs=1, learning_rate=3e-2, guidance_scale=3.0, lora_alpha=8.0)
    return DDPOConfig(**{**settings, **overrides})


def epochs(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def lora(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "pytorch_lora_weights.safetensors"))


@pytest.mark.parametrize("algorithm, kind", [("nft", "sd"), ("nft", "sd3"), ("nft", "flux"), ("nft", "sdxl"),
                                             ("awm", "sd"), ("awm", "sd3")])
def test_forward_process_objectives_train_every_family(family_models, tiny_model, prompt_file, tmp_path, algorithm, kind):
    model = tiny_model if kind == "sd" else family_models(kind)
    extra = dict(kl_coef=1e-4) if algorithm == "nft" else dict(kl_coef=1e-4, ema_kl_coef=1.0, clip_range=1.0)
    run = ddpo.train(config(model, prompt_file, tmp_path / f"{algorithm}-{kind}", algorithm=algorithm, train_batch_size=4,
                            **extra))
    records = epochs(run)
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert records[-1]["global_step"] == 2  # one optimiser step an epoch
    recorded = (run / "config.yaml").read_text()
    assert "sampler: ode" in recorded  # nft and awm sample with the deterministic chain
    if algorithm == "nft":
        assert records[0]["old_deviate_x0"] == 0.0  # the old policy starts as the trained one ...
        assert records[1]["old_deviate_x0"] > 0  # ... and lags behind it (decay 0.001 x step)
    else:
        assert records[0]["ratio_mean"] == 1.0 and records[0]["clipfrac"] == 0.0  # on-policy, as the authors
        assert records[1]["kl_to_old"] > 0
    weights = lora(run)
    ups = [value for name, value in weights.items() if "lora_B" in name or "lora.up" in name]
    assert ups and any(value.abs().sum() > 0 for value in ups)  # B starts at zero: it moved
    card = (run / "final" / "README.md").read_text()
    assert {"nft": "DiffusionNFT", "awm": "AWM"}[algorithm] in card


def test_nft_resumes_exactly_with_its_old_policy(family_models, prompt_file, tmp_path, monkeypatch):
    class Crash(Exception):
        pass

    settings = dict(algorithm="nft", num_epochs=3, kl_coef=1e-4, old_policy_decay="linear-0.5")
    model = family_models("sd3")
    straight = ddpo.train(config(model, prompt_file, tmp_path / "a", **settings))
    save, saved = ddpo.save_ddpo_checkpoint, []

    def save_then_crash(*args, **kwargs):
        saved.append(save(*args, **kwargs))
        if len(saved) == 2:
            raise Crash

    monkeypatch.setattr(ddpo, "save_ddpo_checkpoint", save_then_crash)
    with pytest.raises(Crash):
        ddpo.train(config(model, prompt_file, tmp_path / "b", **settings))
    assert any(path.name.startswith("custom_checkpoint") for path in saved[-1].iterdir())  # the old policy is saved
    monkeypatch.setattr(ddpo, "save_ddpo_checkpoint", save)
    resumed = ddpo.train(config(model, prompt_file, tmp_path / "b", resume="latest", **settings))
    a, b = lora(straight), lora(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)
    assert epochs(straight)[2]["old_deviate_x0"] == epochs(resumed)[2]["old_deviate_x0"]


def test_old_policy_swaps_in_without_copies_and_moves_by_its_decay():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(2))]
    old = OldPolicy(params)
    with torch.no_grad():
        params[0].add_(1.0)
    old.update(0.25)  # old = 0.25·old + 0.75·trained
    assert torch.equal(old.tensors[0], torch.full((3,), 1.75))
    storage = params[0].data.data_ptr()
    with old.swapped_in():
        assert torch.equal(params[0], torch.full((3,), 1.75))
    assert torch.equal(params[0], torch.full((3,), 2.0)) and params[0].data.data_ptr() == storage
    state = old.state_dict()
    fresh = OldPolicy(params)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.tensors[0], old.tensors[0])


def test_flow_cps_rounds_start_on_policy(family_models, prompt_file, tmp_path):
    run = ddpo.train(config(family_models("sd3"), prompt_file, tmp_path / "cps", sampler="cps", clip_range=1e-5,
                            gradient_accumulation_steps=2, kl_coef=0.1, timestep_selection="high_noise"))
    records = epochs(run)
    assert records[0]["approx_kl"] == 0.0 and [r["clipfrac"] for r in records] == [0.0, 0.0]
    assert records[1]["approx_kl"] < 1e-12  # sampled with the LoRA folded into the weights: equal up to rounding
    assert records[-1]["kl_to_reference"] > 0
    assert "Flow-CPS" in (run / "final" / "README.md").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--algorithm", "ppo", "--sampler", "ode"], "--algorithm ppo needs a stochastic sampler"),
    (["--sampler", "sde"], "--sampler sde is not a sampler of DDIM models"),
    (["--algorithm", "nft", "--deterministic_tail", "true", "--timestep_selection", "high_noise"],
     "--deterministic_tail is a window of stochastic steps for --algorithm ppo"),
    (["--algorithm", "grpo"], "--algorithm must be one of ppo, nft, awm"),
    (["--algorithm", "awm", "--awm_weighting", "t**2"], "--awm_weighting must be one of uniform, t, t2, huber, ghuber"),
    (["--algorithm", "ppo", "--nft_beta", "5"], "--nft_beta is an option of --algorithm nft (DiffusionNFT)"),
    (["--algorithm", "nft", "--awm_weighting", "t2"], "--awm_weighting is an option of --algorithm awm (AWM)"),
    (["--lora_alpha", "0"], "--lora_alpha must be in (0, 65536]"),
])
def test_combinations_that_cannot_run_are_refused_in_one_line(tiny_model, prompt_file, tmp_path, capsys, flags, message):
    out = tmp_path / "refused"
    with pytest.raises(SystemExit) as exit_:
        ddpo.main(["--model", tiny_model, "--prompts", prompt_file, "--output_dir", str(out),
                   "--reward", "jpeg-compressibility", *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()
