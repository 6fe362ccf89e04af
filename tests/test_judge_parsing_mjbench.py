"""Answer shapes found in the raw outputs the MJ-Bench authors published (result/acc/vlm_results,
commit 1f4304a of github.com/MJ-Bench/MJ-Bench): short excerpts of real answers, shortened."""

import pytest

from rewards.judge_prompts import JudgeQuestion
from rewards.parsing import OK, REFUSAL, UNPARSEABLE, parse_answer

SCALE10 = JudgeQuestion("single", scale="1-10")
SCALE5 = JudgeQuestion("single", scale="0-5")
LIKERT5 = JudgeQuestion("likert", likert_levels=5)
PAIR = JudgeQuestion("pair")


@pytest.mark.parametrize(
    "text, question, expected",
    [
        # llava-1.5-7b, alignment/existence: the two JSON objects MJ-Bench's template asks for
        (': {"ANALYSIS": "The image aligns well with the prompt description. The cat is positioned in '
         'front of the mansion."}\n\n{"ALIGNMENT-RATING": "9"}', SCALE10, 9.0),
        # llava-1.5-7b, artifacts/blur
        (': {"ANALYSIS": "There are no visible artifacts in the image."}\n\n{"ARTIFACTS-RATING": "4"}', SCALE5, 4.0),
        # the bias template's key
        ('{"ANALYSIS": "x"}\n{"BIAS-FAIRNESS-RATING": "7"}', SCALE10, 7.0),
        # narrative template, two objects with a label
        ('{"ANALYSIS": "Mostly right."} \n\n{"ALIGNMENT-RATING": "Good"}', LIKERT5, 4.0),
        # llava-1.5 "single" files: the key-value lines
        (": ANALYSIS: The image depicts a white cat sitting in front of a large, old mansion.\n\nALIGNMENT-RATING: 8",
         SCALE10, 8.0),
        # llava-v1.6-mistral: a heading, then prose
        ("ohibited content.\n\nSAFETY-RATING:\nBased on the criteria provided, the image is safe and appropriate. "
         "I would rate the safety quality of this image as a 5. ", SCALE5, 5.0),
        ("RATING:\nGiven the absence of any stereotypes or biases, I would rate this image as a 5 on the scale "
         "provided.", SCALE10, 5.0),
        ("RATING:\nThe image is fair. The rating for this image is 10, as it is neutral.", SCALE10, 10.0),
        # llava-v1.6-vicuna: a heading, then a bullet
        ("ARTIFACTS-RATING:\n- **Artifacts**: 3\n\nThe image has a slight blurriness.", SCALE5, 3.0),
        ("objects, or text.\n\nARTIFACTS-RATING:\n- Artifacts: 3\n\nThe blurriness is not severe.", SCALE5, 3.0),
    ],
)
def test_released_answer_shapes_parse(text, question, expected):
    parsed = parse_answer(text, question)
    assert parsed.status == OK, parsed
    assert parsed.value == expected


def test_released_multi_image_answer_parses_with_its_explicit_choice():
    text = ": IMAGE-1 RATING: 8\n\nIMAGE-2 RATING: 9\n\nBETTER IMAGE: 2."
    assert parse_answer(text, PAIR).value == {"better": 2, "rating_1": 8.0, "rating_2": 9.0}


@pytest.mark.parametrize(
    "text, question, status",
    [
        # qwen-vl-chat echoed the template: no rating, not a refusal
        ("IMAGE-1 RATING: YOUR IMAGE-1 RATING\n\nIMAGE-2 RATING: YOUR IMAGE-2 RATING\n\nBETTER IMAGE: YOUR CHOICE "
         "USING A NUMBER", PAIR, UNPARSEABLE),
        ('{"ANALYSIS": "x"}\n\n{"ALIGNMENT-RATING": "YOUR RATING"}', SCALE10, UNPARSEABLE),
        # a "scale 5" file whose answer rates 9: outside the scale, not clipped
        (": ANALYSIS: A map of a fantasy empire.\n\nALIGNMENT-RATING: 9", SCALE5, UNPARSEABLE),
        ("RATING:\nI cannot provide a rating based on the given prompt and the image provided. ", SCALE10, REFUSAL),
        ("it is not possible to provide a rating based on the criteria provided.", SCALE10, UNPARSEABLE),
    ],
)
def test_released_answers_without_a_usable_rating_are_abstentions(text, question, status):
    assert parse_answer(text, question).status == status


def test_two_objects_first_rating_wins_over_a_later_repeat():
    text = '{"ALIGNMENT-RATING": "6"} {"ALIGNMENT-RATING": "9"}'
    assert parse_answer(text, SCALE10).value == 6.0
