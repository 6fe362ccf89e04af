"""The online-RL plug-ins of issue 58 end to end on tiny models: Dance-SDE (--sampler dance), MixGRPO's sliding window
(--sampler mix), GRPO-Guard, DGPO and GDPO's per-reward normalisation, each through align/ddpo.py, and their refusals.
Their maths against the authors' code: tests/test_dance_reference.py, tests/test_mixgrpo_reference.py,
tests/test_grpo_guard_reference.py, tests/test_dgpo_reference.py, tests/test_gdpo_reference.py."""

from __future__ import annotations

import pytest
import torch
from test_online_rl import config, epochs
from test_online_rl import prompt_file as shared_prompt_file

from align.cli import ConfigError, build_parser
from align.sampling import dance_sampler, mix_sampler
from align.train import ddpo
from align.train.ddpo_config import DDPOConfig

prompt_file = shared_prompt_file  # test_online_rl's fixture, for this module's tests


def test_dance_sde_trains_a_flow_model_on_policy_from_group_shared_noise(family_models, prompt_file, tmp_path,
                                                                          monkeypatch):
    drawn = []
    run_chain = dance_sampler.DanceSampler.run

    def recording(self, predict, noise, generator):
        drawn.append(noise.clone())
        return run_chain(self, predict, noise, generator)

    monkeypatch.setattr(dance_sampler.DanceSampler, "run", recording)
    run = ddpo.train(config(family_models("sd3"), prompt_file, tmp_path / "dance", sampler="dance", eta=0.3,
                            group_shared_noise=True, timestep_selection="high_noise", gradient_accumulation_steps=2))
    records = epochs(run)
    assert records[0]["approx_kl"] == 0.0 and records[0]["clipfrac"] == 0.0  # the first minibatch is on-policy
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    for noise in drawn:  # groups of 2 consecutive images share their initial noise, the groups differ
        assert torch.equal(noise[0], noise[1]) and torch.equal(noise[2], noise[3]) and not torch.equal(noise[0], noise[2])
    assert "Dance-SDE" in (run / "final" / "README.md").read_text()


@pytest.mark.parametrize("sampler", ["sde", "dance"])
def test_grpo_guard_trains_on_the_recorded_means_on_policy_first(family_models, prompt_file, tmp_path, sampler):
    run = ddpo.train(config(family_models("sd3"), prompt_file, tmp_path / f"guard-{sampler}", algorithm="grpo-guard",
                            sampler=sampler, clip_range=2e-6, kl_coef=0.01, timestep_selection="high_noise",
                            gradient_accumulation_steps=2))
    records = epochs(run)
    assert records[0]["ratio_mean"] == 1.0 and records[0]["clipfrac"] == 0.0  # the first minibatch is on-policy
    assert records[-1]["kl_to_reference"] > 0 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert "GRPO-Guard: ratio normalisation, 1/Δσ reweighting" in (run / "final" / "README.md").read_text()


def test_mixgrpo_moves_its_window_with_the_epochs(family_models, prompt_file, tmp_path, monkeypatch):
    windows = []
    run_chain = mix_sampler.MixSampler.run

    def recording(self, predict, noise, generator):
        steps = run_chain(self, predict, noise, generator)
        windows.append(steps["step_indices"][0].tolist())
        return steps

    monkeypatch.setattr(mix_sampler.MixSampler, "run", recording)
    run = ddpo.train(config(family_models("sd3"), prompt_file, tmp_path / "mix", sampler="mix", num_inference_steps=5,
                            timestep_fraction=0.4, mix_window_epochs=1, num_epochs=3, gradient_accumulation_steps=2))
    assert windows == [[0, 1], [1, 2], [2]]  # windows end before step N - 2 = 3 (the last one cut short)
    records = epochs(run)
    assert records[0]["approx_kl"] == 0.0 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert "MixGRPO: Flow-GRPO SDE on a window of 2 of 5 steps" in (run / "final" / "README.md").read_text()


@pytest.mark.parametrize("kind", ["sd", "sd3"])
def test_dgpo_trains_whole_groups_from_deterministic_samples(family_models, tiny_model, prompt_file, tmp_path, kind):
    model = tiny_model if kind == "sd" else family_models(kind)
    run = ddpo.train(config(model, prompt_file, tmp_path / f"dgpo-{kind}", algorithm="dgpo", train_batch_size=2,
                            gradient_accumulation_steps=2, clip_range=1e-2, kl_coef=0.02, advantage="group"))
    records = epochs(run)
    # the policy starts as the reference and the old policy: every group weighs sigma(0), nothing is clipped
    assert records[0]["group_weight"] == 0.5 and records[0]["clipfrac"] == 0.0
    assert records[-1]["global_step"] == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    recorded = (run / "config.yaml").read_text()
    assert ("sampler: dpm2" if kind == "sd3" else "sampler: ode") in recorded
    assert "DGPO: beta 100.0, groups of 2" in (run / "final" / "README.md").read_text()


def test_gdpo_normalises_each_judge_of_the_mix(tiny_model, prompt_file, tmp_path):
    run = ddpo.train(config(tiny_model, prompt_file, tmp_path / "gdpo", reward="jpeg-compressibility:1,random:1",
                            advantage="gdpo"))
    records = epochs(run)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert abs(records[0]["reward_mean"]) < 1e-5  # each judge centred in its groups, the weighted sum too
    assert "reward_jpeg-compressibility" in records[0] and "reward_random" in records[0]  # the raw judges, logged
    assert "advantage: gdpo" in (run / "config.yaml").read_text() or "advantage: gdpo" in (run / "final" / "README.md").read_text()


@pytest.mark.parametrize("flags, message", [
    (["--sampler", "dance"], "--sampler dance is not a sampler of DDIM models"),
    (["--advantage", "gdpo", "--images_per_prompt", "2"], "--advantage gdpo normalises each judge of a mix of several"),
    (["--advantage", "gdpo", "--reward", "jpeg-compressibility:1,random:1"], "--advantage gdpo needs --images_per_prompt >= 2"),
    (["--algorithm", "dgpo", "--images_per_prompt", "2", "--sample_batch_size", "6", "--train_batch_size", "3"],
     "--images_per_prompt must be >= 2 and divide --train_batch_size"),
    (["--algorithm", "dgpo", "--images_per_prompt", "2", "--drop_zero_advantage", "true"],
     "--algorithm dgpo trains whole groups"),
    (["--mix_window_epochs", "3"], "--mix_window_epochs is an option of --sampler mix"),
    (["--algorithm", "grpo-guard"], "--algorithm grpo-guard (GRPO-Guard) trains flow-matching models"),
    (["--algorithm", "grpo-guard", "--sampler", "cps"], "--algorithm grpo-guard normalises Gaussian steps"),
    (["--algorithm", "ppo", "--guard_reweight", "false"], "--guard_reweight is an option of --algorithm grpo-guard"),
    (["--algorithm", "nft", "--group_shared_noise", "true"], "--group_shared_noise with the deterministic --sampler ode"),
])
def test_combinations_that_cannot_run_are_refused_in_one_line(tiny_model, prompt_file, tmp_path, capsys, flags, message):
    out = tmp_path / "refused"
    with pytest.raises(SystemExit) as exit_:
        ddpo.main(["--model", tiny_model, "--prompts", prompt_file, "--output_dir", str(out),
                   "--reward", "jpeg-compressibility", *flags])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("overrides, message", [
    (dict(deterministic_tail=True, timestep_selection="high_noise"), "--deterministic_tail is --sampler sde's fixed window"),
    (dict(timestep_fraction=0.9), "--sampler mix's window (--timestep_fraction x --num_inference_steps = 9 steps)"),
    (dict(mix_dynamics="cps"), "--mix_dynamics must be sde or dance"),
])
def test_mix_options_are_checked_before_anything_loads(overrides, message):
    config = DDPOConfig(prompts="x", sampler="mix", **overrides)
    with pytest.raises(ConfigError) as error:  # a declared choice at validate(), the window's rules at the family
        config.validate()
        config.resolve_for_family(True)
    assert message in str(error.value)


def test_help_shows_the_samplers_options_in_a_section_of_their_own():
    text = build_parser(DDPOConfig, prog="align-ddpo").format_help()
    section = text[text.index("options of --sampler mix:"):].split("\n\n")[0]
    assert all(f"--{name}" in section for name in ("mix_window_epochs", "mix_window_stride", "mix_dynamics"))
    assert "--guard_reweight" in text[text.index("options of --algorithm grpo-guard:"):].split("\n\n")[0]
    assert "--dgpo_beta" in text[text.index("options of --algorithm dgpo:"):].split("\n\n")[0]
