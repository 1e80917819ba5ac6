"""Every scorer reads a completion as the text it adds to its prompt (issue 34): online DPO's pairs and evals,
evaluate.py, make_pairs.py and the trainer's answers_eval hand a reward function the same string for the same
prompt and completion ids, with the leading space a SentencePiece tokenizer (stories260K, Llama) drops when the
completion is decoded alone.

Each path is called where it builds the scorer's text, under a stand-in policy whose ``generate`` appends fixed ids.
"""

from __future__ import annotations

import pytest
import torch
from conftest import needs_shared
from omegaconf import OmegaConf

import trainers
from evaluation import cache, evaluate, in_training, judging, rewards, sampling
from online import make_pairs
from online import trainer as online

PROMPT = "Once upon a time there was a little"
# what " girl named Lily." adds after PROMPT: '▁g', 'ir', 'l', '▁named', '▁Lily', '.', then EOS
TEXT = " girl named Lily."


class FixedPolicy(torch.nn.Module):
    """A policy whose ``generate`` appends ``completion`` to every prompt (``num_return_sequences`` rows each)."""

    def __init__(self, completion: list[int]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.completion = torch.tensor(completion)

    def generate(self, input_ids, attention_mask, generation_config=None, num_return_sequences=1, **_):
        n = num_return_sequences if generation_config is None else generation_config.num_return_sequences or 1
        ids = input_ids.repeat_interleave(n, 0)
        return torch.cat([ids, self.completion.expand(ids.shape[0], -1).to(ids)], 1)


class OneProcess(trainers.Dist):
    is_main = False  # writes no run-folder files


class Trainer(online.OnlineSampling):
    """The trainer attributes online DPO's sampling and answers_eval read, on one process."""

    rank = batch_counter = 0
    dist = OneProcess()
    device = "cpu"

    generate_kwargs: dict = {}


@pytest.fixture
def tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(needs_shared("models", "stories260K"))
    tok.pad_token = tok.eos_token
    return tok


def recording_scorer(seen: list):
    """A reward-function scorer that keeps every completion it is given (score: 1 when it starts with a space)."""

    def first_is_space(prompts, completions, **_):
        seen.extend(completions)
        return [float(c[:1] == " ") for c in completions]

    return rewards.RewardFunctionScorer(["first_is_space"], [first_is_space], [1.0])


def test_completion_text_is_what_the_ids_add_to_the_prompt_and_a_split_byte_character_stays_whole(tokenizer):
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    completion = tokenizer(PROMPT + TEXT, add_special_tokens=False)["input_ids"][len(prompt) :]
    assert tokenizer.decode(completion) == "girl named Lily."  # alone: the space is lost
    assert sampling.completion_text(tokenizer, prompt, completion + [2], [2]) == TEXT
    # byte fallback: "你" is <0xE4><0xBD><0xA0>; a prompt ending in its first byte decodes to "a \ufffd", not a prefix of "a 你"
    ids = tokenizer("a 你", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["▁a", "▁", "<0xE4>", "<0xBD>", "<0xA0>"]
    assert sampling.completion_text(tokenizer, ids[:3], ids[3:]) == "你"
    assert sampling.completion_text(tokenizer, ids[:1], ids[1:]) == " 你"


def test_online_dpo_evaluate_make_pairs_and_answers_eval_hand_a_reward_function_the_same_text(tokenizer, tmp_path):
    eos = tokenizer.eos_token_id
    config = OmegaConf.create(
        {
            "seed": 0,
            "k": 1,
            "temperature": 1.0,
            "temperatures": [1.0],
            "top_k": None,
            "top_p": 1.0,
            "max_new_tokens": 8,
            "max_prompt_length": 16,
            "max_length": 32,
            "eval_batch_size": 4,
            "generate_batch_size": 4,
            "online": {
                "temperature": 1.0,
                "top_k": None,
                "top_p": 1.0,
                "max_new_tokens": 8,
                "ties": "skip",
                "missing_eos_penalty": None,
                "n_log_completions": 0,
            },
        }
    )
    item = {
        "id": "p0",
        "index": 0,
        "dataset": "json",
        "prompt": PROMPT,
        "judge_prompt": PROMPT,
        "truncation_mode": "keep_end",
        "conversation": False,
        "chosen": TEXT,
        "fields": {},
    }
    [prompt_ids] = sampling.prompt_ids([item], tokenizer, config)  # BOS, then the prompt: every path's prompt ids
    completion = tokenizer(PROMPT + TEXT, add_special_tokens=False)["input_ids"][len(prompt_ids) - 1 :] + [eos]
    policy = FixedPolicy(completion)
    seen: dict[str, list] = {}

    # online DPO: a step's pairs (two completions of the prompt) and an eval
    trainer = Trainer()
    trainer.config, trainer.tokenizer, trainer.policy, trainer.stop_ids = config, tokenizer, policy, [eos]
    trainer.scorer = recording_scorer(seen.setdefault("online", []))
    batch = {
        "prompt": [PROMPT],
        "prompt_input_ids": torch.tensor([prompt_ids]),
        "prompt_attention_mask": torch.ones(1, len(prompt_ids), dtype=torch.long),
    }
    trainer.online_pairs(batch)
    trainer.eval_batches = [batch]
    assert trainer.evaluate_online()["eval/scores"] == 1.0

    # answers_eval: the trainer's greedy answers to the eval prompts
    answer_functions = [("first_is_space", recording_scorer(seen.setdefault("answers_eval", [])))]
    assert in_training.score_answers(trainer, answer_functions)["answers_eval/first_is_space"] == 1.0

    # make_pairs.py: k completions per prompt, scored
    make_pairs._generate_and_score(config, recording_scorer(seen.setdefault("make_pairs", [])), policy, tokenizer, [eos], [item])

    # evaluate.py: the policy's samples, as rows, scored by judge=reward_function
    source = sampling.Source("stand-in", "hf", None, None, 0, fingerprint="stand-in")
    load = lambda *_: (policy, tokenizer)  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampling, "load_source", load)
        a = evaluate.sample_all(source, "a", [[item]], config, cache.Cache(str(tmp_path), "samples"), "cpu", False)
    rows = evaluate._rows(config, [[item]], a, a, {})
    judge = judging.Judge.__new__(judging.Judge)
    judge.kind, judge.cache, judge.errors = "reward_function", cache.Cache(str(tmp_path), "scores"), []
    judge._built = {"None": recording_scorer(seen.setdefault("evaluate", []))}
    judge.judge_all(rows)

    assert seen == {"online": [TEXT] * 3, "answers_eval": [TEXT], "make_pairs": [TEXT], "evaluate": [TEXT]}
