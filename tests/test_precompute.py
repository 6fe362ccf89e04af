"""align.data.precompute / align.data.latent_store: latents and text embeddings encoded once to disk, resumable,
refused when they do not fit, and training from them equal to training from the images."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from test_dpo import small_config

from align.data import precompute
from align.data.latent_store import StoreLatents, read_manifest, shard_name
from align.data.pairs import DataError, PreferencePair, pair_pixels
from align.pipeline import encode_images, encode_prompts, load_pipeline
from align.testing.tiny_sd import build_tiny_pipeline
from align.train import dpo


def _png(seed, size=16):
    g = torch.Generator().manual_seed(seed)
    buffer = io.BytesIO()
    Image.fromarray((torch.rand(size, size + 4, 3, generator=g) * 255).to(torch.uint8).numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def write_pairs(path, count=5, corrupt_row=None):
    rows = [{"caption": f"shape {i % 3}", "jpg_0": _png(2 * i), "jpg_1": _png(2 * i + 1),
             "label_0": float(i % 2), "label_1": float(1 - i % 2)} for i in range(count)]
    if corrupt_row is not None:
        rows[corrupt_row]["jpg_1"] = b"\x89PNG not really"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.parquet")


def build(model, dataset, out, *extra):
    args = precompute.parse_args(["--model", model, "--dataset", dataset, "--output", str(out), "--shard_size", "2",
                                  "--batch_size", "3", "--dtype", "float32", *extra])
    return precompute.precompute(args)


def test_store_round_trip_holds_the_trainers_latents_for_both_flips(tiny_model, pairs_file, tmp_path):
    store = build(tiny_model, pairs_file, tmp_path / "store")
    manifest = read_manifest(store)
    assert manifest["complete"] and manifest["num_pairs"] == 5 and manifest["resolution"] == 16
    assert sorted(p.name for p in store.glob("shard_*")) == [shard_name(i) for i in range(3)]
    pipe = load_pipeline(tiny_model)
    data = StoreLatents(store, manifest)
    table = pq.read_table(pairs_file).to_pylist()
    for k in (0, 3, 4):  # pair k is row k; even rows: image 1 won
        row = table[k]
        chosen, rejected = (row["jpg_0"], row["jpg_1"]) if k % 2 else (row["jpg_1"], row["jpg_0"])
        for flip in (False, True):
            item = data[(k, flip, False)]
            w, l_ = pair_pixels(PreferencePair(row["caption"], chosen, rejected, k), 16, flip)
            expected = encode_images(pipe, torch.stack([w, l_]))
            torch.testing.assert_close(item["latents_w"], expected[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(item["latents_l"], expected[1], rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            # The conditioning dict's every key, under "cond.<key>" (SD 1.x/2.x: prompt_embeds alone).
            torch.testing.assert_close(item["cond.prompt_embeds"], encode_prompts(pipe, [row["caption"]])[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(data[(k, False, True)]["cond.prompt_embeds"], encode_prompts(pipe, [""])[0],
                                       rtol=1e-5, atol=1e-5)


def test_a_store_written_before_manifests_carried_a_digest_is_refused(tiny_model, pairs_file, tmp_path):
    """Format 1 stores (text embeddings under "text") and the first format 2 ones carried no digest of their manifest:
    nothing vouches for what they say of their latents, so they are refused with the way out (issue 61)."""
    store = build(tiny_model, pairs_file, tmp_path / "store")
    written = read_manifest(store)
    for old_format in (1, 2):
        manifest = {**{k: v for k, v in written.items() if k != "digest"}, "format": old_format}
        (store / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(DataError, match="rebuild the store"):
            read_manifest(store)


def test_interrupted_precompute_resumes_to_the_same_bytes(tiny_model, pairs_file, tmp_path):
    whole = build(tiny_model, pairs_file, tmp_path / "whole")

    class Killed(Exception):
        pass

    def die_after_first(shard):
        if shard == 0:
            raise Killed

    args = precompute.parse_args(["--model", tiny_model, "--dataset", pairs_file, "--output", str(tmp_path / "cut"),
                                  "--shard_size", "2", "--batch_size", "3", "--dtype", "float32"])
    with pytest.raises(Killed):
        precompute.precompute(args, after_shard=die_after_first)
    cut = tmp_path / "cut"
    assert not read_manifest(cut)["complete"] and [p.name for p in cut.glob("shard_*")] == [shard_name(0)]
    first = (cut / shard_name(0)).stat().st_mtime_ns
    build(tiny_model, pairs_file, cut)
    assert (cut / shard_name(0)).stat().st_mtime_ns == first  # the finished shard was kept, not redone
    for name in [shard_name(i) for i in range(3)] + ["empty_text.safetensors", "manifest.json"]:
        assert (cut / name).read_bytes() == (whole / name).read_bytes(), name


def test_training_from_the_store_equals_training_from_images(tiny_model, pairs_file, tmp_path):
    store = build(tiny_model, pairs_file, tmp_path / "store")
    settings = dict(max_steps=3, checkpointing_steps=10, caption_dropout=0.5)
    from_images = dpo.train(small_config(tiny_model, tmp_path / "images", dataset=pairs_file, latent_store="none", **settings))
    from_store = dpo.train(small_config(tiny_model, tmp_path / "stored", latent_store=str(store), dataloader_num_workers=1, **settings))
    a = [json.loads(line) for line in (from_images / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (from_store / "metrics.jsonl").read_text().splitlines()]
    assert len(a) == len(b) == 3
    for x, y in zip(a, b):
        for key in ("loss", "model_mse", "ref_mse", "implicit_acc"):
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), key


def test_latent_store_run_builds_the_runs_store_once_and_trains_as_from_images(tiny_model, pairs_file, tmp_path):
    settings = dict(dataset=pairs_file, max_steps=2, checkpointing_steps=10, caption_dropout=0.5)
    cached = dpo.train(small_config(tiny_model, tmp_path / "cached", **settings))  # the default: --latent_store run
    plain = dpo.train(small_config(tiny_model, tmp_path / "plain", latent_store="none", **settings))
    manifest = read_manifest(cached / "latents")
    assert manifest is not None and manifest["num_pairs"] == 5  # every pair encoded once, into the run folder
    assert not (plain / "latents").exists()
    a = [json.loads(line) for line in (cached / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (plain / "metrics.jsonl").read_text().splitlines()]
    for x, y in zip(a, b, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-7)


def test_resume_mid_epoch_from_images_with_workers_is_exact(tiny_model, pairs_file, tmp_path):
    """5 pairs, 2 a step: step 2 starts mid-epoch. The resumed half reads through two workers."""
    common = dict(dataset=pairs_file, latent_store="none", max_steps=4)
    straight = dpo.train(small_config(tiny_model, tmp_path / "straight", **common))
    dpo.train(small_config(tiny_model, tmp_path / "halves", **{**common, "max_steps": 2}))
    resumed = dpo.train(small_config(tiny_model, tmp_path / "halves", resume="latest", dataloader_num_workers=2, **common))
    a = load_file(str(straight / "final" / "pytorch_lora_weights.safetensors"))
    b = load_file(str(resumed / "final" / "pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _fails(capsys, call, *expected):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        call()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]  # progress bars aside: one line
    assert "Traceback" not in err
    for text in expected:
        assert text in line, err


def test_refusals_are_one_line_and_lose_nothing(tiny_model, pairs_file, tmp_path, capsys):
    store = build(tiny_model, pairs_file, tmp_path / "store")
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    other_model = str(build_tiny_pipeline(tmp_path / "other", seed=1))
    out = tmp_path / "run"
    common = ["--output-dir", str(out), "--report_to", "none", "--max_steps", "1"]

    # A store from another model, or for another resolution: refused before the run folder is written.
    _fails(capsys, lambda: dpo.main(["--model", other_model, "--latent_store", str(store), *common]),
           "was encoded by another model")
    _fails(capsys, lambda: dpo.main(["--model", tiny_model, "--latent_store", str(store), "--resolution", "32", *common]),
           "holds 16 px latents but this run trains at 32 px")
    assert not out.exists()
    # Precompute into a folder that holds another build (other resolution): refused, the store untouched.
    _fails(capsys, lambda: precompute.main(["--model", tiny_model, "--dataset", pairs_file, "--output", str(store),
                                            "--shard_size", "2", "--dtype", "float32", "--resolution", "32"]),
           "holds another build", "resolution 16 -> 32")
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before
    # A dataset without the Pick-a-Pic columns: nothing written.
    pq.write_table(pa.table({"caption": ["x"], "image": [b"y"]}), tmp_path / "cols.parquet")
    _fails(capsys, lambda: precompute.main(["--model", tiny_model, "--dataset", str(tmp_path / "cols.parquet"),
                                            "--output", str(tmp_path / "s2")]), "lacks the column(s)")
    assert not (tmp_path / "s2").exists()
    # An unreadable image in shard 1 (row 3): one line naming the row; shard 0 is kept.
    broken = write_pairs(tmp_path / "broken.parquet", corrupt_row=3)
    _fails(capsys, lambda: precompute.main(["--model", tiny_model, "--dataset", broken, "--output", str(tmp_path / "s3"),
                                            "--shard_size", "2"]), "row 3 holds an unreadable image")
    assert [p.name for p in (tmp_path / "s3").glob("shard_*")] == [shard_name(0)]


def test_unreadable_image_stops_training_with_one_line_naming_the_row(tiny_model, tmp_path, capsys):
    broken = write_pairs(tmp_path / "broken.parquet", corrupt_row=3)
    _fails(capsys, lambda: dpo.main(["--model", tiny_model, "--dataset", broken, "--output-dir", str(tmp_path / "run"),
                                     "--report_to", "none", "--latent_store", "none", "--resolution", "16",
                                     "--finetune", "lora", "--train_batch_size", "5", "--gradient_accumulation_steps", "1",
                                     "--max_steps", "1"]),
           "row 3 holds an unreadable image")
