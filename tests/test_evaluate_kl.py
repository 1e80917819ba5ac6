"""evaluate.py's reward and KL beside the win rates: the KL estimate against the exact KL of a model
small enough to enumerate every completion, the t interval by hand, and end to end on tiny runs.

The exact KL(A || ref) = sum_y pA(y) (log pA(y) - log pref(y)) is summed here over every completion
y of at most 2 tokens (ending at EOS or at the length limit), with each y's log-probability from a
plain full-logits forward (``torch.log_softmax``), independent of ``modeling.forward.response_logps``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import needs_shared, run_train
from omegaconf import OmegaConf
from test_evaluate import FAST, eval_config, results, rm_args, run_eval, verdicts
from test_online import save_tiny_reward_model

from evaluation import evaluate, report, rewards, sampling, statistics
from utils import ConfigError

# ----------------------------------------------------------------------------- the t interval by hand


def test_mean_interval_is_the_student_t_interval_by_hand():
    # [1, 2, 3, 4]: mean 2.5, sd = sqrt(5/3) (n-1), t(0.975, 3) = 3.182446 (the t table), half = t * sd / 2.
    half = 3.182446305284263 * math.sqrt(5 / 3) / 2  # = 2.054
    mean, low, high = statistics.mean_interval([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5 and low == pytest.approx(2.5 - half, abs=1e-9) and high == pytest.approx(2.5 + half, abs=1e-9)
    assert low == pytest.approx(0.44573, abs=1e-5)
    assert statistics.mean_interval([0.0, 0.0, 0.0]) == (0.0, 0.0, 0.0)  # no spread: the interval is the point
    assert statistics.mean_interval([3.0]) == (3.0, None, None)  # one sample: no interval
    assert statistics.mean_interval([]) == (None, None, None)


# ----------------------------------------------------------------------------- the exact KL of an enumerable model


VOCAB = 12
PROMPT = [5, 7, 3]
EOS = 1


def tiny_lm(seed: int, sharpness: float = 1.0):
    """A random 1-layer Llama over a 12-token vocabulary in float64, its output layer scaled by
    ``sharpness`` (far from uniform, so that two seeds are far apart)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        bos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


class DigitTokenizer:
    """What ``sampling.generate_batch`` asks of a tokenizer: pad id 0, EOS 1; token k decodes to chr(ord('a') + k)."""

    pad_token_id = 0
    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + int(i)) for i in ids if not (skip_special_tokens and int(i) in (0, 1)))


def exact_completion_logps(model) -> dict[tuple[int, ...], float]:
    """log p(y | PROMPT) of every completion y of at most 2 tokens (stopping at EOS), from full logits."""
    with torch.no_grad():
        first = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1], -1)
        rows = torch.tensor([PROMPT + [y] for y in range(VOCAB)])
        second = torch.log_softmax(model(rows).logits[:, -1], -1)
    table = {}
    for y1 in range(VOCAB):
        if y1 == EOS:
            table[(y1,)] = float(first[y1])
            continue
        for y2 in range(VOCAB):
            table[(y1, y2)] = float(first[y1] + second[y1, y2])
    return table


@pytest.fixture(scope="module")
def enumerated():
    policy, reference = tiny_lm(0, sharpness=8.0), tiny_lm(1, sharpness=8.0)
    log_a, log_ref = exact_completion_logps(policy), exact_completion_logps(reference)
    assert math.fsum(math.exp(v) for v in log_a.values()) == pytest.approx(1.0, abs=1e-12)  # every completion is there
    exact = math.fsum(math.exp(log_a[y]) * (log_a[y] - log_ref[y]) for y in log_a)
    return policy, reference, log_a, log_ref, exact


def sample(policy, n: int, temperature: float, seed: int = 0, **settings) -> list[list[int]]:
    config = OmegaConf.create({"top_k": 0, "top_p": 1.0, "max_new_tokens": 2, **settings})
    got = sampling.generate_batch(policy, DigitTokenizer(), [EOS], [PROMPT] * n, temperature, config, seed)
    return [s["tokens"] for s in got]


def log_ratios(policy, reference, completions: list[list[int]]) -> list[float]:
    prompts = [PROMPT] * len(completions)
    return (
        evaluate.completion_logps(policy, prompts, completions) - evaluate.completion_logps(reference, prompts, completions)
    ).tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_each_samples_log_ratio_is_the_enumerated_one_of_the_models_at_temperature_1(enumerated, temperature):
    policy, reference, log_a, log_ref, _ = enumerated
    completions = sample(policy, 300, temperature)
    assert any(len(c) == 1 for c in completions) and any(len(c) == 2 for c in completions)  # both kinds of ending occur
    for y, ratio in zip(completions, log_ratios(policy, reference, completions)):
        assert ratio == pytest.approx(log_a[tuple(y)] - log_ref[tuple(y)], abs=1e-10), y


def test_the_monte_carlo_kl_at_temperature_1_covers_the_exact_kl(enumerated):
    policy, reference, _, _, exact = enumerated
    assert exact > 0.5  # two seeds this sharp are far apart
    ratios = log_ratios(policy, reference, sample(policy, 4000, 1.0))
    mean, low, high = statistics.mean_interval(ratios)
    assert low <= exact <= high
    assert mean == pytest.approx(exact, rel=0.05)


def test_a_policy_that_is_its_reference_has_kl_0_exactly(enumerated):
    policy = enumerated[0]
    completions = sample(policy, 50, 1.0)
    assert log_ratios(policy, policy, completions) == [0.0] * 50


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """As test_evaluate's: an SFT run, a DPO run from it (model.archive) and a tiny reward model folder."""
    root = tmp_path_factory.mktemp("runs")
    sft = run_train(["loss=sft", "sample_during_eval=false", "exp_name=sft"], root)
    dpo = run_train(["loss=dpo", "sample_during_eval=false", "exp_name=dpo", f"model.archive={sft}/LATEST/policy.pt"], root)
    return {"sft": sft, "dpo": dpo, "rm": save_tiny_reward_model(root / "rm"), "root": root}


def a_samples(out: Path) -> dict:
    """A's cached samples by (prompt id, temperature)."""
    records = [json.loads(line) for line in (out / "samples-rank0.jsonl").read_text().splitlines()]
    return {(r["id"], r["temperature"]): r for r in records if r["side"] == "A"}


def full_logp(model, prompt: list[int], completion: list[int]) -> float:
    """log p(completion | prompt) from one unpadded forward's full logits."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].double()
    logps = torch.log_softmax(logits, -1)
    return math.fsum(float(logps[len(prompt) - 1 + i, tok]) for i, tok in enumerate(completion))


def test_reward_and_kl_end_to_end_against_independent_scores_and_log_probs(runs, capsys):
    out = run_eval([f"policy={runs['dpo']}", *rm_args(runs), "baseline=reference"])
    printed = capsys.readouterr().out
    assert "| loss rate | n | failed | baseline reward [95%] | reward [95%] | KL [95%] |" in printed
    assert "KL against reference (" in printed
    got = results(out)
    assert got["reference"] == f"reference ({runs['sft']}/LATEST/policy.pt)" and got["kl_of"] == statistics.KL_OF
    rows, samples = verdicts(out), a_samples(out)
    config = eval_config([*FAST, f"policy={runs['dpo']}"])
    policy = sampling.resolve_source(runs["dpo"], config)
    a_model, tokenizer = sampling.load_source(policy, "cpu")
    ref_model, _ = sampling.load_source(sampling.reference_source(policy), "cpu")
    items = {it["id"]: it for it in sampling.load_items(config, silent=True)}
    scorer = rewards.RewardModelScorer(runs["rm"])
    for t in ("0", "1"):
        mine = [r for r in rows if r["temperature"] == float(t)]
        kls = []
        for r in mine:
            prompt = sampling.prompt_ids([items[r["id"]]], tokenizer, config)[0]
            tokens = samples[(r["id"], float(t))]["tokens"]
            assert len(tokens) == r["a_tokens"]
            want = full_logp(a_model, prompt, tokens) - full_logp(ref_model, prompt, tokens)
            assert r["kl"] == pytest.approx(want, abs=1e-4)
            kls.append(want)
        scores = scorer.score([r["judge_prompt"] for r in mine], [r["a"] for r in mine]).tolist()
        stats = got["temperatures"][t]
        assert stats["reward_mean"] == pytest.approx(sum(scores) / len(scores), abs=1e-5) and stats["reward_n"] == 6
        assert (stats["reward_ci_low"], stats["reward_ci_high"]) == pytest.approx(statistics.mean_interval(scores)[1:], abs=1e-5)
        baseline = scorer.score([r["judge_prompt"] for r in mine], [r["b"] for r in mine]).tolist()  # the reference's
        assert stats["baseline_reward_mean"] == pytest.approx(sum(baseline) / 6, abs=1e-5) and stats["baseline_reward_n"] == 6
        assert stats["loss_rate"] == sum(r["verdict"] == "loss" for r in mine) / stats["n"]
        row = f"| {t} | {stats['win_rate']:.3f} | [{stats['ci_low']:.3f}, {stats['ci_high']:.3f}] | {stats['tie_rate']:.3f} | "
        assert row + f"{stats['loss_rate']:.3f} | {stats['n']} | 0 | {stats['baseline_reward_mean']:.3f} [" in printed
        assert stats["kl_mean"] == pytest.approx(sum(kls) / len(kls), abs=1e-4) and stats["kl_n"] == 6
        assert stats["kl_ci_low"] < stats["kl_mean"] < stats["kl_ci_high"]
    assert (out / "reward_kl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_reference_that_is_the_policy_gives_kl_0_and_a_pairwise_judge_no_reward(runs):
    out = run_eval([f"policy={runs['dpo']}", f"reference={runs['dpo']}", *rm_args(runs), "judge=reward_model_judge"])
    assert all(r["kl"] == 0.0 for r in verdicts(out))
    for stats in results(out)["temperatures"].values():
        assert (stats["kl_mean"], stats["kl_ci_low"], stats["kl_ci_high"], stats["kl_n"]) == (0.0, 0.0, 0.0, 6)
        assert (stats["reward_mean"], stats["reward_ci_low"], stats["reward_ci_high"], stats["reward_n"]) == (None, None, None, 0)
        assert (stats["baseline_reward_mean"], stats["baseline_reward_n"]) == (None, 0)


def test_resume_computes_no_log_prob_again_and_an_old_cache_without_tokens_is_resampled(runs, monkeypatch):
    out = run_eval([f"policy={runs['dpo']}", *rm_args(runs)])
    before = results(out)
    calls = {"n": 0}
    original = evaluate.completion_logps

    def counted(*args):
        calls["n"] += 1
        return original(*args)

    monkeypatch.setattr(evaluate, "completion_logps", counted)
    evaluate.main(eval_config([f"resume={out}"]))
    assert calls["n"] == 0 and results(out) == before  # every log-prob came from logps-rank0.jsonl
    # An evaluation written before the token ids were kept: its samples have none, and no log-probs.
    path = out / "samples-rank0.jsonl"
    old = [{k: v for k, v in json.loads(line).items() if k != "tokens"} for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    (out / "logps-rank0.jsonl").unlink()
    evaluate.main(eval_config([f"resume={out}"]))
    assert results(out) == before  # the same seeds sampled the same tokens again
    assert calls["n"] == 2 * 2 * 3  # policy and reference, 2 temperatures, 3 batches


def test_no_reference_for_a_folder_outside_a_run_is_null_and_said(runs, tmp_path, capsys):
    outside = shutil.copytree(runs["dpo"] / "LATEST" / "hf", tmp_path / "my_model")
    out = run_eval([f"policy={outside}", *rm_args(runs), f"output_root={tmp_path / 'out'}"])
    assert (
        "kl_mean is null: my_model is not a run folder or checkpoint of train.py (whose start is the reference); give reference=<folder or hub id>"
        in capsys.readouterr().out
    )
    got = results(out)
    assert got["reference"] is None and all(r["kl"] is None for r in verdicts(out))
    assert all(
        s["kl_mean"] is None and s["kl_ci_low"] is None and s["reward_mean"] is not None for s in got["temperatures"].values()
    )
    # With reference= the same folder is measured against it.
    again = run_eval([f"policy={outside}", *rm_args(runs), f"output_root={tmp_path / 'out'}", f"reference={runs['sft']}"])
    assert results(again)["reference"] == runs["sft"].name and all(r["kl"] is not None for r in verdicts(again))


def test_a_reference_with_another_vocabulary_is_one_sentence_before_sampling(runs, monkeypatch):
    other = needs_shared("models", "stories260K")
    monkeypatch.setattr(sampling, "generate_batch", lambda *a, **k: pytest.fail("sampled before the check"))
    with pytest.raises(
        ConfigError, match=r"^reference=stories260K has another vocabulary than the policy dpo.*; give a reference"
    ):
        run_eval([f"policy={runs['dpo']}", f"reference={other}", *rm_args(runs)])
    with pytest.raises(ConfigError, match=r"^reference=/nonexistent/model does not exist"):
        run_eval([f"policy={runs['dpo']}", "reference=/nonexistent/model", *rm_args(runs)])


def test_the_plot_has_a_point_per_policy_and_temperature(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    point = {"reward_mean": 1.0, "reward_ci_low": 0.5, "reward_ci_high": 1.5, "kl_mean": 2.0, "kl_ci_low": 1.0, "kl_ci_high": 3.0}
    series = [
        {"label": "dpo", "temperatures": {"0.5": point, "1": {**point, "kl_mean": 2.5}}},
        {"label": "sft", "temperatures": {"1": {**point, "kl_mean": None}}},  # no reference: no point
    ]
    drawn = {}
    original = plt.Axes.annotate
    monkey = pytest.MonkeyPatch()
    monkey.setattr(
        plt.Axes, "annotate", lambda self, text, xy, **kw: (drawn.setdefault(text, xy), original(self, text, xy, **kw))[1]
    )
    try:
        report.plot_reward_kl(series, str(tmp_path / "reward_kl.png"), "reward_model")
    finally:
        monkey.undo()
    assert drawn == {"T=0.5": (2.0, 1.0), "T=1": (2.5, 1.0)}
    assert (tmp_path / "reward_kl.png").stat().st_size > 0
