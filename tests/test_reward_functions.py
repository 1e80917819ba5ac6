"""Reward functions (reward_functions.py) and their scorer (rewards.RewardFunctionScorer), in
online DPO (online.scorer=reward_function) and evaluate.py (judge=reward_function).

VADER's expected scores are worked out by hand from its lexicon (vader_lexicon.txt in the
vaderSentiment package: good 1.9, bad -2.5, great 3.1, terrible -2.1) and its compound formula
s / sqrt(s^2 + 15), rounded to 4 places as VADER does; arithmetic's from the sums.
The tiny random model never writes a right sum, so the training tests make one sample of each
prompt the right answer (the other is the model's own); everything after sampling is real.
"""

from __future__ import annotations

import collections
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import TINY, compose_config, metric_records, run_train

import online
from data import arithmetic as arithmetic_data
from evaluation import evaluate, reward_functions, rewards
from evaluation.reward_functions import arithmetic, length, sentiment
from runs import checkpoints
from utils import ConfigError

ONLINE = ["online.enabled=true", "online.scorer=reward_function", "online.max_new_tokens=8", "loss.beta=0.1"]
ONLINE += ["sample_during_eval=false"]
ONLINE_RF = [*ONLINE, "reward_functions=[arithmetic]"]


def compound(s: float) -> float:
    """VADER's compound score of a summed valence ``s`` (its normalize, alpha 15), rounded as it rounds."""
    return round(s / math.sqrt(s * s + 15), 4)


def scorer(specs, weights=None) -> rewards.RewardFunctionScorer:
    return rewards.RewardFunctionScorer(*reward_functions.resolve_all(specs, weights))


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write ``code`` as an importable module ``name`` (a user's own reward functions)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, code: str) -> None:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(code))

    return write


# ----------------------------------------------------------------------------- the shipped functions by hand


def test_sentiment_is_vaders_compound_worked_out_from_its_lexicon():
    texts = ["good", "bad", "great", "", "The cat sat on the mat."]
    # One lexicon word: its valence alone; no lexicon word: 0.
    expected = [compound(1.9), compound(-2.5), compound(3.1), 0.0, 0.0]
    assert expected[:3] == [0.4404, -0.5423, 0.6249]
    assert sentiment(["p"] * 5, texts) == expected
    # "but": the words before it count half, those after 1.5 times: 0.5 * 3.1 + 1.5 * -2.1 = -1.6.
    assert sentiment([""], ["The movie was great, but the ending was terrible."]) == [compound(-1.6)] == [-0.3818]
    # Only the completion is scored: a sad prompt does not change it.
    assert sentiment(["a terrible, sad day"], ["good"]) == [0.4404]


def test_sentiment_orders_clear_cases_and_matches_vader_itself():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    texts = ["I love this wonderful film", "It was fine", "I hate this awful film"]
    scores = sentiment([""] * 3, texts)
    assert scores[0] > scores[1] > 0 > scores[2]
    assert scores == [SentimentIntensityAnalyzer().polarity_scores(t)["compound"] for t in texts]


def test_arithmetic_is_exact_on_the_embedded_datasets_questions():
    prompt = "Q: 17+25=\nA:"
    completions = [" 42", "42", " 42\n", " 43", " 42 and more", "", " 4 2"]
    assert arithmetic([prompt] * 7, completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # Not such a question: None (not scorable).
    assert arithmetic(["Q: 17-25=\nA:", "hello", "Q: 17+25=\nA: "], [" -8", " 42", " 42"]) == [None, None, None]
    # The loader's own pairs: every chosen is right, every rejected wrong.
    data = arithmetic_data.get_arithmetic("test", collections.Counter(), n_train=10, n_test=20)
    prompts = list(data)
    assert len(prompts) == 20
    assert arithmetic(prompts, [data[p]["sft_target"] for p in prompts]) == [1.0] * 20
    rejected = [data[p]["responses"][data[p]["pairs"][0][1]] for p in prompts]
    assert arithmetic(prompts, rejected) == [0.0] * 20


def test_length_counts_characters():
    assert length(["p", "q"], ["", "abc d"]) == [0.0, 5.0]


def test_weighted_sum_skips_none_and_a_completion_no_function_scores_fails():
    s = scorer(["arithmetic", "sentiment", "length"], [1.0, 2.0, 0.5])
    got = s.score(["Q: 17+25=\nA:", "hello", "Q: 1+1=\nA:"], [" 42", "good", " 3"])
    # Row 0: 1 * 1.0 + 2 * 0.0 + 0.5 * 3 = 2.5. Row 1 (arithmetic None, skipped): 2 * 0.4404 + 0.5 * 4 = 2.8808.
    # Row 2: 1 * 0.0 + 2 * 0.0 + 0.5 * 2 = 1.0.
    assert got.tolist() == pytest.approx([2.5, 2.8808, 1.0])
    assert s.last_errors == []
    alone = scorer(["arithmetic"])  # reward_weights=null: 1.0
    got = alone.score(["Q: 2+2=\nA:", "hello"], [" 4", " 4"])
    assert got[0] == 1.0 and math.isnan(got[1])
    assert alone.last_errors == ["every reward function (arithmetic) returned None for the completion of prompt 'hello'"]


def test_config_defaults_and_build_scorer():
    config = compose_config(["online.scorer=reward_function"])
    assert list(config.reward_functions) == ["sentiment"] and config.reward_weights is None
    built = rewards.build_scorer(config)
    assert isinstance(built, rewards.RewardFunctionScorer) and built.weights == [1.0]
    config = compose_config(["online.scorer=reward_function", "reward_functions=[length,arithmetic]", "reward_weights=[-1,3]"])
    built = rewards.build_scorer(config)
    assert built.names == ["length", "arithmetic"] and built.weights == [-1.0, 3.0]


# ----------------------------------------------------------------------------- a user's own functions


def test_module_function_from_a_users_module_gets_the_fields_it_names(user_module):
    user_module(
        "my_rewards",
        """
        def exact(prompts, completions, answer):
            return [float(c.strip() == a) for c, a in zip(completions, answer)]

        def everything(prompts, completions, **fields):
            return [float(len(fields))] * len(completions)
        """,
    )
    s = scorer(["my_rewards:exact", "my_rewards:everything"], [1.0, 10.0])
    got = s.score(["p", "q"], [" yes", "no"], answer=["yes", "yes"], source=["x", "y"])
    # exact takes answer only; everything gets both fields: 2 * 10.
    assert got.tolist() == [21.0, 20.0]


def test_a_module_in_the_current_directory_imports(tmp_path, monkeypatch):
    (tmp_path / "here_rewards.py").write_text("def two(prompts, completions, **fields):\n    return [2.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", ".", str(tmp_path))])
    assert scorer(["here_rewards:two"]).score(["p"], ["c"]).tolist() == [2.0]


@pytest.mark.parametrize(
    "specs, weights, message",
    [
        (
            ["sentimnt"],
            None,
            "reward_functions: 'sentimnt' is not a registered reward function; did you mean 'sentiment'? "
            "give a registered name (arithmetic, length, sentiment, shapes) or module:function.",
        ),
        (
            ["no_such_module_xyz:score"],
            None,
            "reward_functions: 'no_such_module_xyz:score' does not import (ModuleNotFoundError: No module named "
            "'no_such_module_xyz'); give a registered name (arithmetic, length, sentiment, shapes) or module:function, "
            "the module importable from the current directory or PYTHONPATH.",
        ),
        (
            ["sig_rewards:nope"],
            None,
            "reward_functions: module sig_rewards has no 'nope'; give a registered name (arithmetic, length, sentiment, shapes) "
            "or module:function.",
        ),
        (
            ["sig_rewards:one_arg"],
            None,
            "reward_functions: sig_rewards:one_arg cannot be called as fn(prompts, completions, **fields) "
            "(too many positional arguments); give it that signature.",
        ),
        (
            ["sentiment", "length"],
            [1.0],
            "reward_weights=[1.0] must be 2 numbers, one per reward function (sentiment, length), or null for 1.0 each.",
        ),
        (
            ["sentiment"],
            ["x"],
            "reward_weights=['x'] must be 1 number, one per reward function (sentiment), or null for 1.0 each.",
        ),
        ([], None, "reward_functions must be a non-empty list of names, e.g. reward_functions=[sentiment], got []."),
    ],
)
def test_bad_names_and_weights_are_one_sentence(user_module, specs, weights, message):
    user_module("sig_rewards", "def one_arg(prompts):\n    return []\n")
    with pytest.raises(ConfigError) as e:
        reward_functions.resolve_all(specs, weights)
    assert str(e.value) == message


def test_sentiment_without_vadersentiment_installed_is_one_sentence(monkeypatch):
    monkeypatch.setitem(reward_functions.REQUIRES, "sentiment", "vaderSentiment_not_installed")
    with pytest.raises(ConfigError) as e:
        reward_functions.resolve_all(["sentiment"], None)
    assert str(e.value) == (
        "reward_functions: sentiment needs the vaderSentiment_not_installed package, which is not installed; "
        "pip install -r requirements.txt."
    )


def test_a_function_that_returns_the_wrong_length_or_a_non_number_fails_those_completions(user_module):
    user_module(
        "bad_rewards",
        """
        def short(prompts, completions, **fields):
            return [1.0]

        def text(prompts, completions, **fields):
            return ["1.0" if c == "b" else 2 for c in completions]
        """,
    )
    s = scorer(["bad_rewards:short"])
    got = s.score(["p", "q"], ["a", "b"])
    assert torch.isnan(got).all()
    sentence = "reward function bad_rewards:short returned 1 scores for 2 completions; it must return a list of one number (or None) per completion"
    assert s.last_errors == [sentence, sentence] and s.failures == 2
    s = scorer(["bad_rewards:text", "length"])
    got = s.score(["p", "q"], ["a", "b"])
    # Row 0: 2 + 1 = 3; row 1 fails although length scored it: a non-number is an error, not a None.
    assert got[0] == 3.0 and math.isnan(got[1])
    assert s.last_errors == [
        "reward function bad_rewards:text returned '1.0' (a str) for the completion of prompt 'q'; it must return a number or None"
    ]


def test_a_function_raising_on_a_row_names_that_row_and_scores_the_others(user_module):
    user_module(
        "raising",
        """
        def picky(prompts, completions, **fields):
            return [1.0 / (len(c) - 3) for c in completions]
        """,
    )
    s = scorer(["raising:picky"])
    got = s.score(["Q: 1+1=\nA:", "Q: 2+2=\nA:", "Q: 3+3=\nA:"], ["abcde", "abc", "ab"])
    # 1 / (5 - 3) = 0.5; "abc" divides by zero; 1 / (2 - 3) = -1.
    assert got[0] == 0.5 and math.isnan(got[1]) and got[2] == -1.0
    assert s.last_errors == [
        "reward function raising:picky raised ZeroDivisionError: float division by zero on the completion of prompt 'Q: 2+2=\\nA:'"
    ]


def test_a_reward_function_that_does_not_import_stops_train_py_before_any_model_loads(tmp_path):
    from test_checkpoint_faults import CLI_TINY, cli, one_error_line

    result = cli([*CLI_TINY, *ONLINE, "reward_functions=[arithmetc]"], tmp_path)
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    assert one_error_line(result) == (
        "Error: reward_functions: 'arithmetc' is not a registered reward function; did you mean 'arithmetic'? "
        "give a registered name (arithmetic, length, sentiment, shapes) or module:function."
    )
    assert "Policy:" not in result.stdout  # printed once the models are loaded
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ----------------------------------------------------------------------------- online DPO

RIGHT_ANSWER_SAMPLE = """
import torch
from online import trainer as online
from evaluation import reward_functions

_sample = online.OnlineSampling.sample_completions


def _with_right_answers(self, batch, n_per_prompt):
    # Row 2i + (i % 2) of prompt i becomes its right answer and EOS (the first or the second sample).
    ids, mask, out = _sample(self, batch, n_per_prompt)
    if n_per_prompt != 2:
        return ids, mask, out
    rows = out.tolist()
    pad = self.tokenizer.pad_token_id
    for i, prompt in enumerate(batch["prompt"]):
        a, b = reward_functions.ARITHMETIC_PROMPT.fullmatch(prompt).groups()
        right = self.tokenizer(f" {int(a) + int(b)}", add_special_tokens=False)["input_ids"] + [self.stop_ids[0]]
        rows[2 * i + i % 2] = right
    width = max(len(r) for r in rows)
    return ids, mask, torch.tensor([r + [pad] * (width - len(r)) for r in rows])


online.OnlineSampling.sample_completions = _with_right_answers
"""


def test_online_dpo_with_arithmetic_under_basic_trainer_labels_the_right_answer_chosen(tmp_path, monkeypatch):
    namespace: dict = {}
    exec(RIGHT_ANSWER_SAMPLE.replace("online.OnlineSampling.sample_completions = _with_right_answers", ""), namespace)
    monkeypatch.setattr(online.OnlineSampling, "sample_completions", namespace["_with_right_answers"])
    seen = []
    real_pairs = online.OnlineSampling.online_pairs

    def recorded(self, batch):
        pairs, metrics = real_pairs(self, batch)
        seen.append((self.tokenizer, batch["prompt"], pairs, metrics))
        return pairs, metrics

    monkeypatch.setattr(online.OnlineSampling, "online_pairs", recorded)
    run_dir = run_train([*ONLINE_RF, "n_examples=16", "eval_every=8"], tmp_path)
    assert len(seen) == 2  # 16 examples, 8 a step
    for tokenizer, prompts, pairs, metrics in seen:
        assert sum(metrics["online/labelled_pairs"]) == 8 and sum(metrics["online/failed_judgements"]) == 0
        for i, prompt in enumerate(prompts):
            a, b = reward_functions.ARITHMETIC_PROMPT.fullmatch(prompt).groups()
            n_prompt = int(pairs["prompt_attention_mask"][i].sum())
            chosen = pairs["chosen_input_ids"][i][pairs["chosen_attention_mask"][i].bool()][n_prompt:]
            assert tokenizer.decode(chosen, skip_special_tokens=True) == f" {int(a) + int(b)}"
            assert (float(pairs["chosen_scores"][i]), float(pairs["rejected_scores"][i])) == (1.0, 0.0)
    train_rows = [r for r in metric_records(run_dir) if "online/labelled_pairs" in r]
    assert train_rows and all(r["online/labelled_pairs"] == 1.0 and r["objective/scores_margin"] == 1.0 for r in train_rows)
    assert all(r["objective/scores"] == 0.5 for r in train_rows)  # one right answer of two per prompt
    evals = [r for r in metric_records(run_dir) if "eval/scores" in r]
    assert len(evals) == 3 and all(r["eval/scores"] == 0.0 for r in evals)  # the random model's own answers are wrong


def test_online_dpo_with_arithmetic_under_two_process_fsdp(tmp_path):
    from test_checkpoint_faults import CLI_TINY, cli

    args = [*CLI_TINY, *ONLINE_RF, "n_examples=16", "eval_every=8", "trainer=FSDPTrainer", "world_size=2"]
    result = cli(args, tmp_path, inject=RIGHT_ANSWER_SAMPLE)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    run_dir = next((tmp_path / "out").iterdir())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "online/labelled_pairs" in r]
    # Each rank labels its 4 pairs of a step; all 8 are labelled, the right answer chosen by 1.0 - 0.0.
    assert train_rows and all(r["online/labelled_pairs"] == 1.0 and r["objective/scores_margin"] == 1.0 for r in train_rows)
    assert all(r["online/failed_judgements"] == 0.0 for r in train_rows)
    assert "[judge] after 16 examples: 0 of 8 judgements failed" in result.stdout
    assert (run_dir / checkpoints.FINISHED).exists()


def test_a_reward_function_raising_on_every_row_stops_online_dpo_naming_the_row(tmp_path, user_module, capsys):
    user_module("boom", "def score(prompts, completions, **fields):\n    raise ValueError('no model here')\n")
    with pytest.raises(online.JudgeFailureError) as stopped:
        run_train([*ONLINE, "reward_functions=[boom:score]", "n_examples=16", "eval_every=8"], tmp_path / "out")
    message = str(stopped.value)
    assert message.startswith(
        "Training stopped: no pair could be labelled since the last eval (all 8 judgements failed; "
        "e.g. reward function boom:score raised ValueError: no model here on the completion of prompt 'Q: "
    ), message
    assert "fix the judge, reward model or reward function (online.scorer=reward_function)" in message
    (run_dir,) = (tmp_path / "out").iterdir()  # the run folder alone (tmp_path also holds boom.py: iterdir's order varies)
    assert (run_dir / "LATEST").resolve().name == "step-8"


@pytest.mark.parametrize("limit, stops", [("0.1", True), ("1.0", False)])
def test_a_function_raising_on_some_rows_counts_them_and_runs_on_only_under_the_threshold(
    tmp_path, user_module, capsys, limit, stops
):
    # It raises on the questions whose first operand is odd: about half of them (> 0.1, <= 1.0).
    user_module(
        "odd",
        """
        from evaluation import reward_functions

        def score(prompts, completions, **fields):
            for p in prompts:
                if int(reward_functions.ARITHMETIC_PROMPT.fullmatch(p)[1]) % 2:
                    raise ValueError("odd")
            return [1.0] * len(prompts)
        """,
    )
    args = [*ONLINE, "reward_functions=[odd:score]", "n_examples=16", "eval_every=8", f"online.max_failure_rate={limit}"]
    config = compose_config([*TINY, f"output_root={tmp_path}", *args])
    import train

    if stops:
        with pytest.raises(
            online.JudgeFailureError,
            match=r"judgements since the last eval failed \(\d+% > online.max_failure_rate=0.1; e.g. reward function odd:score raised ValueError: odd",
        ):
            train.main(config)
        return
    run_dir = Path(train.main(config)[0])
    out = capsys.readouterr().out
    failed = [r["online/failed_judgements"] for r in metric_records(run_dir) if "online/failed_judgements" in r]
    assert failed and 0 < sum(failed) / len(failed) < 1  # some pairs failed, some were labelled
    assert "[judge] after 16 examples:" in out and (run_dir / checkpoints.FINISHED).exists()
    # At each eval the odd questions' completions fail; eval/scores is the mean over the others (1.0), not NaN.
    assert [r["eval/scores"] for r in metric_records(run_dir) if "eval/scores" in r] == [1.0, 1.0, 1.0]
    table = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    odd = lambda prompt: int(reward_functions.ARITHMETIC_PROMPT.fullmatch(prompt)[1]) % 2  # noqa: E731
    assert [r["score"] for r in table] == [None if odd(r["prompt"]) else 1.0 for r in table]


# ----------------------------------------------------------------------------- evaluate.py


def test_evaluate_with_judge_reward_function_scores_every_response_by_hand(tmp_path):
    from test_evaluate import FAST, eval_config

    run = run_train(["loss=sft", "sample_during_eval=false", "n_examples=8"], tmp_path)
    out = Path(evaluate.main(eval_config([*FAST, f"policy={run}", "judge=reward_function", "reward_functions=[arithmetic]"])))
    got = json.loads((out / "results.json").read_text())
    assert got["judge"] == "reward_function" and got["reward_functions"] == ["arithmetic"] and got["reward_model"] is None
    rows = [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 6
    for r in rows:
        a, b = reward_functions.ARITHMETIC_PROMPT.fullmatch(r["judge_prompt"]).groups()
        right = str(int(a) + int(b))
        score_a = float(r["a"].strip() == right)
        assert r["b"] == f" {right}"  # baseline=chosen: the right answer, 1.0
        assert r["detail"] == {"score_a": score_a, "score_b": 1.0}
        assert r["verdict"] == ("tie" if score_a == 1.0 else "loss")
    for t in ("0", "1"):
        stats = got["temperatures"][t]
        assert stats["n"] == 6 and stats["failed"] == 0
        # the mean reward of A's samples is the share of right answers, worked out from the rows above
        mine = [
            float(r["a"].strip() == str(sum(map(int, reward_functions.ARITHMETIC_PROMPT.fullmatch(r["judge_prompt"]).groups()))))
            for r in rows
            if str(r.get("temperature")) in (t, f"{t}.0")
        ]
        assert len(mine) == 6 and stats["reward_mean"] == pytest.approx(sum(mine) / 6)


def test_evaluate_refuses_an_unknown_reward_function_before_sampling(tmp_path):
    from test_evaluate import FAST, eval_config

    run = run_train(["loss=sft", "sample_during_eval=false", "n_examples=8"], tmp_path)
    with pytest.raises(ConfigError, match="'sentimen' is not a registered reward function; did you mean 'sentiment'"):
        evaluate.main(eval_config([*FAST, f"policy={run}", "judge=reward_function", "reward_functions=[sentimen]"]))
    assert not (run / "eval").exists()
