"""The SQLite judge cache: what the key depends on, persistence, raw answers, and the judge's use of it."""

import threading
from dataclasses import dataclass, field

import pytest
import torch
from PIL import Image

import rewards
from rewards import judge_prompts
from rewards.cache import CachedAnswer, JudgeCache, cache_key, image_hash
from rewards.judge_prompts import JudgeQuestion
from rewards.mllm import MllmJudge
from rewards.parsing import parse_answer

DECODING = {"temperature": 0.0, "max_tokens": 512}


def test_key_changes_with_every_ingredient():
    base = ("openai:gpt-4o", JudgeQuestion().key(), "prompt", ["h1"], DECODING)
    key = cache_key(*base)
    variants = [
        ("openai:gpt-4.1", *base[1:]),
        (base[0], JudgeQuestion(mode="likert").key(), *base[2:]),
        (*base[:2], "prompt2", *base[3:]),
        (*base[:3], ["h2"], base[4]),
        (*base[:4], {**DECODING, "temperature": 1.0}),
    ]
    keys = {cache_key(*v) for v in variants}
    assert key not in keys and len(keys) == len(variants)
    assert cache_key(*base) == key  # deterministic
    assert cache_key(*base[:3], ["h1", "h2"], DECODING) != cache_key(*base[:3], ["h2", "h1"], DECODING)


def test_template_version_is_in_the_key(monkeypatch):
    before = JudgeQuestion().key()
    monkeypatch.setattr(judge_prompts, "TEMPLATE_VERSION", "mjb-v999")
    assert JudgeQuestion().key() != before


def test_image_hash_depends_on_pixels_not_object():
    a = Image.new("RGB", (4, 4), (10, 20, 30))
    assert image_hash(a) == image_hash(a.copy())
    b = a.copy()
    b.putpixel((0, 0), (10, 20, 31))
    assert image_hash(a) != image_hash(b)
    assert image_hash(a) != image_hash(a.resize((4, 5)))


def test_answers_persist_across_reopen_and_keep_raw_text(tmp_path):
    path = tmp_path / "sub" / "judge.sqlite"
    store = JudgeCache(path)
    store.put("k1", judge="j", question="q", prompt="p", image_hashes=["h"], decoding=DECODING,
              answer=CachedAnswer("Rating: 7", 120, 9))
    store.close()
    reopened = JudgeCache(path)
    hit = reopened.get("k1")
    assert (hit.raw, hit.input_tokens, hit.output_tokens) == ("Rating: 7", 120, 9)
    assert reopened.get("missing") is None
    rows = reopened.rows(judge="j")
    assert len(rows) == 1 and rows[0]["raw"] == "Rating: 7" and rows[0]["prompt"] == "p"
    # parsing can be redone from the stored raw text, without calls
    assert parse_answer(rows[0]["raw"], JudgeQuestion()).value == 7.0
    assert len(reopened) == 1


def test_concurrent_writers(tmp_path):
    store = JudgeCache(tmp_path / "c.sqlite")

    def write(t):
        for i in range(50):
            store.put(f"{t}-{i}", judge="j", question="q", prompt="p", image_hashes=[], decoding={},
                      answer=CachedAnswer(str(i)))

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(store) == 200


@dataclass
class CountingJudge(MllmJudge):
    """An in-process judge: answers 'Rating: <n>' with n = number of calls so far (so reuse is visible)."""

    model: str = "counter"
    asked: list = field(default_factory=list)

    @property
    def judge_id(self):
        return "test:counter"

    def _generate(self, requests, on_answer):
        for i, req in enumerate(requests):
            self.asked.append(req.caption)
            on_answer(i, CachedAnswer(f"Rating: {len(self.asked)}", 10, 2))


def test_judge_reads_cache_before_asking_and_asks_duplicates_once(tmp_path):
    cache = str(tmp_path / "judge.sqlite")
    images = torch.rand(3, 3, 8, 8)
    first = CountingJudge(cache_path=cache)
    s1 = first.score(["a", "b", "a"], torch.stack([images[0], images[1], images[0]]))
    assert first.asked == ["a", "b"] and s1.tolist() == [1.0, 2.0, 1.0]
    first.close()
    second = CountingJudge(cache_path=cache)
    s2 = second.score(["a", "b", "c"], images)
    assert second.asked == ["c"]  # only the new question
    assert s2.tolist()[:2] == [1.0, 2.0] and second.stats.cache_hits == 2
    assert [a.cached for a in second.last_answers] == [True, True, False]
    # other decoding settings are another question
    hotter = CountingJudge(cache_path=cache, temperature=0.7)
    hotter.score(["a"], images[:1])
    assert hotter.asked == ["a"]


def test_judge_options_are_validated():
    with pytest.raises(ValueError, match="inconsistent"):
        CountingJudge(inconsistent="coin")
    with pytest.raises(ValueError, match="temperature"):
        CountingJudge(temperature=5)
    with pytest.raises(ValueError, match="scale"):
        CountingJudge(scale="1-5")


@pytest.mark.parametrize("spec, message", [
    ("clip[path=/some/folder]", "judge 'clip' has no option 'path'; its options: model, processor, variant"),
    ("shapes-oracle[nosie=0.2]", "judge 'shapes-oracle' has no option 'nosie'; its options: name, tie_margin, noise"),
    ("gpt4o[bogus=1]", "judge 'gpt4o': ApiJudge.__init__() got an unexpected keyword argument 'bogus'"),  # options passed on
])
def test_an_option_the_judge_does_not_take_is_named_before_anything_loads(spec, message):
    with pytest.raises(rewards.JudgeOptionError) as err:
        rewards.load(spec)
    assert str(err.value).startswith(message)
