"""Best-of-N: the order-statistics curve, the knock-out bracket, and a run on a tiny pipeline."""

import itertools
import json

import numpy as np
import pytest
import torch

from align.cli import ConfigError
from align.eval import best_of_n as bon
from align.eval.generation import GenerationCache, ModelEntry
from align.testbed.models import build_pipeline
from align.testbed.tokenizer import testbed_tokenizer


def test_curve_sizes():
    assert bon.curve_sizes(1) == [1]
    assert bon.curve_sizes(16) == [1, 2, 4, 8, 16]
    assert bon.curve_sizes(6) == [1, 2, 4, 6]


def test_expected_best_of_n_matches_enumeration_of_subsets():
    rng = np.random.default_rng(0)
    selector = rng.normal(size=(3, 6))
    values = rng.normal(size=(3, 6))
    for n in (1, 2, 3, 6):
        brute = np.array(
            [np.mean([values[p, max(sub, key=lambda k: selector[p, k])] for sub in itertools.combinations(range(6), n)]) for p in range(3)]
        )
        assert bon.expected_best_of_n(selector, values, n) == pytest.approx(brute)
    # n = 1 is the plain mean, n = N the selector's argmax
    assert bon.expected_best_of_n(selector, values, 1) == pytest.approx(values.mean(axis=1))
    assert bon.expected_best_of_n(selector, values, 6) == pytest.approx(values[np.arange(3), selector.argmax(axis=1)])
    with pytest.raises(ValueError, match="between 1 and 6"):
        bon.expected_best_of_n(selector, values, 7)


def test_knockout_bracket_finds_the_best_of_each_prefix():
    strength = [3, 7, 1, 9, 4, 8, 2, 5]
    calls = []

    def compare(pairs):
        calls.append(len(pairs))
        return [strength[a] > strength[b] for a, b in pairs]

    winners = bon.knockout_winners(compare, 8)
    assert winners == {1: 0, 2: 1, 4: 3, 8: 3}
    assert calls == [4, 2, 1]  # N - 1 comparisons in all
    assert bon.knockout_winners(lambda pairs: [False] * len(pairs), 5)[5] in range(5)


def test_neighbour_noise_keeps_unit_variance():
    gen = torch.Generator().manual_seed(0)
    pivot = torch.randn(200_000, generator=gen)
    near = bon.neighbour_noise(pivot, 0.5, gen)
    assert near.std().item() == pytest.approx(1.0, abs=0.01)
    assert torch.corrcoef(torch.stack([pivot, near]))[0, 1].item() == pytest.approx(1 / np.sqrt(1.25), abs=0.01)


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bon") / "pipe"
    torch.manual_seed(1)
    build_pipeline(testbed_tokenizer()).save_pretrained(folder)
    return folder


def _config(tmp_path, model, **kw):
    base = dict(
        model=str(model), prompts="testbed", num_prompts=3, n=4, batch_size=8, num_inference_steps=2,
        guidance_scale=2.0, device="cpu", output_dir=str(tmp_path / "bon"),
    )
    return bon.BestOfNConfig(**{**base, **kw})


def test_best_of_n_run_shows_selector_gain_and_hacking(tmp_path, tiny_pipeline, monkeypatch):
    # JPEG size as the selector and its opposite as the second judge: a perfectly "hacked" verifier
    config = _config(tmp_path, tiny_pipeline, reward="jpeg-compressibility", eval_judges="jpeg-incompressibility",
                     search="zero-order", zo_neighbors=2, cache_dir=str(tmp_path / "candidates"))
    results = bon.best_of_n(config)
    sel, other = results["curves"]["jpeg-compressibility"], results["curves"]["jpeg-incompressibility"]
    assert results["sizes"] == [1, 2, 4]
    assert sel[0] < sel[1] < sel[2] and other[0] > other[1] > other[2]
    assert sel == pytest.approx([-v for v in other])
    # the N = 1 point is the mean over all candidates; the N = 4 point is the selector's maximum
    scores = np.array(results["scores"]["jpeg-compressibility"])
    assert sel[0] == pytest.approx(scores.mean()) and sel[-1] == pytest.approx(scores.max(axis=1).mean())
    out = tmp_path / "bon"
    assert sorted(p.name for p in (out / "chosen").iterdir()) == ["0000.png", "0001.png", "0002.png"]
    saved = json.loads((out / "results.json").read_text())
    assert saved["chosen"] == scores.argmax(axis=1).tolist()
    assert [t["candidates"] for t in saved["zero_order"]["trace"]] == [2, 4]
    assert "jpeg-incompressibility_final" in saved["zero_order"]
    # another selector on the same candidates: nothing is generated again, the picks swap roles
    def no_generation(*args, **kwargs):
        raise AssertionError("candidates were regenerated")

    monkeypatch.setattr(bon, "generate_from_noise", no_generation)
    swapped = bon.best_of_n(_config(tmp_path, tiny_pipeline, reward="jpeg-incompressibility", cache_dir=str(tmp_path / "candidates"),
                                    output_dir=str(tmp_path / "swapped")))
    assert swapped["curves"]["jpeg-incompressibility"][0] == pytest.approx(other[0])
    assert swapped["curves"]["jpeg-incompressibility"][-1] == pytest.approx(np.max(-scores, axis=1).mean())
    html = (out / "report.html").read_text()
    assert 'id="curve-table"' in html and html.count("<img") == 3 + 3 * 2  # a plot per judge + zero-order, 3 prompts x 2 images


def test_pairwise_selector_uses_a_knockout_bracket(tmp_path, tiny_pipeline):
    results = bon.best_of_n(_config(tmp_path, tiny_pipeline, reward="first-image", eval_judges="jpeg-compressibility,first-image"))
    assert results["selector_mode"] == "knockout"
    assert results["chosen"] == [0, 0, 0]  # the first image always wins
    assert len(set(results["curves"]["jpeg-compressibility"])) == 1  # so every N gives candidate 0
    # a pairwise-only second judge gets a win-rate curve against the N = 1 pick
    assert "first-image (win rate vs N=1)" in results["curves"]


def test_a_selector_without_its_api_key_stops_the_command_with_one_message(tmp_path, tiny_pipeline, capsys, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_:
        bon.main(["--model", str(tiny_pipeline), "--reward", "gpt4o", "--prompts", "testbed", "--num_prompts", "2",
                  "--n", "2", "--output_dir", str(tmp_path / "bon")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("error:") == 1 and "OPENAI_API_KEY" in err
    assert not (tmp_path / "bon").exists()


def test_bad_inputs_fail_early(tmp_path, tiny_pipeline):
    with pytest.raises(ConfigError, match="unknown judge"):
        bon.check_inputs(_config(tmp_path, tiny_pipeline, reward="nope"))
    with pytest.raises(ConfigError, match="--n"):
        bon.check_inputs(_config(tmp_path, tiny_pipeline, reward="random", n=0))
    with pytest.raises(ConfigError, match="zo_neighbors"):
        bon.check_inputs(_config(tmp_path, tiny_pipeline, reward="random", search="zero-order", zo_neighbors=8))


def test_a_rerun_regenerates_an_unfinished_batch_whole_and_keeps_the_images_it_has(tmp_path):
    """An image depends in its last bits on the batch it was generated in, so after a kill inside a batch's writes the
    rerun generates that batch as the first run did (issue 49) and saves only the images that are missing."""
    cache = GenerationCache(tmp_path, ModelEntry("m", "hub/model"), {"steps": 2}, None)
    items = [(f"prompt {i}", i) for i in range(7)]  # batches of 3: items 0-2, 3-5, 6
    assert cache.unfinished_batches(items, 3) == items
    for prompt, seed in items[:4]:  # the first batch written, the second killed after its first image
        cache.save(prompt, seed, torch.zeros(3, 4, 4))
    assert cache.unfinished_batches(items, 3) == items[3:]
    kept = cache.path(*items[3]).read_bytes()
    cache.save_missing(*items[3], torch.ones(3, 4, 4))
    cache.save_missing(*items[4], torch.ones(3, 4, 4))
    assert cache.path(*items[3]).read_bytes() == kept and cache.path(*items[4]).is_file()
