"""Evaluation, best-of-N, AI feedback and the judge comparison on the other model families (issue 41).

Tiny random SDXL (align/testing/tiny_sdxl.py) and SD3 / FLUX (align/testing/tiny_flow.py) pipelines, a LoRA run folder
made with the family's own ``save_lora``, and the commands run as a user runs them.
"""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file
from script_loader import load_script

import rewards
from align.data.feedback import derive_seed, generate_feedback, make_pipeline_generator
from align.eval import best_of_n as bon
from align.eval import evaluate as ev
from align.eval.generation import (
    GenerationCache,
    ModelEntry,
    model_fingerprint,
    sample_seed,
    sampling_settings,
)
from align.families import family_of, family_of_pipeline
from align.pipeline import ModelLoadError, add_lora, generate_images, load_trained, save_full_unet
from align.run_folder import CONFIG_FILE
from align.testing.tiny_flow import T5_MAX_SEQUENCE_LENGTH, build_tiny_flux, build_tiny_sd3
from align.testing.tiny_sdxl import build_tiny_sdxl_pipeline
from rewards.images import decode_image


def build(family: str, folder):
    if family == "sdxl":

        return build_tiny_sdxl_pipeline(folder)

    return (build_tiny_sd3 if family == "sd3" else build_tiny_flux)(folder)


def lora_run(base, run_dir, seed: int = 0):
    """A finished run folder (config.yaml naming the base, final/ holding a LoRA) with LoRA weights large
    enough to change the images (a fresh adapter's B matrices are zero)."""
    family = family_of(str(base))
    pipe = family.load_pipeline(str(base), torch.float32, "cpu")
    denoiser = add_lora(family.denoiser(pipe), rank=2, target_modules=family.lora_targets)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in denoiser.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    family.save_lora(denoiser, run_dir / "final")
    (run_dir / CONFIG_FILE).write_text(yaml.safe_dump({"model": str(base)}))
    return run_dir


@pytest.fixture(scope="module", params=["sd3", "sdxl", "flux"])
def base_and_run(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = build(request.param, root / "base")
    return request.param, base, lora_run(base, root / "run")


def _pngs(folder) -> dict[str, np.ndarray]:
    return {p.name: np.asarray(Image.open(p), dtype=int) for p in sorted(folder.glob("*.png"))}


def test_evaluate_and_best_of_n_commands_on_a_base_and_its_lora_run(base_and_run, tmp_path, capsys):
    family, base, run = base_and_run
    out = tmp_path / "eval"
    ev.main(["--models", f"base={base},lora={run}", "--judges", "jpeg-compressibility,shapes-oracle",
             "--prompts", "testbed", "--num_prompts", "3", "--num_inference_steps", "2", "--resolution", "32", "--device", "cpu",
             "--fid_reference", "testbed", "--fid_feature", "pixels", "--output_dir", str(out), "--quiet"])
    saved = json.loads((out / "results.json").read_text())
    assert (out / "report.html").is_file() and (out / "results.csv").is_file()
    assert [m["images_generated"] for m in saved["models"]] == [3, 3]
    assert saved["sampling"]["num_inference_steps"] == 2
    for judge in ("jpeg-compressibility", "shapes-oracle"):
        assert set(saved["judges"][judge]["per_model"]) == {"base", "lora"}
    assert all(np.isfinite(saved["fid"][name]) for name in ("base", "lora"))
    # the LoRA run's images are not the base's: same prompts and noise, other weights
    folders = {m: next((out / "generations").glob(f"{m}-*")) for m in ("base", "lora")}
    base_images, lora_images = _pngs(folders["base"]), _pngs(folders["lora"])
    assert base_images.keys() == lora_images.keys() and len(base_images) == 3
    assert next(iter(base_images.values())).shape == (32, 32, 3)
    assert max(np.abs(base_images[k] - lora_images[k]).max() for k in base_images) > 8

    # best-of-N on the run folder: candidates, curve, chosen images and report
    bon_out = tmp_path / "bon"
    bon.main(["--model", str(run), "--reward", "jpeg-compressibility", "--eval_judges", "shapes-oracle",
              "--prompts", "testbed", "--num_prompts", "2", "--n", "4", "--num_inference_steps", "2",
              "--resolution", "32", "--search", "zero-order", "--zo_neighbors", "2", "--device", "cpu",
              "--output_dir", str(bon_out), "--quiet"])
    results = json.loads((bon_out / "results.json").read_text())
    scores = np.array(results["scores"]["jpeg-compressibility"])
    assert scores.shape == (2, 4) and results["sizes"] == [1, 2, 4]
    curve = results["curves"]["jpeg-compressibility"]
    assert curve[0] == pytest.approx(scores.mean()) and curve[-1] == pytest.approx(scores.max(axis=1).mean())
    assert sorted(p.name for p in (bon_out / "chosen").iterdir()) == ["0000.png", "0001.png"]
    # zero-order search moves the starting noise itself (FLUX: packed for the pipeline)
    assert [t["candidates"] for t in results["zero_order"]["trace"]] == [2, 4]
    trace = [t["selector"] for t in results["zero_order"]["trace"]]
    assert trace[1] >= trace[0] and np.isfinite(results["zero_order"]["shapes-oracle_final"])
    assert (bon_out / "report.html").is_file()
    assert "wrote" in capsys.readouterr().out


def test_a_best_of_n_candidate_is_the_image_its_seed_gives(base_and_run):
    """Best-of-N draws each candidate's starting noise itself (so that zero-order search can move it): it must
    be the noise the family's pipeline draws for the same seed, so a candidate is regenerated from its seed."""
    family, base, run = base_and_run
    pipe = load_trained(str(run))
    settings = sampling_settings(ev.EvalConfig(num_inference_steps=2, resolution=32), str(base))
    shape = bon.latent_shape(pipe, settings["resolution"])
    prompts, seeds = ["a red circle", "two blue squares"], [7, 123]
    noises = torch.stack([bon.seed_noise(s, shape) for s in seeds])
    from_noise = bon.generate_from_noise(pipe, prompts, noises, settings, batch_size=2)
    from_seed = generate_images(pipe, prompts, seeds, num_inference_steps=2, guidance_scale=settings["guidance_scale"],
                                height=settings["resolution"], width=settings["resolution"])
    assert from_noise.shape == from_seed.shape == (2, 3, 32, 32)
    torch.testing.assert_close(from_noise, from_seed, atol=1e-5, rtol=0)


def test_sampling_settings_come_from_the_pipeline_family_and_flow_testbed_json(tmp_path, base_and_run):
    family, base, run = base_and_run
    settings = sampling_settings(ev.EvalConfig(), str(run))  # a run folder: its base's settings
    # the pipeline's own __call__ defaults: SD3 28 steps / 7.0, SDXL 50 / 5.0, FLUX 28 / 3.5 (not SD v1.5's 50 / 7.5)
    expected = {"sd3": (28, 7.0), "sdxl": (50, 5.0), "flux": (28, 3.5)}[family]
    assert (settings["num_inference_steps"], settings["guidance_scale"]) == expected
    assert sampling_settings(ev.EvalConfig(num_inference_steps=3, guidance_scale=1.5), str(run))["guidance_scale"] == 1.5
    if family == "sd3":  # a flow testbed's file wins over the defaults; the family passes its T5 length
        flow_json = base / "flow_testbed.json"
        stored = json.loads(flow_json.read_text())
        flow_json.write_text(json.dumps({**stored, "num_inference_steps": 6, "guidance_scale": 2.5, "resolution": 32}))
        try:
            assert sampling_settings(ev.EvalConfig(), str(run)) == {"num_inference_steps": 6, "guidance_scale": 2.5,
                                                                    "resolution": 32}
        finally:
            flow_json.write_text(json.dumps(stored))
        pipe = load_trained(str(base))
        assert family_of_pipeline(pipe).generation_kwargs(pipe) == {"max_sequence_length": stored["max_sequence_length"]}


def test_generation_cache_key_follows_the_base_files_under_a_lora(tmp_path, base_and_run):
    family, base, run = base_and_run
    entry = ModelEntry("lora", str(run))
    settings = {"num_inference_steps": 2, "guidance_scale": 3.0, "resolution": None}
    before = GenerationCache(tmp_path, entry, settings, str(base)).folder
    assert GenerationCache(tmp_path, entry, settings, str(base)).folder == before
    fingerprint = model_fingerprint(str(base))
    marker = base / "notes.txt"  # any model file of the base changing (a rebuilt testbed) changes the key
    marker.write_text("rebuilt")
    try:
        assert model_fingerprint(str(base)) != fingerprint
        assert GenerationCache(tmp_path, entry, settings, str(base)).folder != before
    finally:
        marker.unlink()


def test_load_trained_takes_a_run_with_a_full_denoiser_folder(tmp_path, base_and_run):
    family, base, _ = base_and_run
    fam = family_of(str(base))
    pipe = fam.load_pipeline(str(base), torch.float32, "cpu")
    denoiser = fam.denoiser(pipe)
    name, param = next((n, p) for n, p in denoiser.named_parameters() if n.endswith("bias"))
    with torch.no_grad():
        param.add_(0.25)
    run = tmp_path / "full-run"
    assert save_full_unet(denoiser, run / "final", family=fam).name == fam.denoiser_name
    (run / CONFIG_FILE).write_text(yaml.safe_dump({"model": str(base)}))
    loaded = load_trained(str(run))
    torch.testing.assert_close(dict(fam.denoiser(loaded).named_parameters())[name], param.detach())


@pytest.fixture(scope="module")
def flow_testbed_like(tmp_path_factory):
    """A tiny SD3 pipeline with a flow testbed's settings file (steps, guidance, resolution, T5 length)."""
    base = build("sd3", tmp_path_factory.mktemp("flowtb"))
    settings = {"num_inference_steps": 3, "guidance_scale": 3.0, "resolution": 32,
                "max_sequence_length": T5_MAX_SEQUENCE_LENGTH}
    (base / "flow_testbed.json").write_text(json.dumps(settings))
    return base


def test_ai_feedback_pairs_from_a_flow_pipeline(tmp_path, flow_testbed_like):
    pipe = load_trained(str(flow_testbed_like))
    generate = make_pipeline_generator(pipe, num_inference_steps=3, guidance_scale=3.0, batch_size=4)
    prompts = ["a red circle", "two blue squares", "a green triangle on the left"]
    out = tmp_path / "feedback.parquet"
    stats = generate_feedback(generate, rewards.load("jpeg-compressibility"), prompts, out, images_per_prompt=3, seed=5,
                              progress=False)
    assert (stats.labelled, stats.pairs, stats.images_generated) == (3, 3, 9)
    rows = pq.read_table(out).to_pylist()
    assert sorted(r["prompt_index"] for r in rows) == [0, 1, 2]
    row = rows[0]
    assert row["seed_0"] != row["seed_1"] and {row["seed_0"], row["seed_1"]} <= {derive_seed(5, 0, k) for k in range(3)}
    stored = np.asarray(decode_image(row["jpg_0"]), dtype=int)
    assert stored.shape == (32, 32, 3)
    # the stored image is the one the family's pipeline call gives for its seed (its T5 length included) ...
    again = generate_images(pipe, [row["caption"]], [row["seed_0"]], num_inference_steps=3, guidance_scale=3.0)
    assert np.abs(stored - np.round(again[0].permute(1, 2, 0).numpy() * 255)).max() <= 1
    # ... which matters: SD3's default T5 length (256 zero rows) gives another image
    default = pipe(prompt=[row["caption"]], generator=[torch.Generator().manual_seed(row["seed_0"])],
                   num_inference_steps=3, guidance_scale=3.0, output_type="pt").images
    assert (again - default).abs().max() > 0.02


@pytest.mark.filterwarnings("ignore:An input array is constant")  # random tiny models: equal oracle scores are likely
def test_judge_comparison_on_a_flow_model(tmp_path, flow_testbed_like):
    """scripts/compare_judges.py on a tiny SD3 model, as on the SD testbed: each judge labels the same base
    images, its accuracy against the oracle is measured, Diffusion-DPO (flow-matching loss, LoRA) trains one
    model per judge on its labels, and every model is evaluated downstream."""
    cj = load_script("compare_judges")
    out = tmp_path / "compare"
    cj.main(["--model", str(flow_testbed_like), "--judges", "shapes-oracle,random", "--trainer_config",
             "configs/testbed_dpo.yaml", "--max_steps", "2", "--trainer_overrides", "train_batch_size=4",
             "--train_prompts", "testbed-train:4", "--eval_num_prompts", "3", "--fid_feature", "pixels", "--batch_size", "8",
             "--output_dir", str(out)])
    payload = json.loads((out / "compare.json").read_text())
    rows = {row["judge"]: row for row in payload["table"]}
    assert set(rows) == {"shapes-oracle", "random"}
    assert rows["shapes-oracle"]["accuracy vs oracle"] == pytest.approx(1.0)  # the oracle agrees with itself
    assert all(np.isfinite(row["oracle score"]) for row in rows.values())

    for run in payload["runs"].values():  # each judge's model: a trained LoRA of the SD3 transformer
        lora = load_file(Path(run) / "final" / "pytorch_lora_weights.safetensors")
        assert lora and all(key.startswith("transformer.") for key in lora)
        assert max(v.abs().max().item() for k, v in lora.items() if "lora_B" in k) > 0  # B starts at zero
    evaluated = json.loads((out / "eval" / "results.json").read_text())
    assert evaluated["sampling"] == {"num_inference_steps": 3, "guidance_scale": 3.0, "resolution": 32}
    assert [m["images_generated"] for m in evaluated["models"]] == [3, 3, 3]
    assert (out / "report.html").is_file() and (out / "compare.csv").is_file()


def test_dtype_flag_generates_in_bfloat16_under_its_own_cache_key(tmp_path, flow_testbed_like, capsys):
    out = tmp_path / "eval"
    args = ["--models", f"base={flow_testbed_like}", "--judges", "jpeg-compressibility", "--prompts", "testbed",
            "--num_prompts", "2", "--device", "cpu", "--output_dir", str(out), "--quiet"]
    ev.main(args)
    ev.main([*args, "--dtype", "bfloat16"])
    saved = json.loads((out / "results.json").read_text())
    assert saved["sampling"]["dtype"] == "bfloat16" and saved["models"][0]["images_generated"] == 2
    folders = sorted((out / "generations").iterdir())
    assert len(folders) == 2  # float32 and bfloat16 images kept apart
    float32, bfloat16 = (_pngs(f) for f in sorted(folders, key=lambda f: "dtype" in json.loads((f / "meta.json").read_text())))
    diff = [np.abs(float32[k] - bfloat16[k]).max() for k in float32]
    assert 0 < max(diff) and np.mean([np.abs(float32[k] - bfloat16[k]).mean() for k in float32]) < 8  # ~0.7 measured
    with pytest.raises(SystemExit):
        bon.main(["--model", str(flow_testbed_like), "--reward", "jpeg-compressibility", "--dtype", "fp8",
                  "--output_dir", str(tmp_path / "bon")])
    assert "--dtype must be one of float32, bfloat16, float16, got 'fp8'" in capsys.readouterr().err
    assert not (tmp_path / "bon").exists()


def test_evaluate_across_families_samples_each_with_its_own_settings(tmp_path, flow_testbed_like, tiny_model):
    """SD v1.5 architecture as the base against a LoRA run of an SD3 model: the run loads on its own base (its
    config.yaml), and samples with its family's settings (flow_testbed.json), not the SD base's 50 steps / 7.5."""
    run = lora_run(flow_testbed_like, tmp_path / "sd3-run")
    out = tmp_path / "eval"
    ev.main(["--models", f"sd={tiny_model},sd3={run}", "--judges", "jpeg-compressibility", "--prompts", "testbed",
             "--num_prompts", "2", "--device", "cpu", "--output_dir", str(out), "--quiet"])
    saved = json.loads((out / "results.json").read_text())
    sd, sd3 = saved["models"]
    assert sd["sampling"] == saved["sampling"] == {"num_inference_steps": 50, "guidance_scale": 7.5, "resolution": None}
    assert sd3["sampling"] == {"num_inference_steps": 3, "guidance_scale": 3.0, "resolution": 32}
    sizes = {m: next(iter(_pngs(next((out / "generations").glob(f"{m}-*"))).values())).shape for m in ("sd", "sd3")}
    assert sizes == {"sd": (16, 16, 3), "sd3": (32, 32, 3)}
    assert set(saved["judges"]["jpeg-compressibility"]["per_model"]) == {"sd", "sd3"}
    # the SD3 run's images are its own model's (its LoRA on its SD3 base), not the SD base's
    cache = GenerationCache(out / "generations", ModelEntry("sd3", str(run)), sd3["sampling"], str(flow_testbed_like))
    prompt = saved["prompts"][0]
    own = generate_images(load_trained(str(run)), [prompt], [sample_seed(0, prompt)], num_inference_steps=3,
                          guidance_scale=3.0, height=32, width=32)
    assert (cache.load([(prompt, 0)]) - own).abs().max() <= 1 / 255 + 1e-6
    # a LoRA put on a pipeline of another family is refused, not silently ignored
    with pytest.raises(ModelLoadError, match="holds no LoRA weights for the unet"):
        load_trained(str(run), base=tiny_model)
