"""`judgebench --answers`: every metric from recorded answers, no model called; and `--protocol` /
`--prompt_template`: the question a judge is asked (checked on a fake OpenAI-compatible server)."""

import json

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
