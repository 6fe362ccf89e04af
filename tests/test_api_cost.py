"""The cost guard: a run that would ask a paid judge more than --max_api_cost is refused before any call."""

from __future__ import annotations

import json

import pytest
import test_api_trainers
import torch
from test_api_trainers import ddpo_command, gpt4o

import rewards
from align.api_cost import JudgeCalls, guard_api_cost
from align.cli import ConfigError
from align.eval import best_of_n, evaluate
from align.judgebench import benchmark as judgebench
from align.testing.two_processes import launch_two_cpu_processes
from align.train import ddpo, dpo

# the fake OpenAI server and the prompt file of the API-trainer tests, shared
prompt_file, server = test_api_trainers.prompt_file, test_api_trainers.server


def test_the_estimate_is_calls_times_tokens_times_the_price(server):
    judge = rewards.load("gpt4o", model="fake-model", base_url=server.base_url)
    # the gpt4o preset's price ($2.50 / $10.00 per million tokens) for a preset pointed elsewhere; pair mode asks
    # both orders: 10 comparisons are 20 calls of 600 text + 2 x 800 image tokens in, 400 out
    assert judge.calls_for(comparisons=10) == (20, 2)
    per_call = (2200 * 2.50 + 400 * 10.00) / 1e6
    assert judge.estimated_call_usd(2) == pytest.approx(per_call)
    assert guard_api_cost([JudgeCalls(judge, "x", comparisons=10)], max_usd=1.0) == pytest.approx(20 * per_call)
    with pytest.raises(ConfigError, match=r"20\) are estimated at \$0\.19, above --max_api_cost 0\.1 USD"):
        guard_api_cost([JudgeCalls(judge, "x", comparisons=10)], max_usd=0.1)
    # a server of one's own with no known price is free; a local judge is not counted at all
    local = rewards.load(f"openai:my-vlm[base_url={server.base_url}]")
    assert guard_api_cost([JudgeCalls(local, "x", comparisons=10**6), JudgeCalls(rewards.load("random"), "x", scores=10**6)],
                          max_usd=0.0) == 0.0
    judge.close()
    local.close()


def test_answers_in_the_cache_are_free(server, tmp_path):
    judge = rewards.load("gpt4o", model="fake-model", base_url=server.base_url, cache_path=str(tmp_path / "cache.sqlite"))
    gen = torch.Generator().manual_seed(0)
    first, second = torch.rand(3, 3, 8, 8, generator=gen), torch.rand(3, 3, 8, 8, generator=gen)
    prompts = ["a", "b", "c"]
    assert judge.cached_requests(prompts, first, second) == 0
    judge.compare(prompts[:2], first[:2], second[:2])  # 2 pairs x 2 orders answered and cached
    assert len(server.calls) == 4
    cached = judge.cached_requests(prompts, first, second)
    assert cached == 4
    plan = JudgeCalls(judge, "x", comparisons=3, cached=cached)
    assert guard_api_cost([plan], max_usd=1.0) == pytest.approx(2 * judge.estimated_call_usd(2))  # only the 3rd pair
    judge.close()


def test_an_expensive_ddpo_run_stops_before_any_call_and_a_raised_cap_runs(tiny_model, prompt_file, server, tmp_path, capsys):
    # 1,000 epochs of 4 images in groups of 2, both orders: 4,000 calls, about $38: above the default $5
    out = tmp_path / "costly"
    with pytest.raises(SystemExit) as exit_:
        ddpo.main(ddpo_command(tiny_model, prompt_file, server, out, num_epochs=1000))
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and captured.err.count("\n") == 1
    assert "above --max_api_cost 5 USD; raise --max_api_cost" in captured.err
    assert "[api cost] gpt4o: 4,000 calls for the rewards of 1000 epochs" in captured.out
    assert server.calls == [] and not out.exists()

    # one epoch under a cap below its cost: refused; under a raised cap: runs and asks the server
    small = tmp_path / "small"
    with pytest.raises(SystemExit):
        ddpo.main(ddpo_command(tiny_model, prompt_file, server, small, num_epochs=1, max_api_cost=0.001))
    assert server.calls == [] and not small.exists()
    ddpo.main(ddpo_command(tiny_model, prompt_file, server, small, num_epochs=1, max_api_cost=0.5))
    assert len(server.calls) >= 4 and (small / "final").is_dir()
    assert "[api cost] gpt4o: 4 calls for the rewards of 1 epochs" in capsys.readouterr().out


def test_dpo_feedback_over_the_cap_is_refused_before_any_call(tiny_model, prompt_file, server, tmp_path, capsys):
    out = tmp_path / "dpo"
    with pytest.raises(SystemExit) as exit_:
        dpo.main(["--model", tiny_model, "--output-dir", str(out), "--reward", gpt4o(server), "--prompts", prompt_file,
                  "--images_per_prompt", "2", "--max_steps", "2", "--finetune", "lora", "--report_to", "none",
                  "--max_api_cost", "0.01"])
    captured = capsys.readouterr()
    # 2 prompts x 1 adjacent pair x 2 orders = 4 calls, about $0.04
    assert exit_.value.code == 2 and "[api cost] gpt4o: 4 calls for the feedback" in captured.out
    assert "above --max_api_cost 0.01 USD" in captured.err and server.calls == [] and not out.exists()
    assert json.dumps(captured.err).count("\\n") == 1


def test_judgebench_counts_cached_answers_as_free(server, tmp_path, capsys):
    cache = tmp_path / "answers.sqlite"
    spec = f"gpt4o[model=fake-model,base_url={server.base_url},cache_path={cache}]"

    def bench(out, cap, *extra):
        judgebench.main(["--judges", spec, "--data", "testbed", "--subsets", "alignment", "--output_dir", str(tmp_path / out),
                         "--testbed_pairs", "1", "--testbed_bias_groups", "1", "--max_api_cost", str(cap), *extra])

    with pytest.raises(SystemExit) as exit_:
        bench("refused", 0.001)
    assert exit_.value.code == 2 and server.calls == []
    assert "above --max_api_cost 0.001 USD" in capsys.readouterr().err

    bench("paid", 5)
    asked = len(server.calls)
    assert asked > 0 and f"[api cost] gpt4o: {asked} calls" in capsys.readouterr().out

    bench("again", 0)  # every question answered in the cache: free, so even a zero cap runs, and nothing is asked
    out = capsys.readouterr().out
    assert len(server.calls) == asked and f"[api cost] gpt4o: 0 calls for {asked // 2} pairs in both orders ({asked} more answered by the cache, free)" in out


def test_evaluation_and_best_of_n_over_the_cap_stop_before_generating_or_asking(tiny_model, server, tmp_path, capsys):
    judge = gpt4o(server)
    with pytest.raises(SystemExit) as exit_:
        evaluate.main(["--models", f"a={tiny_model},b={tiny_model}", "--judges", judge, "--prompts", "testbed",
                       "--num_prompts", "3", "--output_dir", str(tmp_path / "eval"), "--max_api_cost", "0.01"])
    captured = capsys.readouterr()
    # a pairwise judge compares the 2 models on each of the 3 samples, both orders: 6 calls
    assert exit_.value.code == 2 and "[api cost] gpt4o: 6 calls for 1 model pairs x 3 images" in captured.out
    assert not (tmp_path / "eval").exists()

    with pytest.raises(SystemExit) as exit_:
        best_of_n.main(["--model", tiny_model, "--reward", judge, "--prompts", "testbed", "--num_prompts", "2", "--n", "16",
                        "--output_dir", str(tmp_path / "bon"), "--max_api_cost", "0.1"])
    captured = capsys.readouterr()
    # a pairwise selector's knockout: 15 comparisons per prompt, both orders: 60 calls
    assert exit_.value.code == 2 and "[api cost] gpt4o: 60 calls for the knockout" in captured.out
    assert "above --max_api_cost 0.1 USD" in captured.err
    assert server.calls == [] and not (tmp_path / "bon").exists()


@pytest.mark.slow  # the suite's time budget on the 2-core CI machine
def test_two_ddpo_processes_both_stop_when_the_main_ones_evaluation_judge_is_over_the_cap(tiny_model, prompt_file, server, tmp_path):
    # only the main process loads the evaluation judge: the other must learn the verdict, not wait for ever

    out = tmp_path / "ddp"
    argv = ["--model", tiny_model, "--reward", "jpeg-compressibility", "--prompts", prompt_file, "--output-dir", str(out),
            "--eval_prompts", prompt_file, "--eval_judge", gpt4o(server).replace("[", "[mode=single,"),
            "--samples_per_epoch", "4", "--sample_batch_size", "2", "--train_batch_size", "2", "--gradient_accumulation_steps", "1",
            "--report_to", "none",
            "--max_api_cost", "0.0001"]
    result = launch_two_cpu_processes("align/ddpo.py", argv, timeout=240)
    assert result.returncode != 0
    assert "above --max_api_cost 0.0001 USD" in result.stderr
    assert "refused this run on another process" in result.stderr  # the second process stopped too
    assert server.calls == [] and not out.exists()
