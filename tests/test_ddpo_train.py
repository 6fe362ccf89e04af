"""DDPO end to end on a tiny SD-architecture pipeline built in the test, plus its reward adapters."""

from __future__ import annotations

import contextlib
import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from diffusers import DDIMScheduler, UNet2DConditionModel
from safetensors.torch import load_file
from script_loader import load_experiment

from align.families.sd import StableDiffusion
from align.pipeline import add_lora, load_trained
from align.sampling.ddim import ddim_step_mean_std, gaussian_log_prob, guided_noise_prediction
from align.sampling.ddim_sampler import DDIMSampler
from align.testing.tiny_flow import build_tiny_sd3
from align.testing.two_processes import launch_two_cpu_processes
from align.train import ddpo, online_update
from align.train.accelerator import end_training
from align.train.ddpo import DDPOConfig
from align.train.ddpo_rewards import MixedReward, RewardError, win_rates
from align.train.losses import ddpo_clipped_loss
from align.train.objectives.ppo import PolicyGradient
from align.train.policy_models import PolicyModels
from align.train.rollout import Rollout
from rewards.base import Judge, Preference

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red circle\na blue square\na green triangle\n")
    return str(path)


def small_config(tiny_model, prompt_file, out, **overrides) -> DDPOConfig:
    base = dict(
        model=tiny_model,
        reward="jpeg-compressibility",
        prompts=prompt_file,
        output_dir=str(out),
        report_to="none",
        num_inference_steps=4,
        samples_per_epoch=4,
        sample_batch_size=2,
        train_batch_size=2,
        gradient_accumulation_steps=1,
        timestep_fraction=0.5,
        num_epochs=2,
        checkpointing_epochs=1,
        learning_rate=1e-2,
        clip_range=0.2,
    )
    base.update(overrides)
    return DDPOConfig(**base)


# ---------------------------------------------------------------------------------------- rewards


@dataclass
class BrightnessJudge(Judge):
    """Pointwise: mean pixel value."""
    name: str = "brightness"

    def score(self, prompts, images):
        return images.float().mean(dim=(1, 2, 3))


@dataclass
class PairwiseBrightness(Judge):
    """Pairwise-only: prefers the brighter image; records the pairs it was asked about."""
    name: str = "pairwise-brightness"
    asked: int = 0

    def compare(self, prompts, images_a, images_b):
        self.asked += len(prompts)
        a, b = images_a.mean(dim=(1, 2, 3)), images_b.mean(dim=(1, 2, 3))
        return [Preference(1.0 if x > y else 0.0 if x < y else 0.5, tie=bool(x == y)) for x, y in zip(a, b)]


def _images(levels):
    return torch.stack([torch.full((3, 4, 4), v) for v in levels])


def test_pairwise_judge_gives_win_rates_within_each_prompt():
    judge = PairwiseBrightness()
    assert not judge.pointwise and BrightnessJudge().pointwise
    prompts = ["a", "a", "a", "b", "b"]
    rates = win_rates(judge, prompts, _images([0.1, 0.9, 0.5, 0.3, 0.3]))
    # group a: 0.9 beats both, 0.5 beats one, 0.1 none; group b: a tie counts 1/2 each
    torch.testing.assert_close(rates, torch.tensor([0.0, 1.0, 0.5, 0.5, 0.5]))
    assert judge.asked == 3 + 1  # every pair within a group once, never across groups


def test_pairwise_judge_needs_groups():
    with pytest.raises(RewardError, match="at least 2 images"):
        win_rates(PairwiseBrightness(), ["a", "b"], _images([0.1, 0.2]))


def test_abstentions_are_left_out_of_win_rates():
    @dataclass
    class Abstains(Judge):
        name: str = "abstains"

        def compare(self, prompts, a, b):
            return [Preference(0.5, abstained=True) for _ in prompts]

    rates = win_rates(Abstains(), ["a", "a"], _images([0.1, 0.2]))
    assert torch.isnan(rates).all()
    reward = MixedReward("x", loader=lambda name, **kw: Abstains())
    with pytest.raises(RewardError, match="non-finite"):
        reward(["a", "a"], _images([0.1, 0.2]))


def test_weighted_mix_of_pointwise_and_pairwise_judges():
    judges = {"bright": BrightnessJudge(), "pair": PairwiseBrightness()}
    reward = MixedReward("bright:0.7,pair:0.3", loader=lambda spec: judges[spec.name])
    assert reward.needs_groups
    images = _images([0.2, 0.6])
    total, parts = reward(["p", "p"], images)
    torch.testing.assert_close(parts["bright"], torch.tensor([0.2, 0.6]))
    torch.testing.assert_close(parts["pair"], torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(total, 0.7 * torch.tensor([0.2, 0.6]) + 0.3 * torch.tensor([0.0, 1.0]))


def test_pairwise_native_judges_give_win_rates_although_they_have_a_score_method():
    # a position-biased oracle has a pointwise score() (the unbiased oracle's), but its bias exists only when two
    # images are shown, so DDPO must compare; the API/VLM judges in pair mode are the same case (score() raises)
    reward = MixedReward("shapes-oracle[position_bias=1.0]")
    assert reward.needs_groups
    total, _ = reward(["a red circle"] * 3, _images([0.1, 0.5, 0.9]))
    # pairs (0, 1), (0, 2), (1, 2), the first shown always wins: image 0 wins twice, image 1 once, image 2 never
    torch.testing.assert_close(total, torch.tensor([1.0, 0.5, 0.0]))


def test_failing_judge_becomes_reward_error():
    @dataclass
    class Broken(Judge):
        name: str = "broken"

        def score(self, prompts, images):
            raise ConnectionError("server down")

    reward = MixedReward("broken", loader=lambda name, **kw: Broken())
    with pytest.raises(RewardError, match="'broken' failed: ConnectionError: server down"):
        reward(["p"], _images([0.5]))


# ---------------------------------------------------------------------------------------- training


def test_end_to_end_lora_run(tiny_model, prompt_file, tmp_path):
    config = small_config(tiny_model, prompt_file, tmp_path / "run", eval_prompts=prompt_file, gradient_accumulation_steps=2)
    run = ddpo.train(config)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward_mean", "reward_std", "approx_kl", "clipfrac", "policy_loss", "global_step"):
        assert key in records[-1]
    # 4 samples per process, 2 x 2 per optimiser step, one inner epoch: 1 update per epoch
    assert records[-1]["global_step"] == 2
    assert all(0 < r["sampling_cpu_seconds"] < r["epoch_cpu_seconds"] for r in records)  # sampling is part of the epoch
    assert (run / "final" / "pytorch_lora_weights.safetensors").is_file()
    assert (run / "final" / "README.md").is_file() and (run / "report.html").is_file()
    logged = json.loads((run / "samples" / "epoch_00002.json").read_text())
    assert len(logged) == 4 and {"prompt", "reward"} <= set(logged[0])
    before = json.loads((run / "eval_before.json").read_text())["mean"]
    after = json.loads((run / "eval_after.json").read_text())["mean"]
    assert before != after  # the weights moved
    pipe = load_trained(str(run))  # the run folder loads back as a pipeline with the LoRA
    assert any("lora" in name for name, _ in pipe.unet.named_parameters())


def test_periodic_held_out_evaluation_scores_the_run_without_changing_its_training(tiny_model, prompt_file, tmp_path):
    settings = dict(eval_prompts=prompt_file, num_epochs=3)
    plain = ddpo.train(small_config(tiny_model, prompt_file, tmp_path / "plain", **settings))
    run = ddpo.train(small_config(tiny_model, prompt_file, tmp_path / "evals", eval_every_epochs=1, **settings))
    a = load_file(plain / "final" / "pytorch_lora_weights.safetensors")
    b = load_file(run / "final" / "pytorch_lora_weights.safetensors")
    for key in a:  # scoring mid-run leaves the training (RNG, weights, mode) as it was
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)
    assert sorted(p.name for p in (run / "evals").glob("*.json")) == ["step_0000001.json", "step_0000002.json"]
    before = json.loads((run / "eval_before.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for epoch in (1, 2):
        scored = json.loads((run / "evals" / f"step_{epoch:07d}.json").read_text())
        assert scored["prompts"] == before["prompts"] and scored["seeds"] == before["seeds"]
        assert records[epoch - 1]["heldout_score"] == scored["mean"]
        assert scored["scores"] != before["scores"]  # the current weights, not the base model's
    assert "heldout_score" not in records[2]  # the last epoch's score is eval_after.json
    assert 'alt="held-out score along the run"' in (run / "report.html").read_text()


def test_resume_gives_identical_weights(tiny_model, prompt_file, tmp_path):
    straight = ddpo.train(small_config(tiny_model, prompt_file, tmp_path / "a", num_epochs=2))
    ddpo.train(small_config(tiny_model, prompt_file, tmp_path / "b", num_epochs=1))
    resumed = ddpo.train(small_config(tiny_model, prompt_file, tmp_path / "b", num_epochs=2, resume="latest"))
    a = load_file(straight / "final" / "pytorch_lora_weights.safetensors")
    b = load_file(resumed / "final" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert [r["step"] for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())] == [1, 2]


def test_full_finetune_with_kl_and_group_advantages(tiny_model, prompt_file, tmp_path):
    config = small_config(
        tiny_model, prompt_file, tmp_path / "full", finetune="full", kl_coef=0.1, advantage="group",
        images_per_prompt=2, num_epochs=1, timestep_selection="high_noise", deterministic_tail=True,
    )
    run = ddpo.train(config)
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["kl_to_reference"] >= 0.0
    assert (run / "final" / "unet" / "config.json").is_file()
    card = (run / "final" / "README.md").read_text()
    assert "eta 1.0 on the first 2 steps, then 2 deterministic (eta 0) steps" in card and "| trained steps per sample | 2 (high_noise) |" in card


def test_lora_kl_uses_the_adapter_free_reference(tiny_model, prompt_file, tmp_path):
    # LoRA starts as the identity (B = 0), so the KL to the adapter-off UNet is 0 until the first
    # update and positive after it; the epoch mean covers both.
    run = ddpo.train(small_config(tiny_model, prompt_file, tmp_path / "kl", kl_coef=1.0, num_epochs=1))
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["kl_to_reference"] > 0.0


def test_high_noise_selection_trains_the_first_steps_of_the_chain():
    gen = torch.Generator().manual_seed(0)
    chosen = online_update.train_timestep_indices(5, 20, 10, "high_noise", gen)
    assert chosen.shape == (5, 10)
    for row in chosen:  # every sample: exactly the 10 noisiest steps (indices 0-9), shuffled
        assert sorted(row.tolist()) == list(range(10))
    assert len({tuple(r.tolist()) for r in chosen}) > 1
    random_rows = online_update.train_timestep_indices(50, 20, 10, "random", gen)
    assert random_rows.max() >= 10 and all(len(set(r.tolist())) == 10 for r in random_rows)


def test_pairwise_only_reward_trains(tiny_model, prompt_file, tmp_path):
    run = ddpo.train(small_config(tiny_model, prompt_file, tmp_path / "pair", reward="first-image",
                                  images_per_prompt=2, num_epochs=1))
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["reward_mean"] == pytest.approx(0.5)  # win rates in groups of two average 1/2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(eta=0.0), "--eta must be in (0, 10]"),
        (dict(timestep_fraction=0.0), "--timestep_fraction must be in (0, 1]"),
        (dict(timestep_fraction=1.5), "--timestep_fraction must be in (0, 1]"),
        (dict(reward="no-such-judge"), "unknown judge 'no-such-judge'"),
        (dict(reward="shapes-oracle[nosie=0.2]"), "judge 'shapes-oracle' has no option 'nosie'"),
        (dict(model="/no/such/folder"), "no such folder"),
        (dict(prompts="/no/such/prompts.txt"), "'/no/such/prompts.txt'"),
        (dict(advantage="median"), "--advantage must be one of"),
        (dict(samples_per_epoch=5), "--samples_per_epoch (5) must be a multiple"),
        (dict(train_batch_size=3), "must be a multiple of --train_batch_size"),
        (dict(advantage="group"), "--images_per_prompt >= 2"),
        (dict(advantage="group-mean"), "--advantage group-mean needs --images_per_prompt >= 2"),
        (dict(reward="first-image"), "pairwise-only"),
        (dict(reward="shapes-oracle[position_bias=0.5]"), "pairwise-only"),  # pairwise-native, has a score() too
        (dict(reward="gpt4o"), "OPENAI_API_KEY"),
        (dict(clip_range=0.0), "--clip_range must be in (0, 10]"),
        (dict(finetune="half"), "--finetune must be full or lora"),
        (dict(timestep_selection="late"), "--timestep_selection must be one of random, high_noise"),
        (dict(deterministic_tail=True), "--deterministic_tail needs --timestep_selection high_noise"),
        (dict(eval_images_per_prompt=0), "--eval_images_per_prompt must be in [1, 65536]"),
        (dict(eval_every_epochs=1), "--eval_every_epochs needs --eval_prompts and a judge"),
        (dict(eval_every_epochs=-1), "--eval_every_epochs must be in [0, 2147483647]"),
    ],
)
def test_bad_inputs_stop_with_one_clear_message(tiny_model, prompt_file, tmp_path, capsys, monkeypatch, overrides, message):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    config = small_config(tiny_model, prompt_file, tmp_path / "bad", **overrides)
    with pytest.raises(SystemExit) as exit_:
        _main_with(config)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("error:") == 1
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_existing_run_folder_is_refused(tiny_model, prompt_file, tmp_path, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "config.yaml").write_text("model: x\n")
    with pytest.raises(SystemExit):
        _main_with(small_config(tiny_model, prompt_file, tmp_path / "used"))
    assert "already holds a run" in capsys.readouterr().err


def test_an_unusable_judge_with_overwrite_leaves_the_old_run_whole(tiny_model, prompt_file, tmp_path, capsys, monkeypatch):
    old = tmp_path / "old"
    (old / "final").mkdir(parents=True)
    files = {old / "config.yaml": "model: x\n", old / "metrics.jsonl": '{"step": 1}\n', old / "final" / "README.md": "kept"}
    for path, text in files.items():
        path.write_text(text)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_:
        _main_with(small_config(tiny_model, prompt_file, old, reward="gpt4o", overwrite=True))
    assert exit_.value.code == 2 and "OPENAI_API_KEY" in capsys.readouterr().err
    assert {path: path.read_text() for path in files} == files and sorted(old.rglob("*")) == sorted([*files, old / "final"])


def _main_with(config: DDPOConfig):
    """Run main() with the config's fields as command-line flags."""
    argv = []
    for key, value in vars(config).items():
        if value is None:
            continue
        argv += [f"--{key}", str(value)]
    ddpo.main(argv)


@pytest.mark.parametrize("failure", ["nan", "raise"])
def test_failing_judge_stops_cleanly_and_keeps_the_last_checkpoint(tiny_model, prompt_file, tmp_path, monkeypatch, capsys, failure):
    @dataclass
    class FailsAtEpochTwo(Judge):
        name: str = "flaky"
        calls: int = 0

        def score(self, prompts, images):
            self.calls += 1
            if self.calls <= 2:  # two sampling batches per epoch
                return images.mean(dim=(1, 2, 3))
            if failure == "raise":
                raise TimeoutError("judge timed out")
            return torch.full((len(prompts),), float("nan"))

    monkeypatch.setattr(ddpo, "MixedReward", lambda spec, loader, **options: MixedReward(spec, loader=lambda n, **kw: FailsAtEpochTwo()))
    config = small_config(tiny_model, prompt_file, tmp_path / "flaky", reward="random", num_epochs=2)
    with pytest.raises(SystemExit) as exit_:
        _main_with(config)
    assert exit_.value.code == 3
    err = capsys.readouterr().err
    assert "reward failed at epoch 1" in err and "step_0000001" in err and "--resume latest" in err
    run = tmp_path / "flaky"
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_0000001"]
    assert (run / "checkpoints" / "step_0000001" / "state.json").is_file()
    assert not (run / "final").exists()
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1


# In the default suite: 56 s on the busy 2-core machine (two processes each load torch and the pipeline), the
# cheaper of the two-process tests (tests/test_dpo_distributed.py's, ~80 s, is marked slow).
def test_two_process_cpu_run(tiny_model, prompt_file, tmp_path):
    out = tmp_path / "ddp"
    flags = dict(
        model=tiny_model, reward="jpeg-compressibility", prompts=prompt_file, output_dir=str(out), report_to="none",
        num_inference_steps=4, samples_per_epoch=8, sample_batch_size=2, train_batch_size=2,
        gradient_accumulation_steps=1, timestep_fraction=0.5, num_epochs=2, checkpointing_epochs=1,
        learning_rate=1e-2, clip_range=0.2,
    )
    argv = [x for k, v in flags.items() for x in (f"--{k}", str(v))]
    result = launch_two_cpu_processes("align/ddpo.py", argv, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x 2 processes" in result.stdout
    assert "trained weights identical on all 2 processes" in result.stdout  # LoRA gradients were synchronised
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # 4 samples per process, 2 per optimiser step: 2 synchronised updates per epoch
    assert records[-1]["global_step"] == 4
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file()


def test_end_training_frees_the_prepared_model_before_the_process_group_goes():
    # A DDP model that outlives its process group deadlocked 2-process gloo runs at exit (align/train/accelerator.py).

    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    alive = weakref.ref(prepared)
    del prepared, optimizer, model
    assert alive() is not None  # accelerate still holds it
    end_training(accelerator)
    assert alive() is None and accelerator._models == []


class RecordingOptimizer:
    """Stands in for the optimiser: records the accumulated gradients at each step."""
    def __init__(self, params):
        self.params, self.steps = params, []

    def step(self):
        self.steps.append([p.grad.detach().clone() for p in self.params])

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def _lora_unet_and_samples(tiny_model):
    """A LoRA UNet with B moved off zero and a stored batch of 4 trajectories of 4 steps."""
    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_pretrained(Path(tiny_model) / "unet")
    add_lora(unet, rank=4)
    for name, p in unet.named_parameters():  # move B off zero so every LoRA weight gets a gradient
        if "lora_B" in name:
            p.data.normal_(0, 0.1)
    params = [p for p in unet.parameters() if p.requires_grad]
    scheduler = DDIMScheduler.from_pretrained(Path(tiny_model) / "scheduler")
    scheduler.set_timesteps(4)
    n, steps = 4, 4
    samples = {
        "cond": {"prompt_embeds": torch.randn(n, 6, 16)},
        "all_latents": torch.randn(n, steps + 1, 4, 8, 8),
        "timesteps": scheduler.timesteps.repeat(n, 1),
        "log_probs": torch.randn(n, steps) * 0.01 - 1.5,
        "advantages": torch.tensor([1.0, -0.5, 2.0, -1.0]),
    }
    negative = {"prompt_embeds": torch.randn(1, 6, 16)}
    return unet, params, scheduler, samples, negative


def _inner_epoch_gradient(unet, params, scheduler, samples, negative, timestep_batch, kl_coef, as_launched=None,
                          **overrides):
    """The one gradient of a PPO pass over the 4 samples (2 x 2 accumulation, every timestep)."""
    n, steps = samples["timesteps"].shape
    config = DDPOConfig(prompts="x", num_inference_steps=steps, timestep_fraction=1.0, train_batch_size=2,
                        gradient_accumulation_steps=2, timestep_batch=timestep_batch, guidance_scale=3.0,
                        clip_range=0.5, kl_coef=kl_coef, max_grad_norm=0.0, **overrides)
    config.resolve_for_family(is_flow=False)
    optimizer = RecordingOptimizer(params)
    sampler = DDIMSampler(scheduler, steps, config.eta)
    objective = PolicyGradient(sampler, config.clip_range, config.adv_clip_max, config.kl_coef)
    models = PolicyModels(StableDiffusion(), unet, unet, None, None, config.guidance_scale, contextlib.nullcontext)
    accelerator = Accelerator(cpu=True) if as_launched is None else as_launched(Accelerator(cpu=True))
    update = online_update.Update(config, accelerator, models, objective, optimizer, params, negative)
    chain = samples["all_latents"]
    rollout = Rollout(prompts=["x"] * n, cond=samples["cond"], latents=chain[:, :-1], next_latents=chain[:, 1:],
                      timesteps=samples["timesteps"], step_indices=torch.arange(steps).expand(n, -1),
                      log_probs=samples["log_probs"], final_latents=chain[:, -1], images=torch.zeros(n, 3, 8, 8))
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(n, generator=gen)
    plan = online_update.EpochPlan(order, online_update.train_timestep_indices(n, steps, steps, "random", gen), None)
    updates = online_update.train_epoch(update, online_update.Epoch(rollout, samples["advantages"], plan), {})
    assert updates == 1 and len(optimizer.steps) == 1
    return optimizer.steps[0]


@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_batched_timesteps_give_the_same_gradient_as_one_at_a_time(tiny_model, kl_coef):
    unet, params, scheduler, samples, negative = _lora_unet_and_samples(tiny_model)
    one = _inner_epoch_gradient(unet, params, scheduler, samples, negative, 1, kl_coef)
    batched = _inner_epoch_gradient(unet, params, scheduler, samples, negative, 3, kl_coef)
    assert any(g.abs().sum() > 0 for g in one)
    for a, b in zip(one, batched):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def _all_terms_gradient(unet, params, scheduler, samples, negative, clip_range):
    """The formula directly: mean of the PPO terms of every sample at every timestep, zero advantages included."""
    n, steps = samples["timesteps"].shape
    lat = samples["all_latents"][:, :steps].flatten(0, 1)
    nxt = samples["all_latents"][:, 1:].flatten(0, 1)
    ts = samples["timesteps"].flatten()
    cond = samples["cond"]["prompt_embeds"].repeat_interleave(steps, dim=0)
    pred = guided_noise_prediction(unet, lat, ts, cond, negative["prompt_embeds"].expand(len(lat), -1, -1), 3.0)
    mean, std = ddim_step_mean_std(scheduler, pred, ts, lat, 1.0)
    loss, _ = ddpo_clipped_loss(gaussian_log_prob(nxt, mean, std), samples["log_probs"].flatten(),
                                samples["advantages"].repeat_interleave(steps), clip_range)
    return torch.autograd.grad(loss, params)


def _chosen_terms_gradient(unet, params, scheduler, samples, negative, step_of_sample, clip_range):
    """The formula for one trained step per sample: the mean PPO term over the samples at their steps."""
    rows = torch.arange(len(step_of_sample))
    lat = samples["all_latents"][rows, step_of_sample]
    nxt = samples["all_latents"][rows, step_of_sample + 1]
    ts = samples["timesteps"][rows, step_of_sample]
    pred = guided_noise_prediction(unet, lat, ts, samples["cond"]["prompt_embeds"],
                                   negative["prompt_embeds"].expand(len(lat), -1, -1), 3.0)
    mean, std = ddim_step_mean_std(scheduler, pred, ts, lat, 1.0)
    loss, _ = ddpo_clipped_loss(gaussian_log_prob(nxt, mean, std), samples["log_probs"][rows, step_of_sample],
                                samples["advantages"], clip_range)
    return torch.autograd.grad(loss, params)


def test_zero_advantage_samples_skip_the_unet_with_the_same_gradient(tiny_model):
    unet, params, scheduler, samples, negative = _lora_unet_and_samples(tiny_model)
    samples["advantages"] = torch.tensor([1.5, 0.0, -2.0, 0.0])
    seen_rows = []
    hook = unet.register_forward_pre_hook(lambda module, args: seen_rows.append(len(args[0])))
    skipped = _inner_epoch_gradient(unet, params, scheduler, samples, negative, 4, 0.0)
    hook.remove()
    # 2 informative samples x 4 timesteps, doubled for guidance: half the rows of all 4 samples
    assert sum(seen_rows) == 2 * 4 * 2
    expected = _all_terms_gradient(unet, params, scheduler, samples, negative, clip_range=0.5)
    assert any(g.abs().sum() > 0 for g in expected)
    for a, b in zip(expected, skipped):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def test_dropped_zero_advantage_samples_average_the_step_over_the_rest(tiny_model):
    # Flow-GRPO's train_sd3.py: samples with advantage 0 leave the update, which is averaged over the others.
    unet, params, scheduler, samples, negative = _lora_unet_and_samples(tiny_model)
    samples["advantages"] = torch.tensor([1.5, 0.0, -2.0, 0.0])
    kept = _inner_epoch_gradient(unet, params, scheduler, samples, negative, 4, 0.0)
    dropped = _inner_epoch_gradient(unet, params, scheduler, samples, negative, 4, 0.0, drop_zero_advantage=True)
    for a, b in zip(kept, dropped):  # 4 samples counted, or the 2 informative ones
        torch.testing.assert_close(b, 2 * a, rtol=1e-4, atol=1e-7)
    with_kl = _inner_epoch_gradient(unet, params, scheduler, samples, negative, 4, 0.5, drop_zero_advantage=True)
    informative = {key: value[[0, 2]] if key != "cond" else {"prompt_embeds": value["prompt_embeds"][[0, 2]]}
                   for key, value in samples.items()}
    only_informative = _inner_epoch_gradient(unet, params, scheduler, informative, negative, 4, 0.5)
    for a, b in zip(only_informative, with_kl):  # their KL terms leave too
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def test_an_update_whose_advantages_are_all_zero_still_steps_with_a_zero_gradient(tiny_model):
    unet, params, scheduler, samples, negative = _lora_unet_and_samples(tiny_model)
    samples["advantages"] = torch.zeros(4)
    gradient = _inner_epoch_gradient(unet, params, scheduler, samples, negative, 4, 0.0)
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in gradient)


def test_gradient_snr_script_prints_one_row_per_setting(tiny_model, prompt_file, capsys):
    ddpo_gradient_snr = load_experiment("ddpo_gradient_snr")
    ddpo_gradient_snr.main(["--model", tiny_model, "--reward", "jpeg-compressibility", "--prompts", prompt_file,
                            "--samples", "4", "--images-per-prompt", "2", "--estimates", "2", "--steps", "4",
                            "--guidance", "2.0", "--rows", "all:2", "first:2", "--shared-noise"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("all:", "first:"))]
    assert [r[0] for r in rows] == ["all:2", "first:2"]
    for row in rows:
        assert -1.0 <= float(row[1]) <= 1.0  # a cosine between two real gradients
        assert float(row[1]) != 0.0  # the LoRA's B matrices have a gradient from the first step


def test_gradient_snr_script_runs_flow_grpo_windows(tmp_path, prompt_file, capsys):
    folder = build_tiny_sd3(tmp_path / "sd3")
    ddpo_gradient_snr = load_experiment("ddpo_gradient_snr")
    ddpo_gradient_snr.main(["--model", str(folder), "--reward", "jpeg-compressibility", "--prompts", prompt_file,
                            "--samples", "4", "--images-per-prompt", "2", "--estimates", "2", "--steps", "4",
                            "--guidance", "2.0", "--rows", "all:4", "first:1", "window:2", "--shift", "1.0"])
    out = capsys.readouterr().out
    assert "(sd3)" in out and "σ shift 1.0" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("all:", "first:", "window:"))]
    assert [r[0] for r in rows] == ["all:4", "first:1", "window:2"]
    assert all(-1.0 <= float(r[1]) <= 1.0 and float(r[1]) != 0.0 for r in rows)


def test_gradient_snr_script_refuses_a_row_longer_than_the_chain(tiny_model, prompt_file):
    ddpo_gradient_snr = load_experiment("ddpo_gradient_snr")
    with pytest.raises(SystemExit, match="first:9"):
        ddpo_gradient_snr.main(["--model", tiny_model, "--prompts", prompt_file, "--steps", "4", "--rows", "first:9"])


class ShardedElsewhere:
    """An Accelerator as FSDP2 on two processes shows it, where the other process has ``more`` micro-batches in
    each optimiser step (it kept more samples)."""

    def __init__(self, accelerator, more: int):
        self.accelerator, self.more = accelerator, more
        self.is_fsdp2, self.num_processes = True, 2

    def gather(self, tensor):
        return torch.cat([tensor, tensor + self.more])

    def __getattr__(self, name):
        return getattr(self.accelerator, name)


def test_under_fsdp2_a_process_with_fewer_micro_batches_runs_weight_zero_ones(tiny_model):
    """Every FSDP2 forward all-gathers the weights with every process, so each runs as many micro-batches as the
    process with the most; the added ones change neither the gradient nor the logged statistics."""
    unet, params, scheduler, samples, negative = _lora_unet_and_samples(tiny_model)
    reference = _inner_epoch_gradient(unet, params, scheduler, samples, negative, 1, 0.5)
    calls = []
    real_step = online_update.train_micro_batch

    def counting(*args, **kwargs):
        calls.append(kwargs["recorded"])
        return real_step(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(online_update, "train_micro_batch", counting)
        padded = _inner_epoch_gradient(unet, params, scheduler, samples, negative, 1, 0.5,
                                       as_launched=lambda accelerator: ShardedElsewhere(accelerator, 2))
    assert calls == [True, True, False, False]  # 2 of its own, 2 of weight 0
    for a, b in zip(reference, padded):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-9)
