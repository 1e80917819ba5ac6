"""Online DPO (Guo et al. 2024) and Bradley-Terry reward-model training (loss=reward).

Expected values are worked out by hand in the comments, or from the papers' formulas.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from conftest import TINY, compose_config, metric_records, needs_shared, run_train, tiny_llama_scorer
from omegaconf import OmegaConf

import losses
import train
import trainers
import utils
from evaluation import rewards, sampling
from modeling import models, optimization
from objectives import reward
from online import trainer as online
from runs import checkpoints, checks

# ----------------------------------------------------------------------------- small pieces


def test_beta_schedule_one_value_per_epoch_last_repeats():
    assert optimization.beta_for_epoch(0.1, 7) == 0.1
    schedule = OmegaConf.create({"beta": [0.5, 0.2, 0.1]}).beta  # as Hydra gives it: a ListConfig
    assert [optimization.beta_for_epoch(schedule, e) for e in range(5)] == [0.5, 0.2, 0.1, 0.1, 0.1]


def test_beta_list_is_validated():
    for bad in ("[0.1,-1]", "[]"):
        config = compose_config(["loss=dpo", f"loss.beta={bad}"])
        with pytest.raises(utils.ConfigError, match="loss.beta must be > 0"):
            checks.validate_config(config)


def test_completion_mask_stops_after_the_first_eos():
    eos = 1
    completions = torch.tensor([[3, 1, 0, 0], [3, 4, 5, 6], [1, 1, 1, 1], [4, 1, 5, 1]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(sampling.completion_mask(completions, eos), expected)


class FixedScorer:
    """Scores each completion by a table lookup (a stand-in reward model)."""

    def __init__(self, table: dict[str, float]):
        self.table = table
        self.calls = []

    def score(self, prompts, completions):
        self.calls.append((list(prompts), list(completions)))
        return torch.tensor([self.table[c] for c in completions])


class FixedJudge:
    def __init__(self, answers):
        self.answers = answers

    def judge(self, prompts, pairs):
        return list(self.answers)


def test_label_pairs_with_scores_ties_and_the_missing_eos_penalty():
    eos = 1
    texts = ["a", "b", "c", "d", "e", "f", "g", "h"]
    scorer = FixedScorer({"a": 2.0, "b": 1.0, "c": 1.0, "d": 3.0, "e": 1.5, "f": 1.5, "g": 2.0, "h": 1.5})
    # Completion g has no EOS: 2.0 - penalty 1.0 = 1.0 < 1.5, so h wins pair 3. All others end with EOS.
    completions = torch.tensor([[5, 1]] * 6 + [[5, 5], [5, 1]])
    mask = sampling.completion_mask(completions, eos)
    preferences, scores = online.label_pairs(scorer, ["p0", "p1", "p2", "p3"], texts, completions, mask, eos, 1.0)
    assert preferences == [0, 1, rewards.TIE, 1]
    assert scores.tolist() == [[2.0, 1.0], [1.0, 3.0], [1.5, 1.5], [1.0, 1.5]]
    # Each prompt is scored with both of its completions (rows 2i and 2i+1).
    assert scorer.calls[0][0] == ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"]


def test_label_pairs_with_a_judge_passes_failures_and_ties_through():
    completions = torch.tensor([[5, 1]] * 6)
    mask = sampling.completion_mask(completions, 1)
    judge = FixedJudge([1, None, rewards.TIE])
    preferences, scores = online.label_pairs(judge, ["p", "q", "r"], list("abcdef"), completions, mask, 1, 5.0)
    assert preferences == [1, None, rewards.TIE] and scores is None


def test_completions_table_is_jsonl_and_escaped_html(tmp_path):
    online.write_completions(str(tmp_path), [{"step": 0, "prompt": "<b>hi</b>", "completion": "x & y", "score": 1.5}])
    online.write_completions(str(tmp_path), [{"step": 8, "prompt": "p", "completion": "z", "score": None}])
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 8]
    page = (tmp_path / "completions.html").read_text()
    assert "&lt;b&gt;hi&lt;/b&gt;" in page and "x &amp; y" in page and page.count("<tr>") == 3  # header + 2 rows


# ----------------------------------------------------------------------------- reward model


def test_bradley_terry_loss_by_hand():
    # -log sigmoid(d): d = 0 -> ln 2; d = 2 -> log(1 + e^-2); d = -1 -> log(1 + e).
    got = reward.bradley_terry_loss(torch.tensor([0.0, 3.0, 1.0]), torch.tensor([0.0, 1.0, 2.0]))
    expected = torch.tensor([math.log(2), math.log1p(math.exp(-2)), math.log1p(math.e)])
    torch.testing.assert_close(got, expected)


def tiny_reward_model(pad_token_id: int):
    return tiny_llama_scorer(32, pad_token_id).eval()


def test_last_token_scores_read_the_last_real_token_even_when_pad_is_eos():
    eos = pad = 2
    model = tiny_reward_model(pad)
    a = torch.tensor([[5, 6, 7, eos]])  # ends with EOS, which is also the pad token
    b = torch.tensor([[5, 8, eos, 0, 0, 0]])[:, :3]
    batch = torch.tensor([[5, 6, 7, eos], [5, 8, eos, pad]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    with torch.no_grad():
        alone_a = reward.last_token_scores(model, a, torch.ones_like(a))
        alone_b = reward.last_token_scores(model, b, torch.ones_like(b))
        both = reward.last_token_scores(model, batch, mask)
        # Independent reference: the head applied to the backbone's hidden state at the EOS position.
        hidden = model.model(input_ids=a).last_hidden_state[:, -1]
        by_hand = model.score(hidden)[:, 0]
    torch.testing.assert_close(both, torch.cat([alone_a, alone_b]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alone_a, by_hand, rtol=1e-5, atol=1e-6)


run, records = run_train, metric_records


def test_reward_model_training_starts_at_ln2_learns_and_exports_a_loadable_scorer(tmp_path):
    from transformers import AutoModelForSequenceClassification

    run_dir = run(["loss=reward", "n_examples=320", "eval_every=160", "data.arithmetic.n_train=320"], tmp_path)
    evals = [r for r in records(run_dir) if "loss/eval" in r]
    assert evals[0]["loss/eval"] == pytest.approx(math.log(2), abs=0.02)  # a fresh head scores ~0 for all
    assert evals[-1]["scores_eval/accuracies"] > evals[0]["scores_eval/accuracies"]
    hf = run_dir / "LATEST" / "hf"
    model = AutoModelForSequenceClassification.from_pretrained(hf)
    assert model.config.num_labels == 1
    # The saved folder is what online DPO loads as reward_model.name_or_path.
    scorer = rewards.RewardModelScorer(str(hf))
    got = scorer.score(["2+3="], ["5"])
    assert got.shape == (1,) and torch.isfinite(got).all()
    # Its trained head passes the untrained-head checks (config.json's and loading's), as online DPO loads it.
    built = rewards.build_scorer(compose_config([*ONLINE, f"reward_model.name_or_path={hf}"]), device="cpu")
    assert torch.equal(built.score(["2+3="], ["5"]), got)


def test_reward_model_starts_from_an_sft_archive(tmp_path, capsys):
    sft = run(["loss=sft", "sample_during_eval=false"], tmp_path / "sft")
    archive = sft / "LATEST" / "policy.pt"
    run_dir = run(["loss=reward", f"model.archive={archive}", "n_examples=8", "do_first_eval=false"], tmp_path / "rm")
    state = torch.load(run_dir / "LATEST" / "policy.pt", weights_only=False)["state"]
    sft_state = torch.load(archive, weights_only=False)["state"]
    # The body came from the archive: one AdamW step at lr 1.5e-3 (warmup) moves each weight by at
    # most ~1.5e-3, while SFT's six steps moved it further than that from the random start.
    key = "model.layers.0.mlp.up_proj.weight"
    config = compose_config([*TINY])
    start = models.load_model(config.model, models.load_tokenizer(config.model), torch.float32, config.seed).state_dict()[key]
    assert (state[key] - sft_state[key]).abs().max() < 2e-3
    assert (sft_state[key] - start).abs().max() > 5e-3
    assert "score.weight" in state and "lm_head.weight" not in state


def test_reward_loss_refuses_tensor_parallel():
    config = compose_config(["loss=reward", "trainer=TensorParallelTrainer"])
    with pytest.raises(utils.ConfigError, match="loss=reward trains with BasicTrainer or FSDPTrainer"):
        checks.validate_config(config)


# ----------------------------------------------------------------------------- the online loop


def save_tiny_reward_model(folder: Path) -> str:
    """A random one-label Llama scorer with the tiny model's byte-level tokenizer, saved as a folder."""
    from transformers import ByT5Tokenizer

    tokenizer = ByT5Tokenizer()
    model = tiny_reward_model(tokenizer.pad_token_id)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


ONLINE = ["online.enabled=true", "online.max_new_tokens=8", "online.n_log_completions=3", "loss.beta=0.1"]
ONLINE += ["reward_model.name_or_path=org/reward-model"]  # a hub id that is never loaded: tests set trainer.scorer


def build_online_trainer(tmp_path: Path, overrides: list[str], scorer=None) -> trainers.BasicTrainer:
    """Online DPO's trainer (online.OnlineDPOTrainer) built as train.main builds it, without running it."""
    from data.prompts import load_prompt_examples

    config = compose_config([*TINY, f"output_root={tmp_path}", *ONLINE, *overrides])
    OmegaConf.resolve(config)
    checks.validate_config(config)
    tokenizer = models.load_tokenizer(config.model)
    options = OmegaConf.to_container(config.data)
    tr = load_prompt_examples(list(config.datasets), "train", options, silent=True)
    ev = load_prompt_examples(list(config.datasets), "test", options, silent=True)
    policy = models.load_model(config.model, tokenizer, torch.float32, config.seed)
    reference = models.load_model(config.model, tokenizer, torch.float32, config.seed)
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    trainer = trainers.trainer_class(config)(policy, config, str(tmp_path / "run"), tokenizer, tr, ev, reference)
    trainer.scorer = scorer
    return trainer


class LengthScorer:
    """Scores a completion by its length in characters, so ties are common and checkable."""

    def score(self, prompts, completions):
        return torch.tensor([float(len(c)) for c in completions])


@pytest.mark.parametrize("ties", ["skip", "random"])
def test_online_pairs_put_the_higher_score_first_and_count_ties(tmp_path, ties):
    trainer = build_online_trainer(tmp_path, [f"online.ties={ties}", "online.temperature=2.0"], LengthScorer())
    batch = next(iter(trainers.get_batch_iterator(trainer.train_examples, trainer.tokenizer, 8, 64, 32, seed=0, n_examples=8)))
    pairs, metrics = trainer.online_pairs(batch)
    tok = trainer.tokenizer
    for i in range(8):
        prompt_len = len(pairs["prompt_input_ids"][i][pairs["prompt_attention_mask"][i].bool()])
        texts = []
        for side in ("chosen", "rejected"):
            ids = pairs[f"{side}_input_ids"][i][pairs[f"{side}_attention_mask"][i].bool()]
            labels = pairs[f"{side}_labels"][i][pairs[f"{side}_attention_mask"][i].bool()]
            assert (labels[:prompt_len] == losses.IGNORE_INDEX).all() and (labels[prompt_len:] == ids[prompt_len:]).all()
            # Statistics cover completion tokens only: what generate padded after EOS is cut off,
            # so an EOS, if any, is the last labelled token (TRL once summed KL over that padding).
            response = ids[prompt_len:].tolist()
            eos = tok.eos_token_id
            assert eos not in response[:-1]
            texts.append(tok.decode(ids[prompt_len:], skip_special_tokens=True))
        chosen_score, rejected_score = float(pairs["chosen_scores"][i]), float(pairs["rejected_scores"][i])
        assert (chosen_score, rejected_score) == (float(len(texts[0])), float(len(texts[1])))
        tie = chosen_score == rejected_score
        assert chosen_score >= rejected_score
        assert metrics["online/ties"][i] == float(tie)
        assert float(pairs["weight"][i]) == (0.0 if tie and ties == "skip" else 1.0)
    assert len(metrics["objective/scores"]) == 16 and len(metrics["val/contain_eos_token"]) == 16


def test_unlabelled_pairs_weigh_nothing_in_the_loss(tmp_path):
    # The loss over pairs weighted [1, 0] is the loss of the first pair alone (n_batch_examples = 1).
    trainer = build_online_trainer(tmp_path, [])
    from data.loading import load_examples

    examples = load_examples(["arithmetic"], "train", {"arithmetic": {"n_train": 8, "n_test": 4}}, False, silent=True)
    batch = next(iter(trainers.get_batch_iterator(examples, trainer.tokenizer, 2, 64, 32, seed=0, n_examples=2)))
    first = trainers.split_batch(batch, 2)[0]
    with torch.no_grad():
        alone, _ = trainer.get_batch_metrics(first, 1, 1.0, "train")
        weighted, metrics = trainer.get_batch_metrics({**batch, "weight": torch.tensor([1.0, 0.0])}, 1, 1.0, "train")
    torch.testing.assert_close(weighted, alone)
    assert len(metrics["rewards/accuracies"]) == 1  # only the labelled pair is in the metrics


def test_sampling_a_left_padded_prompt_continues_it_as_alone_on_gpt2(tmp_path):
    gpt2 = ["~model.config", "+model.config={model_type:gpt2,n_embd:32,n_layer:2,n_head:2,n_positions:128}"]
    trainer = build_online_trainer(tmp_path, [*gpt2, "online.top_k=1", "model.block_name=GPT2Block"])  # top_k=1: greedy
    from preference_datasets import collate, tokenize_prompt

    elements = [tokenize_prompt(p, trainer.tokenizer, 32, "keep_start") for p in ["1+1=", "123456+654321="]]
    both = collate(elements, trainer.tokenizer.pad_token_id)
    alone = collate(elements[:1], trainer.tokenizer.pad_token_id)
    _, _, padded_out = trainer.sample_completions(both, 1)
    _, _, alone_out = trainer.sample_completions(alone, 1)
    assert padded_out[0, : alone_out.shape[1]].tolist() == alone_out[0].tolist()


def test_online_run_logs_trl_metrics_kl_zero_at_step_zero_and_writes_completions(tmp_path):
    rm = save_tiny_reward_model(tmp_path / "rm")
    run_dir = run([*ONLINE, f"reward_model.name_or_path={rm}", "n_examples=16", "eval_every=8"], tmp_path / "out")
    rows = records(run_dir)
    train_rows = [r for r in rows if "objective/kl" in r]
    names = ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward", "objective/scores"]
    names += ["objective/scores_margin", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"]
    names += ["val/contain_eos_token", "beta", "online/ties", "online/failed_judgements"]
    for name in names:
        assert name in train_rows[0], name
    # Step 0: the policy is the reference, so KL and the non-score reward are exactly 0 and the
    # RLHF reward equals the score.
    first = train_rows[0]
    assert first["objective/kl"] == 0.0 and first["objective/non_score_reward"] == 0.0
    assert first["objective/rlhf_reward"] == pytest.approx(first["objective/scores"])
    assert first["objective/entropy"] > 0 and first["beta"] == 0.1
    evals = [r for r in rows if "eval/scores" in r]
    assert len(evals) == 3  # at 0, 8 and 16 examples
    table = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in table] == [0] * 3 + [8] * 3 + [16] * 3
    assert [r["prompt"] for r in table[:3]] == [r["prompt"] for r in table[3:6]]  # a fixed set of eval prompts
    assert (run_dir / "completions.html").exists()


def test_prompt_only_datasets_are_for_online_dpo():
    with pytest.raises(utils.ConfigError, match="has prompts only; use it for online DPO"):
        checks.validate_config(compose_config(["datasets=[tldr]"]))
    checks.validate_config(compose_config(["datasets=[tldr]", *ONLINE]))  # accepted online


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss=sft"], "online.enabled=true trains with loss=dpo or loss=ipo"),
        (["precompute_ref_log_probs=true"], "precompute_ref_log_probs=true cannot apply"),
        (["online.ties=first"], "online.ties must be skip or random"),
        (["online.max_new_tokens=40"], "must be at most max_length"),
        (["online.temperature=0"], "online.temperature must be > 0"),
        (["online.n_log_completions=2.5"], r"online.n_log_completions must be a whole number >= 0 \(eval prompts .*got 2.5\.$"),
        (["online.n_log_completions=-1"], r"online.n_log_completions must be a whole number >= 0 .*got -1\.$"),
    ],
)
def test_online_mistakes_are_one_sentence(overrides, message):
    with pytest.raises(utils.ConfigError, match=message):
        online = [o for o in ONLINE if not o.startswith("loss.")]  # loss=sft has no beta
        checks.validate_config(compose_config([*TINY, *online, *overrides]))


class ConstantScorer:
    def score(self, prompts, completions):
        return torch.zeros(len(completions))


def test_a_step_where_every_pair_ties_changes_nothing_and_logs_no_nan(tmp_path):
    trainer = build_online_trainer(tmp_path, ["online.ties=skip", "weight_decay=0"], ConstantScorer())
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    batch = next(iter(trainers.get_batch_iterator(trainer.train_examples, trainer.tokenizer, 8, 64, 32, seed=0, n_examples=8)))
    metrics = trainer.train_step(batch)
    assert metrics["online/ties"] == [1.0] * 8 and metrics["online/labelled_pairs"] == [0.0] * 8
    assert metrics["loss/train"] == []  # no labelled pair: nothing to average
    for name, value in trainer.policy.state_dict().items():
        assert torch.equal(value, before[name]), name
    pending = dict(metrics)
    trainer.log_train(pending, 8, 100, 1.0, type("Bar", (), {"set_postfix": lambda self, x: None})())
    logged = records(Path(trainer.run_dir))[-1]
    assert "loss/train" not in logged and all(not (isinstance(v, float) and math.isnan(v)) for v in logged.values())


class LocalChatServer:
    """A chat-completions endpoint on 127.0.0.1 (``url``, ending in /v1), served on a thread by a
    ``BaseHTTPRequestHandler`` class; ``close()`` stops it."""

    def serve(self, handler) -> None:
        import threading
        from http.server import ThreadingHTTPServer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class LongerIsBetterJudgeServer(LocalChatServer):
    """A local chat-completions endpoint (127.0.0.1) that prefers the longer response; with
    ``broken`` it answers malformed JSON."""

    def __init__(self, broken: bool = False):
        from http.server import BaseHTTPRequestHandler

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = body["messages"][0]["content"]
                first = text.split("<<<A>>>")[1].split("<<<B>>>")[0]
                second = text.split("<<<B>>>")[1].split("<<<END>>>")[0]
                answer = "0" if len(first) >= len(second) else "1"
                payload = {"choices": [{"message": {"role": "assistant", "content": answer}}]}
                data = b'{"choices": [' if broken else json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.serve(Handler)


@pytest.mark.parametrize("broken", [False, True])
def test_online_pairs_labelled_by_an_http_judge(tmp_path, broken):
    server = LongerIsBetterJudgeServer(broken)
    try:
        template = "'Q {prompt} <<<A>>>{response0}<<<B>>>{response1}<<<END>>> answer 0 or 1'"
        overrides = ["online.scorer=http_judge", f"judge.base_url={server.url}", "judge.model=m", f"judge.template={template}"]
        overrides += ["judge.max_retries=0", "judge.timeout=5", "online.temperature=2.0"]
        trainer = build_online_trainer(tmp_path, overrides)
        trainer.scorer = rewards.build_scorer(trainer.config, device="cpu")
        batch = next(
            iter(trainers.get_batch_iterator(trainer.train_examples, trainer.tokenizer, 8, 64, 32, seed=0, n_examples=8))
        )
        pairs, metrics = trainer.online_pairs(batch)
    finally:
        server.close()
    if broken:  # every judgement failed: counted, and no pair is trained on
        assert metrics["online/failed_judgements"] == [1.0] * 8 and pairs["weight"].tolist() == [0.0] * 8
        return
    assert metrics["online/failed_judgements"] == [0.0] * 8 and pairs["weight"].tolist() == [1.0] * 8
    lengths = pairs["chosen_attention_mask"].sum(1), pairs["rejected_attention_mask"].sum(1)
    # Byte-level tokens: a longer completion in characters is at least as long in tokens here
    # (the judge saw decoded text; the order was shuffled and mapped back).
    texts = [
        trainer.tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
        for ids, m in zip(pairs["chosen_input_ids"], pairs["chosen_attention_mask"])
    ]
    rejected = [
        trainer.tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
        for ids, m in zip(pairs["rejected_input_ids"], pairs["rejected_attention_mask"])
    ]
    assert all(len(c) >= len(r) for c, r in zip(texts, rejected)), (lengths, texts, rejected)
    assert "objective/scores" not in metrics  # a judge gives preferences, not scores


def test_beta_schedule_in_the_trainer_follows_the_integer_epoch(tmp_path):
    # TRL crashed when its epoch counter was a float or None before training; here the epoch is
    # examples seen // train prompts, an integer from step 0 on.
    trainer = build_online_trainer(tmp_path, ["loss.beta=[0.5,0.2]"], LengthScorer())
    n = len(trainer.train_examples)
    got = []
    for seen in (0, n - 1, n, 5 * n):
        trainer.example_counter = seen
        got.append(trainer.beta)
    assert got == [0.5, 0.5, 0.2, 0.2]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["datasets=hh"], "datasets must be a list: write datasets=\\[hh\\]"),
        ([*ONLINE, "reward_model.name_or_path=null"], "needs reward_model.name_or_path"),
        ([*ONLINE, "online.scorer=http_judge"], "needs judge.base_url"),
        (["model=blank_model", "model.name_or_path=shared/models/nope"], "is not a folder"),
    ],
)
def test_user_mistakes_found_by_a_new_user_are_one_sentence(overrides, message):
    # From a first-time user's trial: a string instead of a list was read letter by letter, and a
    # relative path without "./" (or online DPO without a reward model) reached transformers.
    with pytest.raises(utils.ConfigError, match=message):
        checks.validate_config(compose_config(overrides))


def test_a_mistyped_relative_reward_model_folder_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    config = compose_config([*ONLINE, "reward_model.name_or_path=outputs/rm_typo"])
    with pytest.raises(utils.ConfigError, match="is not a folder"):
        checks.validate_config(config)
    assert not checks.looks_local("EleutherAI/pythia-2.8b")  # a hub id stays a hub id


def test_a_missing_reward_model_folder_stops_before_any_run_folder_is_made(tmp_path):
    # A new user's trial left outputs/<run>/ holding only config.yaml after such an error.
    config = compose_config([*TINY, *ONLINE, f"output_root={tmp_path / 'out'}", f"reward_model.name_or_path={tmp_path / 'nope'}"])
    with pytest.raises(utils.ConfigError, match="is not a folder"):
        train.main(config)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ----------------------------------------------------------------------------- a judge that fails (issue 22)


class ScriptedJudgeServer(LocalChatServer):
    """A local chat-completions endpoint whose answer to the n-th request (1-based, counted
    under a lock) is ``answer(n, content)``: a string (the judge's reply) or an int (an HTTP
    error status)."""

    def __init__(self, answer):
        import threading
        from http.server import BaseHTTPRequestHandler

        lock, count = threading.Lock(), [0]

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    count[0] += 1
                    n = count[0]
                reply = answer(n, body["messages"][0]["content"])
                if isinstance(reply, int):
                    self.send_response(reply)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.count = count
        self.serve(Handler)


def http_judge(server) -> list[str]:
    """Online DPO labelled by ``server``, asked once per pair (no retry)."""
    return ["online.scorer=http_judge", f"judge.base_url={server.url}", "judge.model=m", "judge.max_retries=0", "judge.timeout=5"]


@pytest.mark.parametrize(
    "answer, why, trainer",
    [
        (500, "HTTP 500 from http://127.0.0.1", []),
        ("maybe", "the judge answered 'maybe'", []),
        ("{checkpoint} {x}", "the judge answered '{checkpoint} {x}'", []),  # braces in the reason: was a KeyError
        ("maybe", "the judge answered 'maybe'", ["trainer=FSDPTrainer", "world_size=2"]),  # every rank stops, one line
    ],
)
def test_a_judge_that_always_fails_stops_with_one_sentence_and_keeps_the_checkpoint(tmp_path, answer, why, trainer):
    # Before: 0 pairs labelled, "Done", exit 0 and FINISHED. Steps of 8 pairs, an eval every 8
    # examples: the eval at 8 sees 8 judgements, all failed, keeps step-8 and stops.
    from test_checkpoint_faults import CLI_TINY, cli, one_error_line

    server = ScriptedJudgeServer(lambda n, content: answer)
    try:
        result = cli([*CLI_TINY, *ONLINE, *http_judge(server), "n_examples=24", "eval_every=8", *trainer], tmp_path)
    finally:
        server.close()
    assert result.returncode == 1, (result.stdout + result.stderr)[-3000:]
    run_dir = next((tmp_path / "out").iterdir())
    error = one_error_line(result)
    expected = "Error: Training stopped: no pair could be labelled since the last eval (all 8 judgements failed; e.g. "
    assert error.startswith(expected + why), error
    assert f"the checkpoint {run_dir / 'step-8'} is kept" in error and f"resume={run_dir}" in error
    assert (
        "[judge] after 8 examples: 8 of 8 judgements failed since the last eval (100%; online.max_failure_rate=0.1)"
        in result.stdout
    )
    assert "Done" not in result.stdout and not (run_dir / checkpoints.FINISHED).exists()
    assert (run_dir / "LATEST").resolve().name == "step-8" and (run_dir / "LATEST" / "policy.pt").exists()
    assert server.count[0] == 8  # nothing was judged after the stop


@pytest.mark.parametrize("every, overrides, stops", [(8, ["online.max_failure_rate=0.25"], False), (4, [], True)])
def test_a_judge_failing_a_share_stops_only_above_max_failure_rate(tmp_path, capsys, every, overrides, stops):
    # Every `every`-th request fails; an eval every 16 examples sees 16 judgements: 16 / 8 = 2
    # failed (12.5% <= 0.25: trains on) or 16 / 4 = 4 failed (25% > the default 0.1: stops at 16).
    server = ScriptedJudgeServer(lambda n, content: "nope" if n % every == 0 else "0")
    config = compose_config([*TINY, *ONLINE, *http_judge(server), *overrides, "n_examples=32", "eval_every=16"])
    config.output_root = str(tmp_path)
    try:
        if stops:
            with pytest.raises(online.JudgeFailureError) as stopped:
                train.main(config)
        else:
            run_dir = Path(train.main(config)[0])
    finally:
        server.close()
    out = capsys.readouterr().out
    failed = 16 // every
    share = f"{failed / 16:.0%}"
    rate = 0.25 if overrides else 0.1
    assert (
        f"[judge] after 16 examples: {failed} of 16 judgements failed since the last eval ({share}; online.max_failure_rate={rate})"
        in out
    )
    if stops:
        assert str(stopped.value).startswith(
            "Training stopped: 4 of 16 judgements since the last eval failed (25% > online.max_failure_rate=0.1; e.g. the judge answered 'nope'"
        )
        run_dir = next(tmp_path.iterdir())
        assert (run_dir / "LATEST").resolve().name == "step-16" and not (run_dir / checkpoints.FINISHED).exists()
        return
    assert "[judge] after 32 examples: 2 of 16 judgements failed since the last eval (12%; online.max_failure_rate=0.25)" in out
    assert (run_dir / checkpoints.FINISHED).exists() and server.count[0] == 32


def test_a_nan_reward_fails_the_judgement_instead_of_a_tie():
    completions = torch.tensor([[5, 1]] * 4)
    mask = sampling.completion_mask(completions, 1)
    scorer = FixedScorer({"a": float("nan"), "b": 1.0, "c": 2.0, "d": 2.0})
    preferences, _ = online.label_pairs(scorer, ["p", "q"], list("abcd"), completions, mask, 1, None)
    assert preferences == [None, rewards.TIE]


def test_max_failure_rate_is_a_share():
    with pytest.raises(utils.ConfigError, match=r"online.max_failure_rate must be in \[0, 1\], got 1.5"):
        checks.validate_config(compose_config([*TINY, *ONLINE, "online.max_failure_rate=1.5"]))


def test_a_causal_lm_as_reward_model_is_one_sentence_exit_2_and_no_run_folder(tmp_path):
    # Before: a warning that its score head is random, then online DPO trained against random scores.
    from test_checkpoint_faults import CLI_TINY, cli, one_error_line

    stories = needs_shared("models", "stories260K")
    result = cli([*CLI_TINY, *ONLINE[:-1], f"reward_model.name_or_path={stories}"], tmp_path)
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    assert one_error_line(result) == (
        f"Error: reward_model.name_or_path={stories} has no trained score head (its config.json names LlamaForCausalLM), "
        "so its scores would be random: give a reward model (e.g. the LATEST/hf of a loss=reward run), "
        "or set reward_model.allow_untrained_head=true to use it anyway."
    )
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ----------------------------------------------------------------------------- exact resume with the HTTP judge (issue 22)


def plain(value) -> bool:
    """True if ``value`` holds only plain types (what ``torch.load(weights_only=True)`` reads back)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


@pytest.mark.parametrize("ranks", [1, 2])
def test_kill_9_then_resume_with_the_http_judge_matches_an_uninterrupted_run(tmp_path, ranks):
    # The judge favours the response shown first and fails one request in eight by a hash of what
    # it was shown, so every pair's label and every failure depend on the judge's order-shuffling
    # RNG. The run is killed (SIGKILL) during its third step, after the checkpoint at 16 examples;
    # resumed, the judge must shuffle on from where it was and count on from its failures then.
    # With 2 ranks (FSDPTrainer) each rank's judge labels its 4 pairs of a step and is kept apart.
    import hashlib
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO
    from test_checkpoint_faults import CLI_TINY

    victim = {}

    def answer(n, content):
        if victim.get("pid") and n == 20:  # the 4th request of step 3: step-16 is published
            os.kill(victim.pop("pid"), signal.SIGKILL)
        return "?" if hashlib.sha256(content.encode()).digest()[0] % 8 == 0 else "0"

    full_server, cut_server = ScriptedJudgeServer(answer), ScriptedJudgeServer(answer)
    args = [*CLI_TINY, *ONLINE, "n_examples=48", "eval_every=16", "save_hf_export=false", "online.max_failure_rate=1"]
    args += ["trainer=FSDPTrainer", "world_size=2"] if ranks == 2 else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}

    def train_py(extra: list[str], pid: bool = False) -> subprocess.CompletedProcess:
        proc = subprocess.Popen(
            [sys.executable, "train.py", *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        if pid:
            victim["pid"] = proc.pid
        try:
            out, _ = proc.communicate(timeout=300)
        finally:
            proc.kill()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out)

    try:
        full = train_py([*args, *http_judge(full_server), f"output_root={tmp_path / 'full'}"])
        assert full.returncode == 0, full.stdout[-3000:]
        cut = train_py([*args, *http_judge(cut_server), f"output_root={tmp_path / 'cut'}"], pid=True)
        assert cut.returncode == -signal.SIGKILL, cut.stdout[-3000:]
        cut_dir = next((tmp_path / "cut").iterdir())
        assert (cut_dir / "LATEST").resolve().name == "step-16"
        resumed = train_py([f"resume={cut_dir}", f"judge.base_url={cut_server.url}"])  # an endpoint only when given
        assert resumed.returncode == 0, resumed.stdout[-3000:]
        assert "Resuming after 16 examples" in resumed.stdout
    finally:
        full_server.close()
        cut_server.close()
    full_dir = next((tmp_path / "full").iterdir())
    a = torch.load(full_dir / "LATEST" / "policy.pt", weights_only=True)
    b = torch.load(cut_dir / "LATEST" / "policy.pt", weights_only=True)
    assert a["step_idx"] == b["step_idx"] == 48
    for name in a["state"]:
        assert torch.equal(a["state"][name], b["state"][name]), name
    state_a = torch.load(full_dir / "LATEST" / "trainer_state.pt", weights_only=False)["online"]
    state_b = torch.load(cut_dir / "LATEST" / "trainer_state.pt", weights_only=False)["online"]
    judges_a, judges_b = ([rank["judge"] for rank in state["ranks"]] for state in (state_a, state_b))
    assert plain(judges_a) and judges_a == judges_b
    for rank_a, rank_b in zip(state_a["ranks"], state_b["ranks"]):
        assert torch.equal(rank_a["torch_rng"], rank_b["torch_rng"])
    # 48 pairs were judged in all, 48 / ranks by each rank's judge, one shuffle draw each (seeded with seed=0).
    rng = random.Random(0)
    for _ in range(48 // ranks):
        rng.random()
    assert len(judges_a) == ranks and all(judge["rng"] == rng.getstate() for judge in judges_a)
    # The failures are those metrics.jsonl logged: each train record is one step's 8 pairs.
    steps = [r for r in metric_records(full_dir) if "online/failed_judgements" in r]
    assert len(steps) == 6
    failures = sum(judge["failures"] for judge in judges_a)
    assert 0 < failures == round(sum(8 * r["online/failed_judgements"] for r in steps)) < 48


@pytest.mark.parametrize("inner", ["", "LATEST", "nothing"])
def test_a_reward_model_run_folder_is_one_sentence_naming_its_export(tmp_path, inner):
    # Regression (issue 24): reward_model.name_or_path=<a loss=reward run folder> was a Hydra
    # traceback ("Unrecognized model ... model_type") after the data had loaded.
    run = tmp_path / "rm_run"
    (run / "step-8" / "hf").mkdir(parents=True)
    (run / "step-8" / "hf" / "config.json").write_text("{}")
    (run / "LATEST").symlink_to("step-8")
    given = {"": run, "LATEST": run / "LATEST", "nothing": tmp_path}[inner]
    config = compose_config([*TINY, *ONLINE, "online.scorer=reward_model", f"reward_model.name_or_path={given}"])
    with pytest.raises(utils.ConfigError) as error:
        checks.validate_config(config)
    if inner == "nothing":
        assert str(error.value).endswith(
            "holds no config.json, so it is not a Hugging Face model folder; give one (e.g. a loss=reward run's LATEST/hf)."
        )
    else:
        export = run / "LATEST" / "hf"
        assert str(error.value) == (
            f"reward_model.name_or_path={given} is a run folder or checkpoint of train.py, not a model folder; give its export, "
            f"reward_model.name_or_path={export}."
        )
