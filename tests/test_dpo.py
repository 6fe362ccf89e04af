"""End-to-end Diffusion-DPO runs on a tiny SD-architecture pipeline built in the test."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import wandb
from diffusers import StableDiffusionPipeline
from PIL import Image
from safetensors.torch import load_file
from wandb_records import history_rows

from align.cli import parse_config
from align.pipeline import add_lora, disabled_adapter, generate_images, load_pipeline, load_trained
from align.testing.two_processes import launch_two_cpu_processes
from align.train import dpo, dpo_data
from align.train.dpo import DPOConfig, TrainingStopped
from align.train.heldout import evaluate_model
from rewards.images import decode_image, to_tensor

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("a red circle\na blue square\n# comment\n\na green triangle\n")
    return str(path)


def _png(color, size=16, noise_seed=None):
    image = Image.new("RGB", (size, size), color)
    if noise_seed is not None:
        g = torch.Generator().manual_seed(noise_seed)
        arr = (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()
        image = Image.fromarray(arr)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pair_parquet(tmp_path_factory):
    rows = []
    for i in range(6):
        rows.append(
            {
                "caption": f"shape number {i}",
                "jpg_0": _png((200, 30 * i, 40)),
                "jpg_1": _png((0, 0, 0), noise_seed=i),
                "label_0": 1.0 if i % 2 == 0 else 0.0,
                "label_1": 0.0 if i % 2 == 0 else 1.0,
            }
        )
    rows.append({"caption": "a tie", "jpg_0": _png((1, 2, 3)), "jpg_1": _png((3, 2, 1)), "label_0": 0.5, "label_1": 0.5})
    path = tmp_path_factory.mktemp("pairs") / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def small_config(tiny_model, out, **overrides):
    base = dict(
        model=tiny_model,
        output_dir=str(out),
        finetune="lora",
        lora_rank=4,
        resolution=None,
        train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=4,
        learning_rate=1e-3,
        scale_lr=False,
        lr_warmup_steps=0,
        beta=100.0,
        num_inference_steps=2,
        guidance_scale=2.0,
        checkpointing_steps=2,
        report_to="none",
    )
    base.update(overrides)
    return DPOConfig(**base)


def _trainable(folder):
    return load_file(str(Path(folder) / "final" / "pytorch_lora_weights.safetensors"))


def test_reward_run_end_to_end_and_lora_loads_in_plain_diffusers(tiny_model, prompt_file, tmp_path):
    run = dpo.train(
        small_config(tiny_model, tmp_path / "run", reward="jpeg-compressibility", prompts=prompt_file)
    )
    feedback = pq.read_table(run / "feedback" / "pairs.parquet").to_pylist()
    assert len(feedback) == 3 and {r["judge"] for r in feedback} == {"jpeg-compressibility"}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for key in ("loss", "implicit_acc", "model_mse", "ref_mse", "lr"):
        assert key in records[0]
    assert (run / "final" / "README.md").is_file() and (run / "report.html").is_file()

    # The saved LoRA goes into a plain diffusers pipeline and changes its output.

    pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None)
    before = generate_images(pipe, ["a red circle"], [0], num_inference_steps=2, guidance_scale=2.0)
    pipe.load_lora_weights(str(run / "final"))
    after = generate_images(pipe, ["a red circle"], [0], num_inference_steps=2, guidance_scale=2.0)
    assert (before - after).abs().max() > 1e-4


def test_evaluation_batches_with_the_lora_merged_and_scores_as_unbatched_generation(tiny_model, tmp_path):
    class PixelProjection:
        """A fixed random projection of the pixels: any change to an image moves its score."""

        name = "pixel-projection"

        def score(self, prompts, images):
            weights = torch.randn(images[0].numel(), generator=torch.Generator().manual_seed(0))
            return images.flatten(1) @ weights

    judge = PixelProjection()

    pipe = load_pipeline(tiny_model)
    add_lora(pipe.unet, rank=4)
    torch.manual_seed(0)
    for name, p in pipe.unet.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.3)  # an adapter that changes the images
    weights = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    (tmp_path / "held_out.txt").write_text("a red circle\na blue square\na green triangle\n")
    config = SimpleNamespace(eval_prompts=str(tmp_path / "held_out.txt"), eval_images_per_prompt=2, eval_seed=5,
                             num_validation_images=1, eval_batch_size=4)
    mean = evaluate_model(pipe, judge, config, 2, 2.0, tmp_path / "eval.json", "after")
    record = json.loads((tmp_path / "eval.json").read_text())

    def one_image_score(prompt, seed):  # one image per call, through PEFT's unmerged layers: the reference
        return float(judge.score([prompt], generate_images(pipe, [prompt], [seed], num_inference_steps=2,
                                                           guidance_scale=2.0, batch_size=1))[0])

    expected = [one_image_score(p, s) for p, s in zip(record["prompts"], record["seeds"])]
    with disabled_adapter(pipe.unet):
        adapter_off = one_image_score(record["prompts"][0], 5)
    assert abs(adapter_off - expected[0]) > 0.05  # the adapter matters, so a wrong merge would show
    assert record["seeds"] == [5, 6, 7, 8, 9, 10]
    assert record["scores"] == pytest.approx(expected, abs=1e-3) and mean == pytest.approx(sum(expected) / 6, abs=1e-3)
    for key, value in pipe.unet.state_dict().items():  # the merge is undone bit for bit
        assert torch.equal(value, weights[key]), key


def test_dataset_run_full_finetune(tiny_model, pair_parquet, tmp_path):
    run = dpo.train(small_config(tiny_model, tmp_path / "run", dataset=pair_parquet, finetune="full", learning_rate=1e-4))
    assert (run / "final" / "unet" / "config.json").is_file()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)

    pipe = load_trained(str(run))
    base = load_pipeline(tiny_model)
    changed = any((a - b).abs().max() > 0 for a, b in zip(pipe.unet.parameters(), base.unet.parameters()))
    assert changed


def test_resume_gives_identical_weights(tiny_model, pair_parquet, tmp_path):
    straight = dpo.train(small_config(tiny_model, tmp_path / "straight", dataset=pair_parquet))
    half = small_config(tiny_model, tmp_path / "halves", dataset=pair_parquet, max_steps=2)
    dpo.train(half)
    resumed = dpo.train(small_config(tiny_model, tmp_path / "halves", dataset=pair_parquet, resume="latest"))
    a, b = _trainable(straight), _trainable(resumed)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    assert [r["step"] for r in map(json.loads, (resumed / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3, 4]


def test_periodic_held_out_evaluation_scores_the_run_without_changing_its_training(tiny_model, pair_parquet, prompt_file, tmp_path):
    settings = dict(dataset=pair_parquet, eval_prompts=prompt_file, eval_judge="jpeg-compressibility")
    plain = dpo.train(small_config(tiny_model, tmp_path / "plain", **settings))
    run = dpo.train(small_config(tiny_model, tmp_path / "evals", eval_every_steps=2, **settings))
    # Scoring the held-out prompts mid-run leaves the training (RNG, weights, mode) as it was.
    a, b = _trainable(plain), _trainable(run)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=0)
    assert sorted(p.name for p in (run / "evals").glob("*.json")) == ["step_0000002.json"]  # step 4 is eval_after
    during = json.loads((run / "evals" / "step_0000002.json").read_text())
    before = json.loads((run / "eval_before.json").read_text())
    assert during["prompts"] == before["prompts"] and during["seeds"] == before["seeds"]
    assert during["scores"] != before["scores"]  # two steps of training changed the images
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("heldout_score") for r in records] == [None, during["mean"], None, None]
    assert 'alt="held-out score along the run"' in (run / "report.html").read_text()
    assert 'alt="held-out score along the run"' not in (plain / "report.html").read_text()


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tiny_model, pair_parquet, tmp_path, monkeypatch):
    real = dpo.diffusion_dpo_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss, metrics = real(*args, **kwargs)
        return (loss * float("nan") if calls["n"] == 3 else loss), metrics

    monkeypatch.setattr(dpo, "diffusion_dpo_loss", poisoned)
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match="non-finite loss at step 2"):
        dpo.train(small_config(tiny_model, out, dataset=pair_parquet))
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert checkpoints == ["step_0000002"]
    assert (out / "checkpoints" / "step_0000002" / "state.json").is_file()
    assert not (out / "final").exists()


def test_wandb_offline_logs_the_same_metrics(tiny_model, pair_parquet, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = dpo.train(small_config(tiny_model, tmp_path / "run", dataset=pair_parquet, report_to="wandb", max_steps=2))

    wandb.teardown()  # waits for the background writer to flush the run file
    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, "wandb wrote no offline run"
    logged = [r for r in history_rows(run_files[0]) if "loss" in r]
    ours = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["_step"] for r in logged] == [r["step"] for r in ours] == [1, 2]
    for theirs, mine in zip(logged, ours):
        for key in ("loss", "implicit_acc", "model_mse", "ref_mse", "lr"):
            assert theirs[key] == pytest.approx(mine[key], rel=1e-6)


# ------------------------------------------------------------------------------------ bad inputs


def run_cli(args, cwd=ROOT):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "align/dpo.py", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _round_images_match_base(run, round_dir, base):
    """Whether the round's pair images are exactly what the base model draws for their (prompt, seed)."""
    rows = pq.read_table(run / "feedback" / round_dir / "pairs.parquet").to_pylist()
    prompts = [r["caption"] for r in rows for _ in (0, 1)]
    seeds = [r[key] for r in rows for key in ("seed_0", "seed_1")]
    stored = (to_tensor([decode_image(r[key]) for r in rows for key in ("jpg_0", "jpg_1")]) * 255).round()
    redrawn = (generate_images(base, prompts, seeds, num_inference_steps=2, guidance_scale=2.0) * 255).round()
    return bool((stored - redrawn).abs().max() <= 1), rows


def online_config(tiny_model, prompts4, out, **overrides):
    return small_config(tiny_model, out, reward="jpeg-compressibility", prompts=prompts4, feedback_rounds=2,
                        learning_rate=3e-2, checkpointing_steps=100, **overrides)


@pytest.fixture(scope="module")
def prompts4(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts4") / "prompts.txt"
    path.write_text("a red circle\na blue square\na green triangle\na yellow circle\n")
    return str(path)


@pytest.fixture(scope="module")
def online_run(tiny_model, prompts4, tmp_path_factory):
    return dpo.train(online_config(tiny_model, prompts4, tmp_path_factory.mktemp("online") / "run"))


def test_online_rounds_label_the_model_trained_so_far(tiny_model, online_run):
    run = online_run
    base = load_pipeline(tiny_model)
    base.set_progress_bar_config(disable=True)
    first_is_base, first = _round_images_match_base(run, "round_1", base)
    second_is_base, second = _round_images_match_base(run, "round_2", base)
    assert [r["caption"] for r in first] == ["a red circle", "a blue square"]
    assert [r["caption"] for r in second] == ["a green triangle", "a yellow circle"]
    assert first_is_base  # round 1: the base model's own images
    assert not second_is_base  # round 2: drawn by the model after round 1's two steps
    # each round ends with a checkpoint (checkpointing_steps=100 would give none before the end)
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-2:] == ["step_0000002", "step_0000004"]
    assert "2 online rounds" in (run / "final" / "README.md").read_text()


def test_online_rounds_resume_exactly_after_a_crash_in_round_two(tiny_model, prompts4, online_run, tmp_path, monkeypatch):
    straight = online_run
    real = dpo_data.label_round

    def crash_on_round_two(*args, **kwargs):
        if args[4] == 1:  # round_index
            raise RuntimeError("simulated crash while labelling round 2")
        return real(*args, **kwargs)

    monkeypatch.setattr(dpo_data, "label_round", crash_on_round_two)
    with pytest.raises(RuntimeError, match="simulated crash"):
        dpo.train(online_config(tiny_model, prompts4, tmp_path / "crashed"))
    monkeypatch.setattr(dpo_data, "label_round", real)
    resumed = dpo.train(online_config(tiny_model, prompts4, tmp_path / "crashed", resume="latest"))
    a, b = _trainable(straight), _trainable(resumed)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    assert (pq.read_table(straight / "feedback" / "round_2" / "pairs.parquet").to_pylist()
            == pq.read_table(resumed / "feedback" / "round_2" / "pairs.parquet").to_pylist())


def bad_input_cases(tiny_model, prompt_file, pair_parquet, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n# nothing\n")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("beta: 10\nlearning_rat: 0.1\n")
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not a parquet file")
    not_pipeline = tmp_path / "not_a_pipeline"
    not_pipeline.mkdir()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "config.yaml").write_text("model: x\n")
    out = str(tmp_path / "out")
    common = ["--model", tiny_model, "--output-dir", out]
    return {
        "unknown judge": (common + ["--reward", "nonexistent-judge", "--prompts", prompt_file], "unknown judge 'nonexistent-judge'; known judges: "),
        "weighted mix": (common + ["--reward", "jpeg-compressibility:0.5,random:0.5", "--prompts", prompt_file], "is a weighted mix of judges; one judge is needed here"),
        "missing API key": (common + ["--reward", "gpt4o", "--prompts", prompt_file], "OPENAI_API_KEY"),
        "both reward and dataset": (common + ["--reward", "jpeg-compressibility", "--prompts", prompt_file, "--dataset", pair_parquet], "exactly one of --reward"),
        "neither reward nor dataset": (common, "exactly one of --reward"),
        "missing prompt file": (common + ["--reward", "jpeg-compressibility", "--prompts", str(tmp_path / "nope.txt")], "nope.txt"),
        "empty prompt file": (common + ["--reward", "jpeg-compressibility", "--prompts", str(empty)], "empty.txt"),
        "unreadable dataset": (common + ["--dataset", str(garbage)], "garbage.parquet"),
        "unknown config key": (["--config", str(bad_yaml)] + common + ["--dataset", pair_parquet], "unknown key(s) learning_rat"),
        "beta not positive": (common + ["--dataset", pair_parquet, "--beta", "0"], "--beta must be in (0, 1000000]"),
        "no held-out seeds": (common + ["--dataset", pair_parquet, "--eval_images_per_prompt", "0"], "--eval_images_per_prompt must be in [1, 65536]"),
        "unknown lr schedule": (common + ["--dataset", pair_parquet, "--lr_scheduler", "exponential"], "--lr_scheduler must be one of"),
        "negative warm-up": (common + ["--dataset", pair_parquet, "--lr_warmup_steps", "-1"], "--lr_warmup_steps must be in [0, 2147483647]"),
        "periodic evaluation without held-out prompts": (common + ["--dataset", pair_parquet, "--eval_every_steps", "2"], "--eval_every_steps needs --eval_prompts and a judge"),
        "periodic evaluation without a judge": (common + ["--dataset", pair_parquet, "--eval_prompts", prompt_file, "--eval_every_steps", "2"], "--eval_every_steps needs --eval_prompts and a judge"),
        "pairwise-only held-out judge": (common + ["--dataset", pair_parquet, "--eval_prompts", prompt_file, "--eval_judge", "first-image"], "give a pointwise --eval_judge"),
        "rounds with a dataset": (common + ["--dataset", pair_parquet, "--feedback_rounds", "2"], "--feedback_rounds > 1 needs --reward"),
        "steps not a multiple of rounds": (common + ["--reward", "jpeg-compressibility", "--prompts", prompt_file, "--feedback_rounds", "3", "--max_steps", "4"], "must be a multiple of --feedback_rounds"),
        "more rounds than prompts": (common + ["--reward", "jpeg-compressibility", "--prompts", prompt_file, "--feedback_rounds", "4", "--max_steps", "4"], "fewer prompts than --feedback_rounds"),
        "not a pipeline": (["--model", str(not_pipeline), "--output-dir", out, "--dataset", pair_parquet], "is not a diffusers pipeline folder"),
        "folder holds a run": (["--model", tiny_model, "--output-dir", str(taken), "--dataset", pair_parquet], "already holds a run"),
    }


def test_bad_inputs_fail_fast_with_one_clear_message(tiny_model, prompt_file, pair_parquet, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    for name, (args, expected) in bad_input_cases(tiny_model, prompt_file, pair_parquet, tmp_path).items():
        with pytest.raises(SystemExit) as exit_info:
            dpo.main(args)
        err = capsys.readouterr().err
        assert exit_info.value.code not in (0, None), name
        assert expected in err, f"{name}: {err[-800:]}"
        assert err.count("error:") == 1, f"{name}: {err[-800:]}"
    # The refused run folder is untouched; nothing was trained.
    assert (tmp_path / "taken" / "config.yaml").read_text() == "model: x\n"
    assert not (tmp_path / "out").exists()  # nothing was written for any bad input


@pytest.mark.slow  # time budget; the fuzzer's sample runs the same refusals through main()
def test_cli_script_reports_bad_input_without_traceback(tiny_model, prompt_file, tmp_path):
    args = ["--model", tiny_model, "--output-dir", str(tmp_path / "o"), "--reward", "nonexistent-judge", "--prompts", prompt_file]
    result = run_cli(args)
    assert result.returncode == 2
    assert "unknown judge 'nonexistent-judge'" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("feedback", ["dataset", pytest.param("online-rounds", marks=pytest.mark.slow)])  # time budget
def test_two_process_cpu_run(tiny_model, pair_parquet, prompts4, tmp_path, feedback):
    out = tmp_path / "ddp"
    source = (["--dataset", pair_parquet] if feedback == "dataset" else
              ["--reward", "jpeg-compressibility", "--prompts", prompts4, "--feedback_rounds", "2"])
    result = launch_two_cpu_processes("align/dpo.py", [
        "--model", tiny_model, *source, "--output-dir", str(out), "--finetune", "lora",
        "--resolution", "16", "--train_batch_size", "1", "--gradient_accumulation_steps", "1", "--max_steps", "2",
        "--learning_rate", "1e-3", "--scale_lr", "false", "--lr_warmup_steps", "0", "--beta", "100",
        "--num_inference_steps", "2", "--checkpointing_steps", "2", "--report_to", "none",
    ])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "processes: 2" in result.stdout
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # one set of outputs, written by the main process only
    assert (out / "final" / "pytorch_lora_weights.safetensors").is_file()
    if feedback == "online-rounds":  # the main process labelled round 2 while the other waited
        assert len(pq.read_table(out / "feedback" / "round_2" / "pairs.parquet")) == 2


def test_testbed_config_runs_on_the_bundled_model(tmp_path):
    """The README's main command, shrunk: the YAML parses and runs end to end on the bundled testbed."""
    config = parse_config(
        DPOConfig,
        ["--config", str(ROOT / "configs" / "testbed_dpo.yaml"), "--prompts", "testbed-train:4:1", "--eval_prompts", "testbed-heldout:4:2",
         "--max_steps", "2", "--checkpointing_steps", "2", "--report_to", "none",
         "--eval_images_per_prompt", "2", "--output-dir", str(tmp_path / "run")],
    )
    assert config.model == "testbed" and config.reward == "shapes-oracle" and config.random_flip is False
    run = dpo.train(config)
    before = json.loads((run / "eval_before.json").read_text())
    after = json.loads((run / "eval_after.json").read_text())
    # 4 held-out prompts x 2 seeds; the first round keeps the one-seed-per-prompt seeds
    assert len(before["scores"]) == len(after["scores"]) == 8
    assert before["prompts"] == before["prompts"][:4] * 2 and before["seeds"] == list(range(1234, 1242))
    scores = np.array(before["scores"])
    assert 0.0 <= before["mean"] <= 1.0 and 0.0 <= after["mean"] <= 1.0
    assert before["mean"] == pytest.approx(scores.mean()) and before["sem"] == pytest.approx(scores.std(ddof=1) / np.sqrt(8))
    assert "standard error" in (run / "report.html").read_text()
    assert (run / "eval_before.png").is_file() and (run / "final" / "pytorch_lora_weights.safetensors").is_file()
