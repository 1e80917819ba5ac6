"""evaluate.py: win rates of sampled responses, judged, with 95% intervals (the DPO paper's evaluation).

Policies are tiny runs of conftest's ``run_train`` (byte-level tokenizer, 2 layers), judges a tiny
random reward model or a chat-completions server on 127.0.0.1 started here. Expected values are
worked out by hand (the Wilson formula, the both-orders table) or recomputed independently from
the written samples (scores, lengths).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch
from conftest import REPO, needs_shared, run_torchrun, run_train
from hydra import compose, initialize_config_dir
from test_online import LocalChatServer, LongerIsBetterJudgeServer, save_tiny_reward_model

from evaluation import evaluate, judging, report, rewards, sampling, statistics
from evaluation.cache import Cache
from utils import ConfigError, DataError

# ----------------------------------------------------------------------------- helpers

FAST = ["datasets=[arithmetic]", "data.arithmetic.n_test=16", "n_prompts=6", "temperatures=[0,1.0]", "max_new_tokens=6"]
FAST += ["generate_batch_size=2", "num_threads=1", "progress_bar=false"]


def eval_config(overrides: list[str]):
    """The composed config of ``python evaluate.py <overrides>``."""
    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        return compose(config_name="evaluate", overrides=overrides)


def run_eval(overrides: list[str]) -> Path:
    """evaluate.main on FAST plus ``overrides``; returns the output folder."""
    return Path(evaluate.main(eval_config([*FAST, *overrides])))


def verdicts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()]


def results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An SFT run, a DPO run from it (model.archive) and a tiny reward model folder."""
    root = tmp_path_factory.mktemp("runs")
    sft = run_train(["loss=sft", "sample_during_eval=false", "exp_name=sft"], root)
    dpo = run_train(["loss=dpo", "sample_during_eval=false", "exp_name=dpo", f"model.archive={sft}/LATEST/policy.pt"], root)
    rm = save_tiny_reward_model(root / "rm")
    return {"sft": sft, "dpo": dpo, "rm": rm, "root": root}


def rm_args(runs) -> list[str]:
    return [f"reward_model.name_or_path={runs['rm']}"]


# ----------------------------------------------------------------------------- statistics by hand


def test_wilson_interval_by_hand():
    z = 1.959963984540054  # the 97.5% normal quantile
    for wins, n in [(7, 8), (0, 8), (8, 8), (30, 64)]:
        p = wins / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
        low, high = statistics.wilson_interval(wins, n)
        assert low == pytest.approx(centre - half, abs=1e-9) and high == pytest.approx(centre + half, abs=1e-9)
    assert statistics.wilson_interval(0, 0) == (None, None)


def test_ties_and_failures_are_counted_apart_never_for_a_side():
    stats = statistics.win_rate_stats(["win", "win", "tie", "loss", "failed"], max_failure_rate=0.1)
    # n = 4 judged pairs (the failed one is out of n): 2 wins, 1 tie, 1 loss.
    assert (stats["n"], stats["wins"], stats["ties"], stats["losses"], stats["failed"]) == (4, 2, 1, 1, 1)
    assert (stats["win_rate"], stats["tie_rate"], stats["loss_rate"]) == (0.5, 0.25, 0.25)
    assert (stats["ci_low"], stats["ci_high"]) == statistics.wilson_interval(2, 4)
    assert stats["failure_rate"] == 0.2 and stats["too_many_failures"]  # 1 of 5 > 0.1
    assert not statistics.win_rate_stats(["win", "failed", "loss", "tie", "tie"], 0.2)[
        "too_many_failures"
    ]  # 0.2 is not above 0.2
    empty = statistics.win_rate_stats(["failed", "failed"], 0.1)
    assert empty["n"] == 0 and empty["win_rate"] is None and empty["ci_low"] is None and empty["failure_rate"] == 1.0


@pytest.mark.parametrize(
    "a_first, b_first, expected",
    [
        (0, 1, "win"),  # A better shown first, A better shown second
        (1, 0, "loss"),
        (0, 0, "tie"),  # always the first position: position bias, not a preference
        (1, 1, "tie"),
        (rewards.TIE, 1, "tie"),
        (0, rewards.TIE, "tie"),
        (None, 1, "failed"),
        (0, None, "failed"),
    ],
)
def test_both_orders_combine_as_documented(a_first, b_first, expected):
    assert statistics.combine_orders(a_first, b_first) == expected


def test_scores_compare_with_ties_and_nan():
    assert [statistics.compare_scores(*s) for s in [(2.0, 1.0), (1.0, 2.0), (1.0, 1.0), (float("nan"), 1.0)]] == [
        "win",
        "loss",
        "tie",
        "failed",
    ]


def test_completion_text_keeps_the_leading_space_a_sentencepiece_decode_drops():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(needs_shared("models", "stories260K"))
    prompt = tokenizer("\n\nHuman: Hi there\n\nAssistant:", add_special_tokens=False)["input_ids"]
    completion = tokenizer(" Hello friend", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(completion) == "Hello friend"  # the bug this avoids: "Assistant:Hello"
    assert sampling.completion_text(tokenizer, prompt, completion) == " Hello friend"


def test_messages_as_hh_text_for_the_judge():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    messages.append({"role": "user", "content": "Bye?"})
    assert (
        sampling.messages_text(messages) == "\n\nSystem: Be brief.\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Bye?\n\nAssistant:"
    )
    assert sampling.judged_response("  Sure.\n", conversation=True) == " Sure."
    assert sampling.judged_response(" 42", conversation=False) == " 42"


def test_sample_keys_and_seeds_depend_on_everything_a_sample_depends_on(runs):
    config = eval_config([*FAST, f"policy={runs['dpo']}"])
    source = sampling.resolve_source(runs["dpo"], config)
    base = evaluate.sample_key(source, "A", 0.5, config, "batch", 0)
    assert base != evaluate.sample_key(source, "A", 1.0, config, "batch", 0)  # temperature
    assert base != evaluate.sample_key(source, "B", 0.5, config, "batch", 0)  # side
    assert base != evaluate.sample_key(source, "A", 0.5, config, "other batch", 0)
    assert base != evaluate.sample_key(source, "A", 0.5, config, "batch", 1)
    config.seed = 1
    assert base != evaluate.sample_key(source, "A", 0.5, config, "batch", 0)
    config.seed, config.max_new_tokens = 0, 7
    assert base != evaluate.sample_key(source, "A", 0.5, config, "batch", 0)
    assert evaluate.batch_seed(config, "A", 0.5, "b") != evaluate.batch_seed(config, "A", 1.0, "b")


# ----------------------------------------------------------------------------- one evaluation, end to end


def test_reward_model_judge_end_to_end_results_png_html_and_default_folder(runs, capsys):
    out = run_eval([f"policy={runs['dpo']}", *rm_args(runs)])
    printed = capsys.readouterr().out
    assert f"Evaluation folder: {out}" in printed and "| temperature | win rate |" in printed
    assert out.parent == runs["dpo"] / "eval" and out.name.startswith("vs_chosen_reward_model_")
    got = results(out)
    assert set(got["temperatures"]) == {"0", "1"} and got["interval"] == statistics.INTERVAL
    rows = verdicts(out)
    assert len(rows) == 2 * 6
    # Recompute every verdict from scratch: the reward model's scores of prompt + response.
    scorer = rewards.RewardModelScorer(runs["rm"])
    scores = scorer.score([r["judge_prompt"] for r in rows for _ in range(2)], [x for r in rows for x in (r["a"], r["b"])]).view(
        -1, 2
    )
    for r, (sa, sb) in zip(rows, scores.tolist()):
        assert r["verdict"] == ("win" if sa > sb else "loss" if sa < sb else "tie")
        assert r["detail"]["score_a"] == pytest.approx(sa, abs=1e-5)
    for t in ("0", "1"):
        mine = [r for r in rows if r["temperature"] == float(t)]
        wins, ties = sum(r["verdict"] == "win" for r in mine), sum(r["verdict"] == "tie" for r in mine)
        stats = got["temperatures"][t]
        assert (stats["n"], stats["failed"]) == (6, 0)
        assert stats["win_rate"] == wins / 6 and stats["tie_rate"] == ties / 6
        assert (stats["ci_low"], stats["ci_high"]) == pytest.approx(statistics.wilson_interval(wins, 6))
        assert {r["b"] for r in mine} == {
            r["b"] for r in rows if r["temperature"] == 0.0
        }  # chosen: the same at every temperature
    assert (out / "win_rates.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<table>" in (out / "samples.html").read_text()


def test_html_escapes_every_text(runs, tmp_path):
    data = tmp_path / "tags.jsonl"
    rows = [{"prompt": f"<b>Q{i}</b> & {i}+1=", "chosen": f" <i>{i + 1}</i>", "rejected": " 0"} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    json_data = ["datasets=[json]", f"data.json.path={data}", "data.json.holdout_fraction=0.5", "temperatures=[1.0]"]
    out = run_eval([f"policy={runs['dpo']}", *rm_args(runs), *json_data])
    page = (out / "samples.html").read_text()
    assert "&lt;b&gt;Q" in page and "&lt;i&gt;" in page and "&amp;" in page
    assert "<b>Q" not in page and "<i>" not in page


def test_a_greedy_policy_against_itself_ties_and_its_sampled_sides_differ(runs):
    out = run_eval([f"policy={runs['dpo']}", f"baseline={runs['dpo']}", *rm_args(runs), "max_new_tokens=12"])
    rows = verdicts(out)
    greedy = [r for r in rows if r["temperature"] == 0.0]
    assert all(r["a"] == r["b"] and r["verdict"] == "tie" for r in greedy)
    assert results(out)["temperatures"]["0"]["tie_rate"] == 1.0 and results(out)["temperatures"]["0"]["win_rate"] == 0.0
    # At temperature 1 the two sides draw their own seeds, so the same model writes other samples.
    assert any(r["a"] != r["b"] for r in rows if r["temperature"] == 1.0)


def test_same_seed_same_samples_another_seed_other_samples(runs, tmp_path):
    args = [f"policy={runs['dpo']}", *rm_args(runs), "temperatures=[1.0]", "max_new_tokens=12"]
    first = verdicts(run_eval([*args, f"output_dir={tmp_path / 'a'}"]))
    again = verdicts(run_eval([*args, f"output_dir={tmp_path / 'b'}"]))
    other = verdicts(run_eval([*args, f"output_dir={tmp_path / 'c'}", "seed=1"]))
    assert [r["a"] for r in first] == [r["a"] for r in again]
    assert [r["a"] for r in first] != [r["a"] for r in other]


def test_reference_baseline_is_the_sft_archive_and_policy_forms_agree(runs):
    args = [*rm_args(runs), "temperatures=[1.0]", "max_new_tokens=12"]
    by_reference = verdicts(run_eval([f"policy={runs['dpo']}", "baseline=reference", *args]))
    by_folder = verdicts(run_eval([f"policy={runs['dpo']}", f"baseline={runs['sft']}", *args]))
    # The reference is the SFT checkpoint DPO started from: the same weights write the same samples.
    assert [r["b"] for r in by_reference] == [r["b"] for r in by_folder]
    step = os.path.realpath(runs["dpo"] / "LATEST")
    for form in (step, os.path.join(step, "policy.pt"), os.path.join(step, "hf")):
        assert [r["a"] for r in verdicts(run_eval([f"policy={form}", *args]))] == [r["a"] for r in by_folder], form
    hf = sampling.resolve_source(os.path.join(step, "hf"), eval_config(FAST))
    assert hf.kind == "hf" and hf.run_dir == str(runs["dpo"])  # its output folder goes into the run


def test_output_folder_of_a_hub_id_or_a_folder_outside_a_run(runs, tmp_path):
    config = eval_config([*FAST, f"output_root={tmp_path / 'out'}", "policy=org/some-model"])
    hub = sampling.resolve_source("org/some-model", config)
    assert (hub.kind, hub.run_dir, hub.model_config.name_or_path) == ("hub", None, "org/some-model")
    out = evaluate.default_output_dir(config, hub, "chosen")
    assert Path(out).parent == tmp_path / "out" / "eval" and Path(out).name.startswith("vs_chosen_reward_model_")
    outside = shutil.copytree(runs["dpo"] / "LATEST" / "hf", tmp_path / "my_model")
    got = run_eval([f"policy={outside}", *rm_args(runs), f"output_root={tmp_path / 'out'}", "temperatures=[0]"])
    assert got.parent == tmp_path / "out" / "eval"


def test_a_baseline_with_another_tokenizer_is_decoded_and_re_tokenized_for_the_judge(runs, tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(needs_shared("tokenizers", "gpt2"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    config.eos_token_id = config.bos_token_id = tokenizer.eos_token_id
    LlamaForCausalLM(config).save_pretrained(tmp_path / "gpt2_llama")
    tokenizer.save_pretrained(tmp_path / "gpt2_llama")
    out = run_eval([f"policy={runs['dpo']}", f"baseline={tmp_path / 'gpt2_llama'}", *rm_args(runs), "temperatures=[1.0]"])
    rows = verdicts(out)
    assert all(isinstance(r["b"], str) and r["b"] for r in rows)
    # B's text is what its own tokenizer decodes; the byte-level reward model scored that text.
    scorer = rewards.RewardModelScorer(runs["rm"])
    for r in rows:
        sa, sb = scorer.score([r["judge_prompt"]] * 2, [r["a"], r["b"]]).tolist()
        assert r["verdict"] == statistics.compare_scores(sa, sb)


# ----------------------------------------------------------------------------- the cache: resume, nothing redone


def count_calls(monkeypatch, module, name, stop_at=None):
    """Wrap ``module.name`` to count its calls (and the texts of score calls); raise
    KeyboardInterrupt at call ``stop_at`` before doing it."""
    original = getattr(module, name)
    calls = {"n": 0, "texts": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if stop_at is not None and calls["n"] == stop_at:
            raise KeyboardInterrupt
        if name == "score":
            calls["texts"] += len(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_an_interrupted_sampling_resumes_without_resampling(runs, monkeypatch):
    args = [f"policy={runs['dpo']}", f"baseline={runs['sft']}", *rm_args(runs)]
    # 6 prompts in batches of 2 = 3 batches, 2 temperatures, 2 sides: 12 generate calls in all.
    calls = count_calls(monkeypatch, sampling, "generate_batch", stop_at=6)
    with pytest.raises(evaluate.Interrupted) as stopped:
        run_eval(args)
    out = stopped.value.output_dir
    monkeypatch.undo()
    calls = count_calls(monkeypatch, sampling, "generate_batch")
    resumed = Path(evaluate.main(eval_config([f"resume={out}"])))
    assert resumed == Path(out) and calls["n"] == 12 - 5  # the 5 finished batches are not sampled again
    monkeypatch.undo()
    calls = count_calls(monkeypatch, sampling, "generate_batch")
    fresh = run_eval(args)
    assert calls["n"] == 12  # every batch of every temperature has its own key
    assert verdicts(fresh) == verdicts(resumed)  # resuming changed nothing


def test_an_interrupted_judging_resumes_without_rescoring(runs, monkeypatch):
    monkeypatch.setattr(judging, "JUDGE_CHUNK", 4)
    args = [f"policy={runs['dpo']}", *rm_args(runs), "max_new_tokens=12"]
    calls = count_calls(monkeypatch, rewards.RewardModelScorer, "score", stop_at=3)
    with pytest.raises(evaluate.Interrupted) as stopped:
        run_eval(args)
    done = calls["texts"]
    assert done == 8  # two chunks of 4 texts were scored and cached before the stop
    monkeypatch.setattr(judging, "JUDGE_CHUNK", 4)
    calls = count_calls(monkeypatch, rewards.RewardModelScorer, "score")
    resumed = Path(evaluate.main(eval_config([f"resume={stopped.value.output_dir}"])))
    unique = {(r["judge_prompt"], x) for r in verdicts(resumed) for x in (r["a"], r["b"])}
    assert calls["texts"] == len(unique) - done  # each distinct response scored once in all
    calls["texts"] = 0
    evaluate.main(eval_config([f"resume={resumed}"]))
    assert calls["texts"] == 0  # a finished evaluation resumed asks nothing


def test_a_cut_last_line_is_skipped_and_the_next_record_starts_a_line(tmp_path):
    path = tmp_path / "samples-rank0.jsonl"
    path.write_text('{"key": "a", "text": "x"}\n{"key": "b", "te')  # killed mid-write
    cache = Cache(str(tmp_path), "samples", 0)
    assert cache.get("a") == {"key": "a", "text": "x"} and cache.get("b") is None
    cache.put([{"key": "b", "text": "y"}])
    assert Cache(str(tmp_path), "samples", 1).get("b") == {"key": "b", "text": "y"}  # other ranks read it too


# ----------------------------------------------------------------------------- HTTP judge on 127.0.0.1


class PaperJudgeServer(LocalChatServer):
    """A chat-completions endpoint on 127.0.0.1 answering the DPO paper's dialogue prompt in its
    format ("Comparison: ...\\nMore helpful: A"; its summarisation prompt: "Preferred: A"). ``mode``: ``longer`` prefers the longer
    response (ties to the first shown), ``first`` always says A (pure position bias),
    ``broken`` answers HTTP 500, ``half`` answers 500 for prompts containing "+1" (arithmetic's
    "x+1..." prompts) and ``longer`` otherwise. Every request body is kept in ``seen``."""

    def __init__(self, mode: str):
        server = self
        self.seen: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.seen.append(body)
                text = body["messages"][0]["content"]
                kind, head, verdict = (
                    ("Summary", "Post:\n", "Preferred") if "Summary A:" in text else ("Response", "Query: ", "More helpful")
                )
                a = text.split(f"{kind} A:\n")[1].split(f"\n\n{kind} B:\n")[0]
                b = text.split(f"\n\n{kind} B:\n")[1].split("\n\nFIRST provide")[0]
                query = text.split(head)[1].split(f"\n\n{kind} A:")[0]
                if mode == "broken" or (mode == "half" and "+1" in query):
                    self.send_response(500)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                pick = "A" if mode == "first" or len(a) >= len(b) else "B"
                answer = f"Comparison: one is longer.\n{verdict}: {pick}"
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": answer}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.serve(Handler)


@pytest.fixture
def paper_server(request):
    server = PaperJudgeServer(request.param)
    yield server
    server.close()


def http_args(server) -> list[str]:
    return ["judge=http_judge", f"judge.base_url={server.url}", "judge.model=m", "judge.max_retries=0", "judge.timeout=5"]


def expected_by_length(row: dict) -> str:
    """The verdict a longer-wins judge asked in both orders gives (equal lengths: it picks the
    first shown each time, so the two orders disagree: a tie)."""
    if row["a"] == row["b"] or len(row["a"]) == len(row["b"]):
        return "tie"
    return "win" if len(row["a"]) > len(row["b"]) else "loss"


@pytest.mark.parametrize("paper_server", ["longer"], indirect=True)
def test_http_judge_end_to_end_with_the_paper_prompt_in_both_orders(runs, paper_server, monkeypatch):
    out = run_eval([f"policy={runs['dpo']}", *http_args(paper_server), "max_new_tokens=12"])
    rows = verdicts(out)
    assert [r["verdict"] for r in rows] == [expected_by_length(r) for r in rows]
    asked = [b for b in paper_server.seen]
    assert len(asked) == 2 * sum(r["a"] != r["b"] for r in rows)  # both orders of every pair that differs
    assert all(b["max_tokens"] == rewards.NAMED_TEMPLATE_MAX_TOKENS for b in asked)
    first = asked[0]["messages"][0]["content"]
    assert first.startswith("For the following query to a chatbot, which response is more helpful?\n\nQuery: ")
    shown = {(b["messages"][0]["content"].split("Response A:\n")[1].split("\n\nResponse B:")[0]) for b in asked}
    assert {r["a"] for r in rows if r["a"] != r["b"]} <= shown and {r["b"] for r in rows if r["a"] != r["b"]} <= shown
    # Resumed, nothing is asked again.
    paper_server.seen.clear()
    evaluate.main(eval_config([f"resume={out}", f"judge.base_url={paper_server.url}"]))  # an endpoint only when given
    assert paper_server.seen == []


@pytest.mark.parametrize("paper_server", ["longer"], indirect=True)
def test_tldr_prompts_are_judged_with_the_papers_summarisation_prompt(runs, paper_server, tmp_path):
    for split in ("train", "validation"):
        rows = [{"prompt": f"SUBREDDIT: r/x TITLE: t{i} POST: <post {i}> TL;DR:", "completion": " s"} for i in range(4)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tldr = ["datasets=[tldr]", f"data.tldr.path={tmp_path}", "n_prompts=3", "temperatures=[1.0]", "max_new_tokens=12"]
    out = run_eval([f"policy={runs['dpo']}", f"baseline={runs['sft']}", *http_args(paper_server), *tldr])
    rows = verdicts(out)
    assert len(rows) == 3 and [r["verdict"] for r in rows] == [expected_by_length(r) for r in rows]
    assert all(b["messages"][0]["content"].startswith(rewards.DPO_SUMMARIZATION_CONCISE_TEMPLATE[:60]) for b in paper_server.seen)
    assert any("Post:\nSUBREDDIT: r/x TITLE: t0 POST: <post 0> TL;DR:" in b["messages"][0]["content"] for b in paper_server.seen)


@pytest.mark.parametrize("paper_server", ["first"], indirect=True)
def test_a_judge_that_always_picks_the_first_position_gives_only_ties(runs, paper_server):
    out = run_eval([f"policy={runs['dpo']}", *http_args(paper_server)])
    assert {r["verdict"] for r in verdicts(out)} == {"tie"}
    assert all(t["win_rate"] == 0.0 and t["tie_rate"] == 1.0 for t in results(out)["temperatures"].values())


def test_a_custom_template_with_the_online_dpo_server_helper(runs):
    server = LongerIsBetterJudgeServer()
    try:
        template = "'Q {prompt} <<<A>>>{response0}<<<B>>>{response1}<<<END>>> answer 0 or 1'"
        args = [
            "judge=http_judge",
            f"judge.base_url={server.url}",
            "judge.model=m",
            f"judge.template={template}",
            "max_new_tokens=12",
        ]
        rows = verdicts(run_eval([f"policy={runs['dpo']}", *args]))
    finally:
        server.close()
    assert [r["verdict"] for r in rows] == [expected_by_length(r) for r in rows]


@pytest.mark.parametrize("paper_server", ["half"], indirect=True)
def test_a_failure_rate_above_the_threshold_is_reported_and_printed(runs, paper_server, capsys):
    # Arithmetic prompts "Q: a+b=": the server fails those whose text holds "+1".
    out = run_eval([f"policy={runs['dpo']}", *http_args(paper_server), "max_new_tokens=12", "max_failure_rate=0.1"])
    rows = verdicts(out)
    printed = capsys.readouterr().out
    for t, stats in results(out)["temperatures"].items():
        mine = [r for r in rows if r["temperature"] == float(t)]
        failed = [r for r in mine if "+1" in r["judge_prompt"] and r["a"] != r["b"]]
        assert stats["failed"] == len(failed) > 0 and stats["n"] == len(mine) - len(failed)
        assert all(r["verdict"] == "failed" for r in failed)
        assert (
            stats["too_many_failures"]
            and f"Warning: at temperature {t}, {len(failed)} of {len(mine)} judgements failed" in printed
        )


@pytest.mark.parametrize("paper_server", ["broken"], indirect=True)
def test_a_judge_that_fails_every_call_is_one_sentence_and_recorded(runs, paper_server):
    with pytest.raises(ConfigError, match=r"Every judgement failed \(12 of 12; e\.g\. HTTP 500") as e:
        run_eval([f"policy={runs['dpo']}", *http_args(paper_server), "max_new_tokens=12"])
    folder = str(e.value).split("resume=")[1].split(" ")[0]
    got = results(Path(folder))
    assert all(t["failed"] == 6 and t["n"] == 0 and t["too_many_failures"] for t in got["temperatures"].values())


def test_named_templates_parse_the_papers_answer_format():
    judge = rewards.HTTPJudge("http://127.0.0.1:1/v1", "m", template="dpo_summarization_concise")
    assert judge.template == rewards.DPO_SUMMARIZATION_CONCISE_TEMPLATE and "precise and concise" in judge.template
    assert judge._parse(json.dumps({"choices": [{"message": {"content": "Comparison: x.\nPreferred: B"}}]}).encode()) == 1
    assert judge._parse(json.dumps({"choices": [{"message": {"content": 'Comparison: x.\nPreferred: "A"'}}]}).encode()) == 0
    assert judge._parse(json.dumps({"choices": [{"message": {"content": "I cannot decide."}}]}).encode()) is None
    assert "no verdict line" in judge.last_errors[-1]
    plain = rewards.HTTPJudge("http://127.0.0.1:1/v1", "m")
    assert plain.max_tokens == 1 and plain.answer_pattern is None  # online DPO's default is unchanged


# ----------------------------------------------------------------------------- two processes


def test_two_processes_give_the_one_process_results(runs, tmp_path):
    args = [*FAST, f"policy={runs['dpo']}", f"baseline={runs['sft']}", *rm_args(runs), "max_new_tokens=12"]
    one = Path(evaluate.main(eval_config([*args, f"output_dir={tmp_path / 'one'}"])))
    returncode, text = run_torchrun(["evaluate.py", *args, f"output_dir={tmp_path / 'two'}"])
    assert returncode == 0, text[-3000:]
    two = tmp_path / "two"
    assert sorted(p.name for p in two.glob("samples-rank*.jsonl")) == [
        "samples-rank0.jsonl",
        "samples-rank1.jsonl",
    ]  # both ranks sampled
    rows_one, rows_two = verdicts(one), verdicts(two)
    assert len(rows_two) == len(rows_one) == 2 * 6
    for a, b in zip(rows_one, rows_two):
        assert {k: v for k, v in a.items() if k != "detail"} == {k: v for k, v in b.items() if k != "detail"}
        assert b["detail"]["score_a"] == pytest.approx(a["detail"]["score_a"], abs=1e-5)  # scored in other batches
    for t, stats in results(one)["temperatures"].items():
        other = results(two)["temperatures"][t]
        reward = [f"{p}_{k}" for p in ("reward", "baseline_reward") for k in ("mean", "ci_low", "ci_high")]  # other batches
        assert {k: v for k, v in other.items() if k not in reward} == {k: v for k, v in stats.items() if k not in reward}
        assert [other[k] for k in reward] == pytest.approx([stats[k] for k in reward], abs=1e-5)


# ----------------------------------------------------------------------------- bad input, one sentence each


def test_bad_input_is_one_sentence(runs, tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hi")
    rm_run = run_train(["loss=reward", "n_examples=8", "do_first_eval=false"], tmp_path / "rm_run")
    cases = [
        ([f"policy={tmp_path / 'junk'}"], ConfigError, "is a folder but not a model"),
        ([f"policy={tmp_path / 'nope'}"], ConfigError, "does not exist"),
        ([f"policy={rm_run}"], ConfigError, r"is a reward model \(loss=reward\), not a policy"),
        (["policy=org/x", "baseline=reference"], ConfigError, "baseline=reference needs a policy trained here"),
        ([f"policy={runs['dpo']}", "n_prompts=0"], ConfigError, "n_prompts must be an integer >= 1"),
        ([f"policy={runs['dpo']}", "temperatures=[]"], ConfigError, "temperatures must be a list of numbers >= 0"),
        ([f"policy={runs['dpo']}", "temperatures=[0.5,-1]"], ConfigError, "temperatures must be a list of numbers >= 0"),
        ([f"policy={runs['dpo']}", "reward_model.name_or_path=null"], ConfigError, "needs reward_model.name_or_path"),
        ([f"policy={runs['dpo']}", "judge=http_judge"], ConfigError, "needs judge.base_url"),
        ([f"policy={runs['dpo']}", "datasets=[tldr]", f"data.tldr.path={tmp_path}"], ConfigError, "has prompts only"),
    ]
    folders = set((runs["dpo"] / "eval").glob("*"))
    for overrides, error, message in cases:
        with pytest.raises(error, match=message):
            run_eval([*rm_args(runs), f"output_root={tmp_path / 'out'}", *overrides])
    assert set((runs["dpo"] / "eval").glob("*")) == folders and not (tmp_path / "out").exists()  # no folder is left behind


def test_an_empty_prompt_set_is_one_sentence(runs, tmp_path):
    data = tmp_path / "few.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": " a", "rejected": " b"}) + "\n" for i in range(3)))
    with pytest.raises(DataError, match="has no pairs"):
        run_eval(
            [
                f"policy={runs['dpo']}",
                *rm_args(runs),
                "datasets=[json]",
                f"data.json.path={data}",
                "data.json.holdout_fraction=0.001",
            ]
        )


def test_command_line_errors_exit_2_with_one_sentence(runs, tmp_path):
    (tmp_path / "junk").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for args, message in [
        ([f"policy={tmp_path / 'junk'}"], "is a folder but not a model"),
        (["polcy=x"], "polcy is not a config key; did you mean policy?"),
        (["judge=http"], "judge=http is not an option of judge"),
    ]:
        done = subprocess.run(
            [sys.executable, "evaluate.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2, done.stderr[-2000:]
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert lines[-1].startswith("Error: ") and message in lines[-1] and "Traceback" not in done.stderr


def test_plot_with_adds_other_evaluations_lines(runs, tmp_path):
    first = run_eval([f"policy={runs['sft']}", *rm_args(runs), "temperatures=[0]", "label=SFT"])
    second = run_eval(
        [f"policy={runs['dpo']}", f"baseline={runs['sft']}", "baseline_label=SFT", *rm_args(runs), "temperatures=[0]"]
    )
    assert second.name.startswith("vs_SFT_reward_model_")
    series = report.plot_series({"policy": "DPO", "baseline": "chosen", "temperatures": {}}, [str(first), str(second)])
    assert [s["label"] for s in series] == ["DPO", "SFT", f"{runs['dpo'].name} (vs SFT)"] and series[1][
        "temperatures"
    ].keys() == {"0"}
    with pytest.raises(ConfigError, match="holds no results.json"):
        report.plot_series({"policy": "dpo", "baseline": "chosen", "temperatures": {}}, [str(tmp_path)])


def test_a_lora_run_is_evaluated_with_its_adapters_on_its_base(runs, tmp_path):
    run = run_train(["loss=dpo", "sample_during_eval=false", "model.lora.r=4", "lr=3e-2"], tmp_path)
    checkpoint = torch.load(run / "LATEST" / "policy.pt", weights_only=False)
    assert checkpoint.get("lora") is not None  # policy.pt holds the adapters alone
    source = sampling.resolve_source(run, eval_config(FAST))
    policy, _ = sampling.load_source(source, "cpu")
    state = policy.get_base_model().state_dict()
    assert all(torch.equal(state[k], v) for k, v in checkpoint["state"].items())
    reference, _ = sampling.load_source(sampling.reference_source(source), "cpu")
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        assert (policy(ids).logits - reference(ids).logits).abs().max() > 1e-3  # the trained adapters are on
    out = run_eval([f"policy={run}", "baseline=reference", *rm_args(runs), "temperatures=[0]"])
    assert results(out)["temperatures"]["0"]["n"] == 6


# ----------------------------------------------------------------------------- fresh-user regressions


def test_a_lora_runs_hf_folders_are_its_checkpoint_and_evaluate_into_the_run(runs, tmp_path):
    """A LoRA run's ``hf/`` is an adapter folder (no config.json): it is the checkpoint it was
    exported from; ``hf/merged`` is a model folder whose results go into the run's eval/ too."""
    run = run_train(["loss=dpo", "sample_during_eval=false", "model.lora.r=4", "model.lora.export_merged=true"], tmp_path)
    config = eval_config(FAST)
    adapter = sampling.resolve_source(run / "LATEST" / "hf", config)
    assert adapter.kind == "checkpoint" and adapter.run_dir == str(run.resolve()) and adapter.weights.endswith("policy.pt")
    merged = sampling.resolve_source(run / "LATEST" / "hf" / "merged", config)
    assert merged.kind == "hf" and merged.run_dir == str(run.resolve()) and merged.label.startswith(run.name + "/")
    alone = tmp_path / "adapter_alone"
    shutil.copytree(run / "LATEST" / "hf", alone, ignore=shutil.ignore_patterns("merged"))
    with pytest.raises(ConfigError, match="names no base model"):  # a random model.config base: nothing to load it onto
        sampling.resolve_source(alone, config)


def test_http_judge_without_its_endpoint_names_judge_not_online_dpo():
    with pytest.raises(ConfigError, match=r"^judge=http_judge needs judge.base_url"):
        evaluate.check_config(eval_config([*FAST, "policy=x", "judge=http_judge"]))


def test_a_hub_id_that_does_not_load_names_itself(runs, monkeypatch):
    source = sampling.resolve_source("no-such-org/no-such-model", eval_config(FAST), "baseline")

    def offline(model_config):
        raise ConfigError("Could not load the tokenizer (model.tokenizer_name_or_path, else model.name_or_path).")

    monkeypatch.setattr(sampling.models, "load_tokenizer", offline)
    with pytest.raises(ConfigError, match=r"^no-such-org/no-such-model is not a folder here and could not be loaded as a hub id"):
        sampling.load_source(source, "cpu")


def test_prompts_the_policy_trained_on_are_refused(tmp_path):
    """HH's local copy is one file: a run that held out 10% of it trained on the rest, so an
    evaluation of the whole file (holdout_fraction=0) would judge training prompts."""
    hh = [f"data.hh.local_dir={needs_shared('data', 'hh-rlhf')}", "data.hh.subsets=[harmless-base]"]
    run = run_train(["datasets=[hh]", *hh, "data.hh.holdout_fraction=0.1", "n_examples=8", "do_first_eval=false"], tmp_path)
    common = [*FAST, f"policy={run}", "datasets=[hh]", *hh, "n_prompts=40"]
    policy = sampling.resolve_source(run, eval_config(common))
    whole = sampling.load_items(eval_config([*common, "data.hh.holdout_fraction=0.0"]), silent=True)
    held_out = sampling.load_items(eval_config([*common, "data.hh.holdout_fraction=0.1"]), silent=True)
    assert evaluate.training_overlap(held_out, policy) == {}
    seen = evaluate.training_overlap(whole, policy)["hh"]
    assert 30 <= seen <= 40  # about 90% of the first 40 prompts of the file are outside the 10% held out
    with pytest.raises(DataError, match=r"evaluation prompts of hh are in the training data .* data.hh.holdout_fraction=0.1"):
        evaluate.main(eval_config([*common, "data.hh.holdout_fraction=0.0", "reward_model.name_or_path=unused"]))


def test_a_causal_lm_as_the_judges_reward_model_is_refused_before_sampling(tmp_path):
    # evaluate.py shares online DPO's check: a plain causal LM's score head is random.
    from test_rewards import causal_lm_without_architectures

    stories = needs_shared("models", "stories260K")
    for judge in ("reward_model", "reward_model_judge"):
        with pytest.raises(ConfigError, match=r"has no trained score head \(its config.json names LlamaForCausalLM\)"):
            judging.Judge(eval_config([*FAST, "policy=unused", f"judge={judge}", f"reward_model.name_or_path={stories}"]))
    # A folder whose config.json names no architecture passes that check, and is refused when loaded.
    lm = causal_lm_without_architectures(tmp_path / "lm")
    judge = judging.Judge(eval_config([*FAST, "policy=unused", f"reward_model.name_or_path={lm}"]))
    with pytest.raises(ConfigError, match="has no trained score head .score.weight not in the checkpoint."):
        judge._build()


def test_a_reward_model_run_folder_as_the_judge_is_one_sentence_naming_its_export(tmp_path):
    # Regression (issue 24's fresh-user pass): evaluate.py judge=reward_model given a train.py run
    # folder sampled first, then ended in transformers' "Unrecognized model" traceback (exit 1).
    run = tmp_path / "rm_run"
    (run / "step-8" / "hf").mkdir(parents=True)
    (run / "step-8" / "hf" / "config.json").write_text("{}")
    (run / "LATEST").symlink_to("step-8")
    with pytest.raises(ConfigError) as error:
        judging.Judge(eval_config([*FAST, "policy=unused", "judge=reward_model", f"reward_model.name_or_path={run}"]))
    assert str(error.value) == (
        f"reward_model.name_or_path={run} is a run folder or checkpoint of train.py, not a model folder; give its export, "
        f"reward_model.name_or_path={run / 'LATEST' / 'hf'}."
    )


# ----------------------------------------------------------------------------- the policy run's own prompts, the plot's title, resolved paths


def test_the_embedded_default_run_is_evaluated_on_its_own_held_out_arithmetic_prompts(runs, tmp_path, monkeypatch, capsys):
    judge_run = tmp_path / "judge_run"
    judge_run.mkdir()
    (judge_run / "LATEST").symlink_to(runs["rm"])  # a judge named through a LATEST link
    titles = []
    plot = report.plot_win_rates
    monkeypatch.setattr(report, "plot_win_rates", lambda *a: titles.append(plot(*a)))
    no_datasets = [a for a in FAST if not a.startswith(("datasets=", "data."))]  # nothing says which prompts
    out = Path(
        evaluate.main(eval_config([*no_datasets, f"policy={runs['dpo']}", f"reward_model.name_or_path={judge_run}/LATEST"]))
    )
    # arithmetic's definition: the 100 x 100 problems shuffled by random.Random(1234), train the first
    # n_train, test the next n_test; the run had TINY's n_train=64, so its held-out prompts start at 64
    rng = random.Random(1234)
    problems = [(a, b) for a in range(100) for b in range(100)]
    rng.shuffle(problems)
    expected = [f"Q: {a}+{b}=\nA:" for a, b in problems[64:70]]  # n_prompts=6
    assert [r["judge_prompt"] for r in verdicts(out) if r["temperature"] == 0.0] == expected
    got = results(out)
    assert got["datasets"] == ["arithmetic"]
    assert f"Prompts: the held-out split of {runs['dpo'].name}'s datasets=['arithmetic'], read with its data.* settings." in (
        capsys.readouterr().out
    )
    # results.json names what was judged with, links resolved: the run's LATEST is its step-48
    assert got["reward_model"] == os.path.realpath(runs["rm"])
    assert got["policy_path"] == os.path.realpath(runs["dpo"] / "step-48")
    assert not any("LATEST" in Path(p).parts for p in (got["reward_model"], got["policy_path"]))
    assert titles == ["6 prompts, judge: reward_model rm\n(bands: 95% Wilson interval)"]
    assert (out / "win_rates.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_given_datasets_win_and_a_policy_without_a_run_falls_back_to_hh_with_a_note(runs, capsys):
    config = eval_config([f"policy={runs['dpo']}", "datasets=[shp]"])
    evaluate.settle_datasets(config, sampling.resolve_source(config.policy, config), say=True)
    assert list(config.datasets) == ["shp"] and capsys.readouterr().out == ""
    config = eval_config(["policy=org/some-model"])
    evaluate.settle_datasets(config, sampling.resolve_source(config.policy, config), say=True)
    assert list(config.datasets) == ["hh"]
    assert capsys.readouterr().out == (
        "Note: policy=org/some-model has no run folder naming its datasets, so the prompts are the held-out split of "
        "datasets=['hh']; give datasets=[...] to choose.\n"
    )


def test_the_win_rate_title_names_the_number_of_prompts_and_the_judge(tmp_path):
    config = eval_config(["policy=x", "judge=http_judge", "judge.model=gpt-4"])
    assert report.judge_text(config) == "http_judge gpt-4"
    config = eval_config(["policy=x", "judge=reward_function", "reward_functions=[arithmetic,length]"])
    assert report.judge_text(config) == "reward_function arithmetic+length"
    title = report.win_rates_title(64, "http_judge gpt-4")
    assert title == "64 prompts, judge: http_judge gpt-4\n(bands: 95% Wilson interval)"
    series = [{"label": "A", "temperatures": {"0": {"win_rate": 0.5, "ci_low": 0.3, "ci_high": 0.7}}}]
    assert report.plot_win_rates(series, str(tmp_path / "w.png"), "chosen", title) == title
    assert (tmp_path / "w.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_output_dir_holding_a_file_other_files_or_another_evaluation_is_refused_before_sampling(runs, tmp_path, monkeypatch):
    # Regression (issue 34): output_dir= an existing evaluation replaced its results and mixed its samples.
    args = [f"policy={runs['dpo']}", *rm_args(runs), "temperatures=[0]"]
    out = run_eval([*args, f"output_dir={tmp_path / 'a'}"])
    before = (out / "verdicts.jsonl").read_text()
    calls = count_calls(monkeypatch, sampling, "generate_batch")
    assert run_eval([*args, f"output_dir={out}", "progress_bar=true"]) == out  # the same evaluation: continued
    assert calls["n"] == 0 and (out / "verdicts.jsonl").read_text() == before
    (tmp_path / "file").write_text("a user's file\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("a user's notes\n")
    cases = {
        out: f"output_dir={out} holds another evaluation (seed (saved 0, given 1)); give a new folder, or continue "
        f"that one with python evaluate.py resume={out}.",
        tmp_path / "file": f"output_dir={tmp_path / 'file'} is a file; give a new or empty folder.",
        tmp_path / "other": f"output_dir={tmp_path / 'other'} is a folder with other files in it (notes.txt); give a "
        "new or empty folder.",
    }
    for folder, says in cases.items():
        with pytest.raises(ConfigError) as e:
            run_eval([*args, f"output_dir={folder}", "seed=1"])
        assert str(e.value) == says
    assert calls["n"] == 0 and (out / "verdicts.jsonl").read_text() == before  # nothing sampled, nothing replaced
    assert (tmp_path / "file").read_text() == "a user's file\n"
