"""Every option acts (issue 37, part 3) on online DPO: each ``online.*`` key of config/config.yaml, changed to a second
value generated from its default (or the one :data:`ONLINE_NEEDS` gives, with its reason), changes a step's sampled
pairs, their labels, its loss or its gradient on a fixed tiny setup; the keys that act at an eval leave the step alone
and change what the eval does. Every ``loss.*`` key of each objective online DPO trains acts on its labelled pairs, or
is refused in one sentence. Keys come from the config and the objectives' declarations: a new one fails here until it
acts (or is given an entry)."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import pytest
import torch
from conftest import TINY, compose_config
from omegaconf import OmegaConf
from option_cells import TRAINER_KEYS, base_config, candidates, changed, one_sentence, second_value
from test_online import save_tiny_reward_model

import losses
import trainers
import utils
from data.prompts import load_prompt_examples
from modeling import models
from online import trainer as online
from runs import checks

B = 4  # prompts a step samples for (two completions each)
BY_LENGTH = ("online.scorer=reward_function", "reward_functions=[length]")  # a completion's score: its length


@dataclasses.dataclass(frozen=True)
class OnlineNeed:
    """How an ``online.*`` key shows its effect, and why."""

    reason: str
    level: str = "step"  # step: sampled pairs, labels, loss or gradient; completions: the labels of FIXED; eval; path
    value: object = None  # the second value, where the generated one cannot show the effect
    companion: tuple[str, ...] = ()  # overrides set in both configs


# The one table of online keys whose effect needs another level than a sampled step, a value or a companion.
ONLINE_NEEDS = {
    "enabled": OnlineNeed("it picks online DPO's trainer, the path every other key here runs on", level="path"),
    "scorer": OnlineNeed(
        "reward_model_judge asks the same reward model pairwise (the same labels, by design) and http_judge a server",
        level="completions", value="reward_function", companion=("reward_functions=[length]",),
    ),
    "missing_eos_penalty": OnlineNeed(
        "it lowers the scores of completions without EOS (its default, null, names no type)",
        level="completions", value=3.0, companion=BY_LENGTH,
    ),
    "top_k": OnlineNeed(
        "the generated 0.25 passes runs/checks.py and then fails in generate (no rule checks online.top_k yet)", value=1
    ),
    "top_p": OnlineNeed(
        "the generated 2.0 passes runs/checks.py and filters nothing, as 1.0 (no rule checks online.top_p yet)", value=0.5
    ),
    "ties": OnlineNeed("it weighs pairs whose scores tie", level="completions", companion=BY_LENGTH),
    "n_log_completions": OnlineNeed("it caps the eval's completions table; the eval set has 4 prompts", level="eval", value=2),
    "max_failure_rate": OnlineNeed("it decides at an eval whether the failed judgements stop the run", level="eval"),
}  # fmt: skip

# FIXED's completions, pair i = rows 2i and 2i + 1 (ByT5: a byte's id is the byte + 3, EOS 1, padding 0): lengths 2 and
# 4 without EOS (a penalty of 3 makes the first win), 2 and 2 (a tie), 1 and 3, 4 without EOS and 2.
FIXED_TEXTS = [
    ("12", True),
    ("1234", False),
    ("56", True),
    ("78", True),
    ("9", True),
    ("123", True),
    ("4567", False),
    ("89", True),
]


def fixed_completions() -> torch.Tensor:
    """:data:`FIXED_TEXTS` as (2B, 4) ids."""
    rows = [[b + 3 for b in text.encode()] + [1] * eos for text, eos in FIXED_TEXTS]
    return torch.tensor([row + [0] * (4 - len(row)) for row in rows])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The online config (a tiny reward model's folder scores), tokenizer, prompts, models and a batch of B prompts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("online-options")
    rm = save_tiny_reward_model(tmp / "rm")
    overrides = [*TINY, f"output_root={tmp}", "online.enabled=true", "online.max_new_tokens=8", f"reward_model.name_or_path={rm}"]
    config = compose_config([*overrides, f"batch_size={B}", f"eval_batch_size={B}", f"n_eval_examples={B}", "warmup_steps=0"])
    config = OmegaConf.create(OmegaConf.to_container(config, resolve=True))  # not struct: a loss brings its own keys
    tokenizer = models.load_tokenizer(config.model)
    options = OmegaConf.to_container(config.data)
    train, test = (load_prompt_examples(list(config.datasets), s, options, silent=True) for s in ("train", "test"))
    policy = models.load_model(config.model, tokenizer, torch.float32, 0)
    reference = models.load_model(config.model, tokenizer, torch.float32, 1)
    batch = next(trainers.get_batch_iterator(train, tokenizer, B, config.max_length, config.max_prompt_length, n_epochs=1))
    models_ = dict(tokenizer=tokenizer, policy=policy, reference=reference)
    yield dict(config=config, train=train, test=test, tmp=tmp, batch=batch, steps={}, **models_)  # steps: by loss config
    torch.set_num_threads(threads)


def configured(setup: dict, overrides: list[str], loss: dict | None = None):
    """The online config with ``overrides`` (and ``loss``), or the one sentence runs/checks.py refuses it with."""
    config = OmegaConf.merge(setup["config"], OmegaConf.from_dotlist(overrides))
    if loss is not None:
        config.loss = loss
    try:
        checks.validate_config(config)
    except utils.ConfigError as e:
        return str(e)
    return config


def build(setup: dict, config, scorer=None) -> trainers.BasicTrainer:
    """The trainer ``config`` names, built as train.py builds it (its scorer from the config, or ``scorer``)."""
    cls = trainers.trainer_class(config)
    made = cls.made_before_models(config) if scorer is None else {"scorer": scorer}
    run_dir = setup["tmp"] / f"run-{len(list(setup['tmp'].glob('run-*')))}"  # its own: an eval writes its completions
    run_dir.mkdir()
    args = (setup["policy"], config, str(run_dir), setup["tokenizer"], setup["train"], setup["test"], setup["reference"])
    return cls(*args, **made)


def step(trainer: trainers.BasicTrainer, batch: dict, fixed: bool = False) -> tuple[torch.Tensor, ...]:
    """One ``train_step`` on ``batch``'s prompts, sampled with seed 0 (``fixed``: :func:`fixed_completions` instead), no
    weight moved: (the chosen and rejected ids, the pairs' weights, their chosen and rejected scores (empty from a judge),
    the losses, the gradient the optimizer would apply)."""
    seen = {}
    label = trainer.online_pairs

    def fixed_sample(prompts: dict, n: int):  # the left-padded prompts trimmed as sample_completions trims them
        width = int(prompts["prompt_attention_mask"].sum(1).max())
        return prompts["prompt_input_ids"][:, -width:], prompts["prompt_attention_mask"][:, -width:], fixed_completions()

    def recorded(prompts: dict):
        seen["pairs"], metrics = label(prompts)
        return seen["pairs"], metrics

    if fixed:
        trainer.sample_completions = fixed_sample
    trainer.online_pairs = recorded
    trainer.optimizer.step = lambda: seen.setdefault("grad", torch.cat([p.grad.flatten() for p in trainer.policy.parameters()]))
    trainer.scheduler = types.SimpleNamespace(step=lambda: None)
    torch.manual_seed(0)
    metrics = trainer.train_step(batch)
    pairs = seen["pairs"]
    scores = [pairs.get(f"{side}_scores", torch.zeros(0)) for side in ("chosen", "rejected")]
    ids = (pairs["chosen_input_ids"], pairs["rejected_input_ids"], pairs["weight"])
    return *ids, *scores, torch.tensor(metrics["loss/train"]), seen["grad"]


# ----------------------------------------------------------------------------- the online keys


def online_keys() -> list[str]:
    """Every key of config/config.yaml's ``online`` section."""
    return list(compose_config([]).online)


def rule_choices(key: str) -> list:
    """The strings runs/checks.py's rule for ``online.<key>`` accepts (a tuple of strings in its check), else none."""
    for name, *rule in checks.RULES:
        code = getattr(rule[0], "__code__", None)
        if name == f"online.{key}" and code is not None:
            found = [c for c in code.co_consts if isinstance(c, tuple) and c and all(isinstance(s, str) for s in c)]
            if found:
                return list(found[0])
    return []


def online_second_value(setup: dict, key: str) -> tuple[list[str], list[str]]:
    """(the overrides with ``key`` at its default, the same with its second value): :data:`ONLINE_NEEDS`'s value, else the
    first generated candidate runs/checks.py accepts; fails naming the key when there is none."""
    need = ONLINE_NEEDS.get(key, OnlineNeed(""))
    default = setup["config"].online[key]
    before = [*need.companion, f"online.{key}={json.dumps(default)}"]
    values = [need.value] if need.value is not None else candidates(default, rule_choices(key))
    for value in values:
        after = [*need.companion, f"online.{key}={json.dumps(value)}"]
        if value != default and not isinstance(configured(setup, after), str):
            return before, after
    pytest.fail(f"online.{key}: no second valid value (default {default!r}) could be generated")


def test_every_online_key_is_generated_and_every_need_names_one():
    keys = online_keys()
    assert set(ONLINE_NEEDS) <= set(keys), set(ONLINE_NEEDS) - set(keys)  # no stale entry
    assert {need.level for need in ONLINE_NEEDS.values()} <= {"step", "completions", "eval", "path"}


SAMPLED = [k for k in online_keys() if ONLINE_NEEDS.get(k, OnlineNeed("")).level in ("step", "completions")]


@pytest.mark.parametrize("key", SAMPLED)
def test_each_online_key_changes_the_pairs_their_labels_the_loss_or_the_gradient(setup, key):
    fixed = ONLINE_NEEDS.get(key, OnlineNeed("")).level == "completions"
    numbers = [
        step(build(setup, configured(setup, overrides)), setup["batch"], fixed) for overrides in online_second_value(setup, key)
    ]
    assert changed(*numbers), f"online.{key} changes neither the pairs, their labels, the loss nor the gradient"


def rows_logged(trainer) -> int:
    """The completions table's rows after one eval."""
    trainer.evaluate_online()
    return len((Path(trainer.run_dir) / "completions.jsonl").read_text().splitlines())


def stops(trainer) -> bool:
    """Whether an eval after 2 of 10 judgements failed stops the run."""
    trainer.judged_since_eval, trainer.failed_since_eval = 10, 2
    return trainer.judge_report() is not None


EVAL_EFFECTS = {"n_log_completions": rows_logged, "max_failure_rate": stops}  # what each eval-level key changes


@pytest.mark.parametrize("key", [k for k in online_keys() if ONLINE_NEEDS.get(k, OnlineNeed("")).level == "eval"])
def test_each_eval_key_leaves_the_step_alone_and_changes_the_eval(setup, key):
    assert key in EVAL_EFFECTS, f"online.{key} acts at an eval: give EVAL_EFFECTS what it changes"
    trainers_ = [build(setup, configured(setup, overrides)) for overrides in online_second_value(setup, key)]
    a, b = (step(t, setup["batch"]) for t in trainers_)
    assert not changed(a, b), f"online.{key} changes the step"
    assert EVAL_EFFECTS[key](trainers_[0]) != EVAL_EFFECTS[key](trainers_[1]), f"online.{key} does not change the eval"


SCORER_SETTINGS = {  # what each scorer needs besides online.scorer (the HTTP judge's port is closed: never asked here)
    "reward_model": (),
    "reward_model_judge": (),
    "reward_function": ("reward_functions=[length]",),
    "http_judge": ("judge.base_url=http://127.0.0.1:9/v1", "judge.model=m", "judge.max_retries=0"),
}


@pytest.mark.parametrize("scorer", checks.SCORERS)
def test_missing_eos_penalty_changes_the_scores_with_each_scorer_or_is_refused(setup, scorer):
    # A pairwise judge gives no scores to lower: it must refuse the penalty, not ignore it.
    assert set(SCORER_SETTINGS) == set(checks.SCORERS)
    overrides = [f"online.scorer={scorer}", *SCORER_SETTINGS[scorer]]
    configs = [configured(setup, [*overrides, f"online.missing_eos_penalty={value}"]) for value in ("null", "3.0")]
    assert not isinstance(configs[0], str), configs[0]
    if isinstance(configs[1], str):
        assert one_sentence(configs[1]) and configs[1].startswith("online.missing_eos_penalty"), configs[1]
        return
    a, b = (step(build(setup, config), setup["batch"], fixed=True) for config in configs)
    assert changed(a, b), f"online.missing_eos_penalty changes nothing with online.scorer={scorer}"


def test_online_enabled_picks_online_dpos_trainer(setup):
    off = configured(setup, ["online.enabled=false", "datasets=[arithmetic]"])
    assert trainers.trainer_class(off) is trainers.BasicTrainer
    assert trainers.trainer_class(setup["config"]) is online.OnlineDPOTrainer


# ----------------------------------------------------------------------------- the loss keys on online DPO's pairs

ONLINE_LOSS_KEYS = [(n, k) for n, k in TRAINER_KEYS if checks.online_capable(losses.OBJECTIVES[n])]


@pytest.mark.parametrize("name,key", ONLINE_LOSS_KEYS, ids=[f"{n}.{k}" for n, k in ONLINE_LOSS_KEYS])
def test_each_loss_key_acts_on_online_dpos_pairs_or_is_refused(setup, name, key):
    scorer = types.SimpleNamespace(score=lambda prompts, texts, **_: torch.tensor([float(len(t)) for t in texts]))
    numbers = []
    for loss in (base_config(name, key), second_value(name, key)):
        config = configured(setup, [], loss)
        if isinstance(config, str):
            assert one_sentence(config), config
            return
        known = setup["steps"].get(repr(loss))  # an objective's defaults recur for each of its keys
        numbers.append(known or step(build(setup, config, scorer), setup["batch"], fixed=True))
        setup["steps"].setdefault(repr(loss), numbers[-1])
    assert changed(*numbers), f"loss.{key} of loss={name} does not act on online DPO's pairs"
