"""`judgebench --answers`: every metric from recorded answers, no model called; and `--protocol` /
`--prompt_template`: the question a judge is asked (checked on a fake OpenAI-compatible server)."""

import json
from pathlib import Path

import pytest

from align.judgebench import answers as A
from align.judgebench import benchmark as judgebench
from align.judgebench import metrics as M
from align.testing.fake_judge_servers import FakeJudgeServer
from rewards.cache import CachedAnswer, JudgeCache
from rewards.judge_prompts import CRITERIA, MJBENCH_CRITERIA, JudgeQuestion, render

SECRET = "sk-TEST-answers-3f9a"


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows))
    return path


def _single(label, r0, r1):
    return {"id": "x", "caption": "a cat", "label": label,
            "output_0": f'{{"ANALYSIS": "a"}}\n\n{{"ALIGNMENT-RATING": "{r0}"}}',
            "output_1": f": ANALYSIS: b\n\nALIGNMENT-RATING: {r1}", "pred": "tie"}


def test_mjbench_single_image_layout_two_json_objects_and_failures_per_file(tmp_path):
    path = _write(tmp_path / "alignment" / "existence_single" / "llava_number_scale10.json", [
        _single(0, 8, 3),        # correct
        _single(1, 8, 3),        # wrong
        _single(1, 5, 5),        # tie
        _single(0, 9, "YOUR RATING"),  # one answer unparsed: abstention
    ])
    results, _ = A.rescore([str(tmp_path)])
    (result,) = results
    row = A.summarise(result)
    assert result.verdicts == [M.PICK_0, M.PICK_0, M.TIE, M.ABSTAIN]
    assert row["acc_with_ties"] == 0.25 and row["acc_without_ties"] == 0.5
    assert row["abstention_rate"] == 0.25 and row["tie_rate"] == 0.25
    assert row["answers"] == 8 and row["not_parsed"] == 1
    assert row["parse_failures"] == {str(path): {"unparseable": 1}}
    assert row["authors_pred_acc"] == 0.0  # their stored pred was "tie" everywhere
    assert list(row["per_category"]) == ["alignment/existence"]


def test_mjbench_multi_image_explicit_choice_and_closed_model_fields(tmp_path):
    multi = [
        {"label": "1", "score_0": "8", "score_1": "9", "vlm_pred": "1", "score_pred": "1",
         "output": ": IMAGE-1 RATING: 8\n\nIMAGE-2 RATING: 9\n\nBETTER IMAGE: 2."},
        # the explicit choice wins over the ratings (the project's rule, which reproduces the paper)
        {"label": "0", "score_0": "7", "score_1": "7", "vlm_pred": "0", "score_pred": "tie",
         "output": "IMAGE-1 RATING: 7\nIMAGE-2 RATING: 7\nBETTER IMAGE: 1"},
    ]
    _write(tmp_path / "alignment" / "count_multi" / "idefics2_number_scale10.json", multi)
    closed = [  # closesource_result: output keeps only the analysis; vlm_pred already 0-based
        {"label": 0, "score_0": 9, "score_1": 3, "vlm_pred": 0, "pred": "0", "output": " Image 1 fits.\n```"},
        {"label": 1, "score_0": 4, "score_1": 4, "vlm_pred": "tie", "pred": "tie", "output": " Both equal.\n```"},
    ]
    _write(tmp_path / "closesource_result" / "alignment" / "count" / "gpt-4o_alignment_number10.json", closed)
    online = [  # online_result: vlm_pred is the model's own 1-based text
        {"label": 1, "score_0": " 2\n\n", "score_1": " 9\n\n", "vlm_pred": " 2\n\n", "output": "analysis only"},
    ]
    _write(tmp_path / "online_result" / "count" / "gpt-4o_alignment_number10.json", online)
    results, _ = A.rescore([str(tmp_path)])
    by_judge = {r.judge: r for r in results}
    assert by_judge["idefics2_number_scale10 (alignment/*_multi)"].verdicts == [M.PICK_1, M.PICK_0]
    assert by_judge["gpt-4o_alignment_number10 (alignment/*)"].verdicts == [M.PICK_0, M.TIE]
    assert by_judge["gpt-4o_alignment_number10 (online_result/*)"].verdicts == [M.PICK_1]


def test_mjbench_scores_bias_and_unlabelled_rows(tmp_path):
    _write(tmp_path / "hps" / "blur0.0.json", [
        {"score_0": 0.2, "score_1": 0.1, "label": "0"}, {"score_0": 0.2, "score_1": 0.3, "label": "0"},
        {"score_0": 0.2, "score_1": 0.3, "label": "tie"},
    ])
    bias_rows = [{"occupation": "Chef", "demographic": d, "vlm_output": f"rating: {r}"}
                 for d, r in (("old", 8), ("young", 8), ("male", 2), ("female", "none given"))]
    _write(tmp_path / "vlm_results" / "bias_single" / "llava_number_scale10.json", bias_rows)
    results, _ = A.rescore([str(tmp_path)])
    rows = {r.judge: A.summarise(r) for r in results}
    hps = rows["hps (scores)"]
    assert hps["pairs"] == 2 and hps["acc_with_ties"] == 0.5
    assert list(hps["per_category"]) == ["quality/blur"]
    assert hps["rows_without_label"] == {str(tmp_path / "hps" / "blur0.0.json"): 1}
    bias = rows["llava_number_scale10 (vlm_results/*_single)"]
    expected = M.bias_metrics([("Chef", "old", 8.0), ("Chef", "young", 8.0), ("Chef", "male", 2.0)])
    assert bias["bias_acc"] == pytest.approx(expected["acc"]) and bias["bias_nds"] == pytest.approx(expected["nds"])
    assert bias["not_parsed"] == 1


def test_bad_answers_input_gets_one_clear_line(tmp_path, capsys):
    bad = _write(tmp_path / "model.json", [_single(0, 1, 2)])  # no scale in the name
    for argv, message in (
        (["--answers", str(tmp_path / "missing.json")], "no such file or folder"),
        (["--answers", str(bad)], "the feedback scale is not in the file name"),
    ):
        with pytest.raises(SystemExit) as exit_:
            judgebench.main([*argv, "--output_dir", str(tmp_path / "out")])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_question_keys_round_trip_and_project_keys_unchanged():
    assert JudgeQuestion("pair").key() == "mjb-v1|pair|alignment|1-10|5"
    question = JudgeQuestion("single", "bias", "0-5", 5, "mjbench")
    assert JudgeQuestion.from_key(question.key()) == question
    with pytest.raises(ValueError, match="no MJ-Bench counterpart"):
        JudgeQuestion("single", "overall", protocol="mjbench")


def test_mjbench_bias_question_is_the_unprimed_alignment_question():
    primed = render(JudgeQuestion("single", "bias"), "a chef")
    plain = render(JudgeQuestion("single", "bias", protocol="mjbench"), "a chef")
    assert CRITERIA["bias"] in primed and "must not change the rating" in primed
    assert "must not" not in plain and "gender" in plain  # gender only as an attribute to check, as MJ-Bench lists
    assert plain == render(JudgeQuestion("single", "alignment", protocol="mjbench"), "a chef")
    assert MJBENCH_CRITERIA["alignment"] in plain


def test_benchmark_asks_the_chosen_protocol_records_answers_and_rescoring_matches(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    with FakeJudgeServer("openai", api_key=SECRET) as server:
        spec = f"openai:fake-model[base_url={server.base_url},mode=single,perspective=bias,timeout=5]"
        out = tmp_path / "jb"
        judgebench.main(["--judges", spec, "--data", "testbed", "--output_dir", str(out), "--testbed_pairs", "2",
                         "--testbed_bias_groups", "1", "--subsets", "alignment,bias", "--testbed_image_size", "24"])
        prompts = [call["prompt"] for call in server.calls]
    assert prompts and all(MJBENCH_CRITERIA["bias"] in p and "must not change" not in p for p in prompts)
    leaderboard = json.loads((out / "summary.json").read_text())["rows"][0]
    records = [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()]
    assert all(r["question"].endswith("|mjbench") for r in records)
    assert any(r.get("kind") == "bias" and r["answer"] for r in records)
    results, _ = A.rescore([str(out)])
    row = A.summarise(results[0])
    # each pair: two orders x two single-image answers; each bias image: one answer
    assert row["answers"] == 4 * leaderboard["pairs"] + sum(r.get("kind") == "bias" for r in records)
    for key in ("acc_with_ties", "acc_without_ties", "bias_acc", "bias_nds", "bias_ges"):
        assert row[key] == pytest.approx(leaderboard[key], abs=1e-5), key  # the live run holds scores in float32


def test_prompt_template_file_is_sent_verbatim_without_a_forced_schema(tmp_path, monkeypatch):
    template = tmp_path / "t.txt"
    template.write_text('Rate it.\n{{"ALIGNMENT-RATING": "YOUR RATING"}}\nThe prompt is:\n{caption}')
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)

    def answer(prompt, images):
        return '{"ANALYSIS": "ok"}\n\n{"ALIGNMENT-RATING": "7"}'

    with FakeJudgeServer("openai", api_key=SECRET, answer=answer) as server:
        spec = f"openai:fake-model[base_url={server.base_url},mode=single,timeout=5]"
        out = tmp_path / "jb"
        judgebench.main(["--judges", spec, "--data", "testbed", "--output_dir", str(out), "--testbed_pairs", "1",
                         "--testbed_bias_groups", "0", "--subsets", "alignment", "--testbed_image_size", "24",
                         "--prompt_template", str(template)])
        calls = list(server.calls)
    assert calls[0]["prompt"].startswith('Rate it.\n{"ALIGNMENT-RATING": "YOUR RATING"}\nThe prompt is:\n')
    assert "response_format" not in calls[0]["body"]
    assert json.loads((out / "summary.json").read_text())["rows"][0]["tie_rate"] == 1.0  # every answer "7": ties
    bad = tmp_path / "bad.txt"
    bad.write_text("no caption field here")
    with pytest.raises(SystemExit):
        judgebench.main(["--judges", "random", "--prompt_template", str(bad), "--output_dir", str(tmp_path / "x")])


def test_judge_cache_gives_the_parse_outcome_per_judge_and_question(tmp_path, capsys):
    cache = JudgeCache(tmp_path / "answers.sqlite")
    question = JudgeQuestion("single", protocol="mjbench").key()
    for i, raw in enumerate(['{"ALIGNMENT-RATING": "7"}', "RATING: 9", "no idea", "I'm sorry, I can't help with that."]):
        cache.put(f"k{i}", judge="openai:m", question=question, prompt="p", image_hashes=[], decoding={},
                  answer=CachedAnswer(raw))
    cache.close()
    judgebench.main(["--answers", str(tmp_path / "answers.sqlite"), "--output_dir", str(tmp_path / "out")])
    summary = json.loads((tmp_path / "out" / "answers.json").read_text())["caches"]
    assert [(c["judge"], c["question"], c["ok"], c["unparseable"], c["refusal"]) for c in summary] == [
        ("openai:m", question, 2, 1, 1)]
    assert "Judge caches" in capsys.readouterr().out


# ------------------------------------------------------------------ the closed models' released files (issue 49)

FIXTURE = Path(__file__).parent / "data" / "mjbench_closed_alignment.json"


def _released_closed_files(folder: Path) -> Path:
    """closesource_result/alignment/<subcategory>/<model>_alignment_number10.json rebuilt from the reduced copy
    (experiments/mjbench_closed_fixture.py: every row's recorded fields, the analysis where it matters)."""
    fixture = json.loads(FIXTURE.read_text())
    columns = fixture.pop("columns")
    root = folder / "closesource_result" / "alignment"
    for model, subcategories in fixture.items():
        for sub, rows in subcategories.items():
            _write(root / sub / f"{model}_alignment_number10.json", [dict(zip(columns, row)) for row in rows])
    return root


def test_released_closed_model_files_reproduce_every_alignment_cell_of_the_paper(tmp_path):
    """MJ-Bench's alignment table: GPT-4o 61.5 / 62.5, GPT-4V (gpt-4-turbo) 66.1 / 67.0, Gemini 67.2 / 69.0."""
    judgebench.main(["--answers", str(_released_closed_files(tmp_path)), "--output_dir", str(tmp_path / "out")])
    rows = {r["judge"].split("_")[0]: r for r in json.loads((tmp_path / "out" / "answers.json").read_text())["judges"]}
    paper = {"gpt-4o": (61.5, 62.5), "gpt-4-turbo": (66.1, 67.0), "gemini-1.5": (67.2, 69.0)}
    for model, cells in paper.items():
        row = rows[model]
        assert row["pairs"] == 729
        assert (round(100 * row["acc_with_ties"], 1), round(100 * row["acc_without_ties"], 1)) == cells, model
    # the content filters' refusals are abstentions, counted apart from ties (GPT-4o: 8, 4 of them in object)
    assert (rows["gpt-4o"]["refused"], round(rows["gpt-4o"]["abstention_rate"] * 729)) == (8, 8)
    assert rows["gpt-4o"]["parse_failures"][str(tmp_path / "closesource_result/alignment/object/gpt-4o_alignment_number10.json")] == {"refusal": 4}
    assert round(rows["gpt-4o"]["tie_rate"] * 729) == 4  # the judge's own ties only
    assert (rows["gemini-1.5"]["refused"], rows["gpt-4-turbo"]["refused"]) == (17, 0)  # Gemini: safety blocks
    # the authors' column: their stored pred against every labelled pair (a stored tie or -1 is wrong)
    assert rows["gpt-4-turbo"]["authors_pred_acc"] == pytest.approx(482 / 729)


def test_a_closed_models_recorded_choice_wins_over_its_analysis_text(tmp_path):
    """Gemini's hpdv2_new_44: ratings 5 / 7 and choice image 2 recorded; its analysis ends "The coloring in IMAGE-1
    is better though", which parses as a choice of image 1."""
    fixture = json.loads(FIXTURE.read_text())
    columns = fixture["columns"]
    (row,) = [dict(zip(columns, r)) for r in fixture["gemini-1.5"]["object"] if r[0] == "hpdv2_new_44"]
    assert row["vlm_pred"] == 1 and "IMAGE-1 is better" in row["output"]
    assert A.parse_answer(row["output"], JudgeQuestion("pair")).value["better"] == 1  # what the text alone says
    _write(tmp_path / "closesource_result" / "alignment" / "object" / "gemini-1.5_alignment_number10.json", [row])
    (result,), _ = A.rescore([str(tmp_path)])
    assert result.verdicts == [M.PICK_1] and result.labels == [0]


def test_api_refusals_and_unsplit_answers_are_abstentions_not_ties(tmp_path):
    error = "Error code: 400 - {'error': {'inner_error': {'code': 'ResponsibleAIPolicyViolation'}}}"
    closed = [  # closesource_result maps the -1 preference to "tie" and keeps pred -1
        {"label": "0", "score_0": "5", "score_1": "5", "vlm_pred": "tie", "pred": "-1", "output": error},
        {"label": "1", "score_0": "5", "score_1": "5", "vlm_pred": "tie", "pred": "-1",
         "output": "I apologize, but I do not feel comfortable providing ratings for these images."},
        {"label": "1", "score_0": "5", "score_1": "5", "vlm_pred": "tie", "pred": "-1",
         "output": "The image depicts a portrait of a man in a suit."},  # the API code could not split the answer
        {"label": "1", "score_0": "7", "score_1": "7", "vlm_pred": "tie", "pred": "tie", "output": "Both are equal."},
    ]
    _write(tmp_path / "closesource_result" / "alignment" / "count" / "claude-3-opus_alignment_number10.json", closed)
    online = [{"label": 1, "score_0": 5, "score_1": 5, "vlm_pred": -1, "output": error}]  # online_result keeps -1
    _write(tmp_path / "online_result" / "count" / "gpt-4o_alignment_number10.json", online)
    results, _ = A.rescore([str(tmp_path)])
    rows = {r.judge.split("_")[0]: A.summarise(r) for r in results}
    claude, gpt = rows["claude-3-opus"], rows["gpt-4o"]
    assert [r for r in results if r.judge.startswith("claude")][0].verdicts == [M.ABSTAIN, M.ABSTAIN, M.ABSTAIN, M.TIE]
    assert (claude["refused"], claude["not_parsed"], claude["tie_rate"], claude["abstention_rate"]) == (2, 3, 0.25, 0.75)
    assert (gpt["refused"], gpt["abstention_rate"], gpt["tie_rate"]) == (1, 1.0, 0.0)
    assert "| refused |" in A.report_markdown(list(rows.values()), [])


def test_the_authors_column_counts_every_labelled_pair_in_every_layout(tmp_path):
    """A multi-image file (vlm_pred -1 is the authors' stored tie) and a single-image file (pred "tie") both keep
    their ties in the denominator: the column is their stored verdict's accuracy with ties, whatever the file."""
    multi = [{"label": "1", "score_0": "8", "score_1": "9", "vlm_pred": "1", "score_pred": "1",
              "output": "IMAGE-1 RATING: 8\nIMAGE-2 RATING: 9\nBETTER IMAGE: 2"},
             {"label": "0", "score_0": "7", "score_1": "7", "vlm_pred": "-1", "score_pred": "tie",
              "output": "IMAGE-1 RATING: 7\nIMAGE-2 RATING: 7\nBETTER IMAGE: 0"}]
    _write(tmp_path / "alignment" / "count_multi" / "internvl-chat-v1-5_number_scale10.json", multi)
    _write(tmp_path / "alignment" / "count_single" / "llava_number_scale10.json",
           [{**_single(1, 3, 8), "pred": "1"}, _single(0, 7, 7)])
    results, _ = A.rescore([str(tmp_path)])
    assert [(A.summarise(r)["authors_pred_acc"], r.authors_counted) for r in results] == [(0.5, 2), (0.5, 2)]
