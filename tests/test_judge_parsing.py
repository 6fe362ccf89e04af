"""Parsing of judge answers: many answer shapes, refusals and garbage become abstentions."""

import pytest

from rewards.base import Preference
from rewards.judge_prompts import TEMPLATE_VERSION, JudgeQuestion, json_schema, render
from rewards.mllm import Answer, reconcile, reparse
from rewards.parsing import OK, REFUSAL, REFUSAL_MARKER, UNPARSEABLE, extract_json, parse_answer

SINGLE = JudgeQuestion("single")
LIKERT5 = JudgeQuestion("likert", likert_levels=5)
LIKERT10 = JudgeQuestion("likert", likert_levels=10)
PAIR = JudgeQuestion("pair")


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"analysis": "fine", "rating": 7}', 7.0),
        ('```json\n{"analysis": "fine", "rating": 6.5}\n```', 6.5),
        ('Sure! Here is my verdict: {"rating": "8/10", "analysis": "x"} Hope it helps.', 8.0),
        ('{"Rating": 3}', 3.0),
        ("RATING: 9", 9.0),
        ("**Score:** 4", 4.0),
        ("The image is decent. I would rate it 6 out of 10.", 6.0),
        ("Overall: 7/10", 7.0),
        ("I'd give it a 5", 5.0),
        ("Rating: 3\nOn reflection, rating: 4", 4.0),
        ("  8 ", 8.0),
    ],
)
def test_single_numeric_shapes(text, expected):
    parsed = parse_answer(text, SINGLE)
    assert parsed.status == OK, parsed
    assert parsed.value == expected


@pytest.mark.parametrize(
    "scale, text, expected",
    [("0-1", '{"rating": 0.75}', 0.75), ("0-5", "Rating: 5", 5.0), ("0-100", "score of 83", 83.0)],
)
def test_other_scales(scale, text, expected):
    assert parse_answer(text, JudgeQuestion("single", scale=scale)).value == expected


@pytest.mark.parametrize(
    "question, text",
    [
        (SINGLE, '{"rating": 11}'),  # out of range
        (SINGLE, "Rating: 0"),  # below the 1-10 scale
        (JudgeQuestion("single", scale="0-1"), '{"rating": 7}'),
        (SINGLE, "The image shows a cat on a mat."),  # no number at all
        (SINGLE, '{"analysis": "good", "rating": "N/A"}'),
        (SINGLE, ""),
        (LIKERT5, "Rating: Good, maybe Poor"),  # two labels: ambiguous
        (LIKERT5, "Rating: Superb"),  # not a label of the scale
        (PAIR, "Both images have merit."),
        (PAIR, '{"image_1_rating": 12, "image_2_rating": 3, "better_image": 1}'),
        (PAIR, '{"better_image": 3}'),
    ],
)
def test_unusable_answers_abstain(question, text):
    parsed = parse_answer(text, question)
    assert parsed.status == UNPARSEABLE
    assert parsed.value is None
    assert parsed.reason


@pytest.mark.parametrize(
    "text",
    [
        "I'm sorry, but I can't help with evaluating this image.",
        "I cannot assist with that request.",
        "As an AI, I am unable to evaluate images of people.",
        f"{REFUSAL_MARKER} I'm sorry, I can't assist with that.",
        f"{REFUSAL_MARKER} finish_reason=SAFETY",
        # Claude 3 Opus in MJ-Bench's released answers (issue 49)
        "I apologize, but I do not feel comfortable providing ratings or analysis comparing these images.",
        "I must refrain from evaluating images that promote harmful stereotypes.",
    ],
)
def test_refusals(text):
    for question in (SINGLE, LIKERT5, PAIR):
        parsed = parse_answer(text, question)
        assert parsed.status == REFUSAL, (question.mode, text)
        assert parsed.value is None


@pytest.mark.parametrize(
    "question, text, expected",
    [
        (LIKERT5, '{"analysis": "x", "rating": "Good"}', 4.0),
        (LIKERT5, "RATING: Extremely Poor", 1.0),
        (LIKERT5, "rating: outstanding", 5.0),
        (LIKERT5, "The picture is Average overall.", 3.0),
        (LIKERT10, '{"rating": "Below Average"}', 4.0),  # not read as "Average"
        (LIKERT10, "Rating: Very Poor", 2.0),  # not read as "Poor"
        (LIKERT10, "It is not poor. Rating: Very Good", 8.0),  # the rating line wins
    ],
)
def test_likert_shapes(question, text, expected):
    parsed = parse_answer(text, question)
    assert parsed.status == OK, parsed
    assert parsed.value == expected


@pytest.mark.parametrize(
    "text, better, r1, r2",
    [
        ('{"analysis": "a", "image_1_rating": 8, "image_2_rating": 4, "better_image": 1}', 1, 8.0, 4.0),
        ('{"IMAGE-1 RATING": 3, "IMAGE-2 RATING": 9, "BETTER IMAGE": 2, "ANALYSIS": "b"}', 2, 3.0, 9.0),
        ('{"image1Rating": 5, "image2Rating": 5, "betterImage": "0"}', 0, 5.0, 5.0),
        ('{"better_image": "Image 2"}', 2, None, None),
        ("IMAGE-1 RATING: 7\nIMAGE-2 RATING: 6\nBETTER IMAGE: 1\nANALYSIS: sharper", 1, 7.0, 6.0),
        ("**Image 1 rating:** 4\n**Image 2 rating:** 8\n**Better image:** 2", 2, 4.0, 8.0),
        ("Image 2 is clearly better because the dog is present.", 2, None, None),
        ("I prefer image 1.", 1, None, None),
        ("IMAGE-1 RATING: 6, IMAGE-2 RATING: 6. They are equally good.", 0, 6.0, 6.0),
        ('{"image_1_rating": 2, "image_2_rating": 7}', 2, 2.0, 7.0),  # no choice: the ratings decide
        ("BETTER IMAGE: tie", 0, None, None),
    ],
)
def test_pair_shapes(text, better, r1, r2):
    parsed = parse_answer(text, PAIR)
    assert parsed.status == OK, parsed
    assert parsed.value == {"better": better, "rating_1": r1, "rating_2": r2}


def test_extract_json_merges_objects_in_prose_first_value_wins():
    assert extract_json('noise {"a": 1} more {"b": 2} {"a": 3}') == {"a": 1, "b": 2}
    assert extract_json("no json here") is None


def _answer(better):
    if better is None:
        return Answer(None, parse_answer("", PAIR))
    return Answer("raw", parse_answer(f'{{"better_image": {better}}}', PAIR))


@pytest.mark.parametrize(
    "ab, ba, policy, prob_a, tie, abstained, consistent",
    [
        (1, 2, "tie", 1.0, False, False, True),  # A first, then A second: A wins
        (2, 1, "tie", 0.0, False, False, True),
        (0, 0, "tie", 0.5, True, False, True),
        (1, 1, "tie", 0.5, True, False, False),  # position bias: always the first image
        (1, 1, "average", 0.5, True, False, False),
        (1, 0, "average", 0.75, False, False, False),
        (0, 1, "average", 0.25, False, False, False),
        (1, 0, "tie", 0.5, True, False, False),
        (1, None, "tie", 0.5, False, True, None),  # one order missing: abstain by default
        (None, None, "tie", 0.5, False, True, None),
    ],
)
def test_reconcile_both_orders(ab, ba, policy, prob_a, tie, abstained, consistent):
    pref = reconcile(_answer(ab), _answer(ba), inconsistent=policy)
    assert isinstance(pref, Preference)
    assert (pref.prob_a, pref.tie, pref.abstained) == (prob_a, tie, abstained)
    assert pref.raw["consistent"] is consistent
    assert len(pref.raw["orders"]) == 2


def test_reconcile_one_order_use():
    pref = reconcile(_answer(2), _answer(None), one_order="use")
    assert pref.prob_a == 0.0 and not pref.abstained and pref.winner == 1


def test_reparse_uses_stored_raw_text():
    stale = [Answer("Rating: 7", parse_answer("", SINGLE)), Answer(None, parse_answer(None, SINGLE))]
    fresh = reparse(stale, SINGLE)
    assert fresh[0].parsed.value == 7.0 and fresh[1].parsed.status == UNPARSEABLE


def test_prompts_and_schemas():
    for mode in ("single", "likert", "pair"):
        for perspective in ("alignment", "safety", "artifacts", "bias", "overall"):
            q = JudgeQuestion(mode, perspective)
            text = render(q, "two red circles")
            assert '"two red circles"' in text and "JSON" in text
            schema = json_schema(q)
            assert set(schema["required"]) == set(schema["properties"])
    assert "0 (worst) to 100 (best)" in render(JudgeQuestion("single", scale="0-100"), "x")
    assert "Below Average" in render(JudgeQuestion("likert", likert_levels=10), "x")
    assert TEMPLATE_VERSION in JudgeQuestion().key()


@pytest.mark.parametrize(
    "kwargs, needle",
    [({"mode": "triple"}, "mode"), ({"perspective": "beauty"}, "perspective"), ({"scale": "1-7"}, "scale"),
     ({"likert_levels": 7}, "likert_levels")],
)
def test_bad_question_options_name_the_option(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        JudgeQuestion(**kwargs)


def test_nan_is_not_a_rating():
    assert parse_answer('{"rating": NaN}', SINGLE).status == UNPARSEABLE
