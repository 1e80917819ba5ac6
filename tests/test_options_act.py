"""Every option acts (issue 37, part 3): each ``loss.*`` key every registered objective declares, changed to a second
valid value generated from its declaration, changes the loss or the gradient, at the objective level
(``Objective.compute`` on fixed random inputs) and on the one-process trainer's padded, packed and chunked forwards;
the settings that must not change the numbers (packing, the output layer's chunking, ``max_forward_chunks``, gradient
accumulation) change neither; ``reference_update`` moves the reference; the paths that cannot honour a key refuse it.

A new objective or key is covered without a new line here: the keys come from ``decl.keys_for``, their second values
from :func:`second_value`, which fails naming a key whose alternatives it cannot generate."""

from __future__ import annotations

import copy
import dataclasses
import types
from pathlib import Path

import pytest
import torch
from conftest import TINY, compose_config
from omegaconf import OmegaConf

import losses
import objectives  # noqa: F401  (registers every objective)
import preference_datasets
import trainers
import utils
from data import chat
from data.loading import load_examples
from evaluation.equivalence import MICRO_BATCH_COUPLED
from evaluation.equivalence import NOT_TRAINED as OBJECTIVE_ONLY  # objectives the tiny trainer cannot build inputs for
from modeling import models
from runs import checks

REPO = Path(__file__).resolve().parents[1]
B = 4  # pairs of the objective-level inputs and of the trainer's batch
SAME = {"rtol": 1e-4, "atol": 1e-5}  # fp32: two paths computing the same numbers in another order agree this closely
CHUNK = 3  # positions per output-layer call on the chunked path (the tiny batch's rows are 17-18 long)


@dataclasses.dataclass(frozen=True)
class Need:
    """What a key needs to show its effect, and why."""

    reason: str
    companion: dict = dataclasses.field(default_factory=dict)  # other loss keys set in both configs (default and changed)
    level: str = "objective"  # objective: compute shows it; trainer: only the forward does; data: only the data does


# The one table of keys whose effect needs a particular batch, a companion setting or another level than compute's
# (objective "*": that key of every objective that declares it).
NEEDS = {
    ("f_dpo", "f_alpha_divergence_coef"): Need(
        "alpha enters f' only in the alpha-divergence", {"f_divergence_type": "alpha_divergence"}
    ),
    ("*", "average_log_prob"): Need("the forward averages the log-probs; compute sees them as given", level="trainer"),
    ("ld_dpo", "ld_alpha"): Need(
        "the forward weighs tokens past the pair's shorter response (pairs of different lengths: the tiny batch's)",
        level="trainer",
    ),
    ("sft", "all_assistant_turns"): Need("it picks the labels when a multi-turn conversation is rendered", level="data"),
}


# ----------------------------------------------------------------------------- configs from the declarations


def default_loss(name: str) -> dict:
    """config/loss/<name>.yaml as a dict (the objective's default loss config); ``{"name": name}`` without one."""
    path = REPO / "config" / "loss" / f"{name}.yaml"
    return OmegaConf.to_container(OmegaConf.load(path)) if path.exists() else {"name": name}


def declared_keys() -> list[tuple[str, str]]:
    """Every (objective, key) of ``decl.keys_for`` its default loss config, sorted."""
    return sorted((name, key) for name, decl in losses.OBJECTIVES.items() for key in decl.keys_for(default_loss(name)))


def with_value(name: str, key: str, value) -> dict | None:
    """The default loss config of ``name`` with its companions and ``key=value`` (the keys the new value leaves the
    objective without dropped), or None when ``losses.validate_loss_config`` refuses it."""
    base = {**default_loss(name), **need(name, key).companion, key: value}
    try:
        keys = losses.get_objective(name).keys_for(base)
        config = {k: v for k, v in base.items() if k == "name" or k in keys}
        losses.validate_loss_config(config)
    except (losses.ObjectiveConfigError, TypeError, ValueError):
        return None
    return config


def _choices(spec: losses.Key) -> list:
    """The values a choice key accepts: its rule's "one of a, b, c", else a tuple of strings its check names."""
    if spec.rule.startswith("one of "):
        return [v.strip() for v in spec.rule.removeprefix("one of ").split(",")]
    code = getattr(spec.valid, "__code__", None)
    names = code.co_names + code.co_freevars if code else ()
    found = [getattr(spec.valid, "__globals__", {}).get(n) for n in names]
    return next((list(v) for v in found if isinstance(v, (tuple, list)) and v and all(isinstance(s, str) for s in v)), [])


def _candidates(spec: losses.Key, default) -> list:
    """Second values to try, nearest first, by the default's type."""
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, (int, float)):
        return [default * 2, default / 2, default + 0.25, default + 1, 0.25, 0.5, 1.0, 2.0]
    if isinstance(default, str):
        return _choices(spec)
    if isinstance(default, list) and default and all(isinstance(v, (int, float)) for v in default):
        return [[v * 2 for v in default], [v + 1 for v in default]]
    if isinstance(default, list) and default and all(isinstance(v, str) for v in default):
        # another objective's name in its place, from the alphabet's end: aot's sorted margins can equal DPO's on 4 pairs
        return [[n] for n in sorted(losses.OBJECTIVES, reverse=True)]
    return []


def second_value(name: str, key: str) -> dict:
    """The loss config of ``name`` with ``key`` changed to the first candidate the declaration accepts; fails the test
    naming the key when there is none (a new key is never skipped)."""
    spec = losses.get_objective(name).keys_for(default_loss(name))[key]
    default = default_loss(name).get(key, spec.default)
    for value in _candidates(spec, default):
        config = with_value(name, key, value)
        if value != default and config is not None:
            return config
    pytest.fail(f"loss={name}: no second valid value for loss.{key} (default {default!r}) could be generated")


def base_config(name: str, key: str) -> dict:
    """The default loss config of ``name`` with the companions ``key`` needs."""
    config = with_value(
        name, key, default_loss(name).get(key, losses.get_objective(name).keys_for(default_loss(name))[key].default)
    )
    assert config is not None, f"loss={name}: the default config with {key}'s companions is refused"
    return config


def need(name: str, key: str) -> Need:
    """The :data:`NEEDS` entry of ``key`` of ``name`` (its own, else every objective's), else none."""
    return NEEDS.get((name, key)) or NEEDS.get(("*", key)) or Need("")


def level(name: str, key: str) -> str:
    return need(name, key).level


# ----------------------------------------------------------------------------- the objective level


def random_inputs() -> losses.ObjectiveInputs:
    """Fixed random inputs for B pairs, every field filled; the policy's log-probs require grad."""
    g = torch.Generator().manual_seed(0)

    def logps(scale: float = 3.0) -> torch.Tensor:
        return -(torch.rand(B, generator=g) * scale + 0.5)

    n_chosen, n_rejected = torch.tensor([3.0, 5.0, 2.0, 7.0]), torch.tensor([4.0, 2.0, 6.0, 7.0])
    chosen, rejected = logps().requires_grad_(), logps().requires_grad_()
    scores = torch.randn(2, B, generator=g).requires_grad_()
    return losses.ObjectiveInputs(
        policy_chosen_logps=chosen,
        policy_rejected_logps=rejected,
        reference_chosen_logps=logps(),
        reference_rejected_logps=logps(),
        chosen_n_tokens=n_chosen,
        rejected_n_tokens=n_rejected,
        policy_chosen_nll=-chosen / n_chosen,
        chosen_scores=scores[0],
        rejected_scores=scores[1],
        policy_kl_logps=logps(),
        reference_kl_logps=logps(),
        policy_chosen_statistic=logps(0.5),
        policy_rejected_statistic=logps(0.5),
    )


def objective_numbers(loss_config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed loss, d loss / d the policy's chosen and rejected log-probs and scores) of ``loss_config``."""
    inputs = random_inputs()
    decl = losses.get_objective(loss_config["name"])
    loss = decl.compute(inputs, loss_config).losses.sum()
    leaves = [inputs.policy_chosen_logps, inputs.policy_rejected_logps, inputs.chosen_scores]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return loss.detach(), torch.cat([torch.zeros(B) if g is None else g for g in grads])


def changed(a: tuple, b: tuple) -> bool:
    """True if the losses or the gradients of ``a`` and ``b`` differ beyond fp32 rounding."""
    return any(not torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b))


OBJECTIVE_KEYS = [pair for pair in declared_keys() if level(*pair) == "objective"]


@pytest.mark.parametrize("name,key", OBJECTIVE_KEYS, ids=[f"{n}.{k}" for n, k in OBJECTIVE_KEYS])
def test_each_key_changes_the_objective_loss_or_its_gradient(name, key):
    before, after = base_config(name, key), second_value(name, key)
    assert changed(objective_numbers(before), objective_numbers(after)), f"loss.{key} of loss={name}: {before} vs {after}"


def test_a_key_without_a_generated_second_value_fails_naming_it(monkeypatch):
    odd = dataclasses.replace(losses.OBJECTIVES["dpo"], name="odd", keys={"table": losses.Key({"a": 1})})
    monkeypatch.setitem(losses.OBJECTIVES, "odd", odd)
    with pytest.raises(pytest.fail.Exception, match=r"loss=odd: no second valid value for loss\.table"):
        second_value("odd", "table")


def test_every_key_of_every_objective_is_covered_at_some_level():
    levels = {level(*pair) for pair in declared_keys()}
    assert levels <= {"objective", "trainer", "data"}
    assert set(OBJECTIVE_ONLY) <= set(losses.OBJECTIVES)
    declared = set(declared_keys())
    for name, key in NEEDS:  # no stale entry
        assert (name, key) in declared or (name == "*" and any(k == key for _, k in declared)), (name, key)


# ----------------------------------------------------------------------------- the trainer's one-process paths


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny config, tokenizer, examples and models (the reference from another seed, so h != 0), on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("options")
    config = compose_config([*TINY, f"output_root={tmp}", "n_eval_examples=4", f"eval_batch_size={B}", "warmup_steps=0"])
    OmegaConf.resolve(config)
    tokenizer = models.load_tokenizer(config.model)
    options = OmegaConf.to_container(config.data)
    train, test = (load_examples(list(config.datasets), s, options, False, silent=True) for s in ("train", "test"))
    policy = models.load_model(config.model, tokenizer, torch.float32, 0)
    reference = models.load_model(config.model, tokenizer, torch.float32, 1)
    yield dict(config=config, tokenizer=tokenizer, train=train, test=test, policy=policy, reference=reference, tmp=tmp, cache={})
    torch.set_num_threads(threads)


def build(tiny: dict, loss_config: dict, path: str = "packed", config=None, weights=None, **settings) -> trainers.BasicTrainer:
    """A BasicTrainer on the tiny models (or ``weights``, (policy, reference)) with ``loss_config`` on ``path`` (padded,
    packed or chunked), from the tiny config (or ``config``) with ``settings`` (config keys, e.g.
    gradient_accumulation_steps)."""
    policy, reference = weights or (tiny["policy"], tiny["reference"])
    config = OmegaConf.create(OmegaConf.to_container(config or tiny["config"]))
    config.loss = loss_config
    config.output_layer_chunk = CHUNK if path == "chunked" else 0
    for key, value in settings.items():
        OmegaConf.update(config, key, value)
    uses_reference = losses.get_objective(loss_config["name"]).uses_reference(loss_config)
    run_dir = tiny["tmp"] / "run"
    run_dir.mkdir(exist_ok=True)
    args = (policy, config, str(run_dir), tiny["tokenizer"], tiny["train"], tiny["test"])
    trainer = trainers.BasicTrainer(*args, reference if uses_reference else None)
    trainer.packed = path != "padded"
    return trainer


def trainer_numbers(trainer: trainers.BasicTrainer, batch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the micro-batch's loss, the policy's gradient, flattened) of one ``get_batch_metrics`` on the eval batch."""
    batch = batch or trainer.eval_batches[0]
    trainer.policy.zero_grad(set_to_none=True)
    loss, _ = trainer.get_batch_metrics(batch, len(batch["prompt"]), 1.0, "train")
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in trainer.policy.parameters() if p.grad is not None])
    trainer.policy.zero_grad(set_to_none=True)
    return loss.detach(), grad


def cached_numbers(tiny: dict, loss_config: dict, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`trainer_numbers` of ``loss_config`` on ``path``, computed once per module (the defaults recur per key)."""
    key = (repr(sorted(loss_config.items())), path)
    if key not in tiny["cache"]:
        tiny["cache"][key] = trainer_numbers(build(tiny, loss_config, path))
    return tiny["cache"][key]


PATHS = ("padded", "packed", "chunked")
TRAINER_KEYS = [(n, k) for n, k in declared_keys() if n not in OBJECTIVE_ONLY and level(n, k) != "data"]


@pytest.mark.parametrize("name,key", TRAINER_KEYS, ids=[f"{n}.{k}" for n, k in TRAINER_KEYS])
def test_each_key_changes_the_loss_or_the_gradient_on_each_trainer_path(tiny, name, key):
    before, after = base_config(name, key), second_value(name, key)
    for path in PATHS:
        a, b = cached_numbers(tiny, before, path), trainer_numbers(build(tiny, after, path))
        assert changed(a, b), f"loss.{key} of loss={name} does not act on the {path} forward: {before} vs {after}"


TRAINED = sorted(n for n in losses.OBJECTIVES if n not in OBJECTIVE_ONLY and not losses.OBJECTIVES[n].sft_data)


@pytest.mark.parametrize("name", TRAINED)
def test_packing_and_chunking_change_neither_loss_nor_gradient(tiny, name):
    config = default_loss(name)
    padded = trainer_numbers(build(tiny, config, "padded"))
    for path in ("packed", "chunked"):
        for a, b in zip(padded, trainer_numbers(build(tiny, config, path))):
            torch.testing.assert_close(b, a, **SAME, msg=f"loss={name}: padded vs {path}")
    packed = build(tiny, config, "packed")
    for max_chunks in (1, 2):
        packed.max_forward_chunks = max_chunks
        for a, b in zip(padded, trainer_numbers(packed)):
            torch.testing.assert_close(b, a, **SAME, msg=f"loss={name}: max_forward_chunks={max_chunks}")


def step_numbers(trainer: trainers.BasicTrainer, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(the step's per-example losses, the gradient the optimizer would apply) of one ``train_step`` on ``batch``."""
    seen = []
    trainer.optimizer.step = lambda: seen.append(torch.cat([p.grad.flatten() for p in trainer.policy.parameters()]))
    trainer.scheduler = types.SimpleNamespace(step=lambda: None)  # no step taken: the shared models stay as loaded
    metrics = trainer.train_step(batch)
    return torch.tensor(metrics["loss/train"]), seen[0]


@pytest.mark.parametrize("name", [n for n in TRAINED if n not in MICRO_BATCH_COUPLED])
def test_gradient_accumulation_changes_neither_loss_nor_gradient(tiny, name):
    config, batch = default_loss(name), None
    numbers = []
    for steps in (1, 2):
        trainer = build(tiny, config, "packed", gradient_accumulation_steps=steps)
        batch = batch or trainer.eval_batches[0]
        numbers.append(step_numbers(trainer, batch))
    for a, b in zip(*numbers):
        torch.testing.assert_close(b, a, **SAME, msg=f"loss={name}: gradient_accumulation_steps 1 vs 2")


# ----------------------------------------------------------------------------- keys that act in the data


def rendered_sft_batch(tiny: dict, all_assistant_turns: bool) -> dict:
    """Two multi-turn conversations rendered by a chat template with ``all_assistant_turns``, collated for SFT."""
    tokenizer = copy.deepcopy(tiny["tokenizer"])
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )

    def turn(role: str, text: str) -> dict:
        return {"role": role, "content": text}

    rows = [
        {"prompt": [turn("user", q), turn("assistant", a), turn("user", "and 2+2?")], "chosen": [turn("assistant", "4")]}
        for q, a in (("1+1?", "2"), ("3+3?", "6"))
    ]
    rows = [{**row, "truncation_mode": "keep_end", "conversation": True} for row in rows]
    rendered = chat.render_conversations(rows, tokenizer, 64, 32, silent=True, all_assistant_turns=all_assistant_turns)
    fields = ("prompt", "chosen", "rejected", "truncation_mode")
    elements = [
        preference_datasets.tokenize_element(
            *(r.get(f) for f in fields), tokenizer, 64, 32, r.get("end_token_id"), r.get("pieces")
        )
        for r in rendered
    ]
    return preference_datasets.collate(elements, pad_token_id=tokenizer.pad_token_id)


@pytest.mark.parametrize("path", PATHS)
def test_sft_all_assistant_turns_changes_the_labels_and_the_loss_on_each_path(tiny, path):
    numbers = []
    for every in (False, True):
        batch = rendered_sft_batch(tiny, every)
        trainer = build(tiny, {"name": "sft", "all_assistant_turns": every}, path)
        numbers.append((batch["chosen_labels"].ne(losses.IGNORE_INDEX).sum(), *trainer_numbers(trainer, batch)))
    assert numbers[1][0] > numbers[0][0]  # the first assistant turn is trained too
    assert changed(numbers[0][1:], numbers[1][1:]), f"all_assistant_turns does not act on the {path} forward"


# ----------------------------------------------------------------------------- reference_update moves the reference

SOFT = ["reference_update.mode=soft", "reference_update.alpha=0.6", "reference_update.every=1"]
BEMA = ["reference_update=bema", "reference_update.update_freq=1", "reference_update.ref_model_update_freq=1"]
UPDATES = {  # each pair below differs in one reference_update key
    "fixed": [],
    "soft": SOFT,
    "soft alpha": [*SOFT, "reference_update.alpha=0.3"],
    "soft every": [*SOFT, "reference_update.every=2"],
    "hard": ["reference_update.mode=hard", "reference_update.every=1"],
    "bema": BEMA,
    "bema lag": [*BEMA, "reference_update.lag=2"],
    "bema ema_power": [*BEMA, "reference_update.ema_power=1.0"],
}
DIFFER = [
    ("fixed", "soft"),
    ("soft", "soft alpha"),
    ("soft", "soft every"),
    ("soft", "hard"),
    ("fixed", "bema"),
    ("bema", "bema lag"),
    ("bema", "bema ema_power"),
]


@pytest.fixture(scope="module")
def reference_after_two_steps(tiny):
    """Each :data:`UPDATES` setting's reference log-probs of the eval batch after 2 DPO steps from the same weights."""
    out = {}
    for name, overrides in UPDATES.items():
        config = compose_config(
            [*TINY, f"output_root={tiny['tmp']}", "n_eval_examples=4", f"eval_batch_size={B}", "warmup_steps=0", *overrides]
        )
        checks.validate_config(config)
        weights = (copy.deepcopy(tiny["policy"]), copy.deepcopy(tiny["reference"]))  # the steps move them
        trainer = build(tiny, default_loss("dpo"), "packed", config=config, weights=weights)
        batch = trainer.eval_batches[0]
        for _ in range(2):
            trainer.train_step(batch)
        out[name] = torch.cat(trainer.reference_logps(batch))
    return out


@pytest.mark.parametrize("a,b", DIFFER, ids=[f"{a} vs {b}" for a, b in DIFFER])
def test_each_reference_update_key_changes_the_reference_after_two_steps(reference_after_two_steps, a, b):
    logps = reference_after_two_steps
    assert not torch.allclose(logps[a], logps[b], rtol=1e-5, atol=1e-6), f"reference_update: {a} and {b} give one reference"


# ----------------------------------------------------------------------------- the paths that refuse a key

REFUSALS = [  # (overrides, the refusal's sentence or its start): a path that cannot honour a key says so
    (["loss=reward", "trainer=TensorParallelTrainer"],
     "loss=reward trains with BasicTrainer or FSDPTrainer; TensorParallelTrainer splits only causal LMs."),
    (["loss=reward", "trainer=FSDPTrainer", "tensor_parallel_size=2"],
     "loss=reward does not support tensor_parallel_size > 1 (tensor parallelism splits causal LMs); remove it."),
    (["loss=simpo", "precompute_ref_log_probs=true"],
     "loss=simpo uses no reference model, so precompute_ref_log_probs=true has nothing to compute; set it false."),
    (["loss=kto", "precompute_ref_log_probs=true"],
     "loss=kto needs the reference's log-probs of each prompt paired with another example's completion, pairs that "
     "change with every shuffled batch, so precompute_ref_log_probs=true cannot cache them; set it false."),
    ([*SOFT, "launcher=ray", "ray.reference_workers=1"],
     "reference_update moves the reference, which must then live with the policy; set ray.reference_workers=0."),
    (["online.enabled=true", "loss=simpo"],
     "online.enabled=true trains with loss=dpo or loss=ipo or another paired objective with a reference ("),
    (["online.enabled=true", "loss.reference_free=true"],
     "online DPO needs the reference model: set loss.reference_free=false."),
    (["online.enabled=true", "precompute_ref_log_probs=true"],
     "online DPO samples new completions each step, so precompute_ref_log_probs=true cannot apply; set it false."),
    (["online.enabled=true", "online.scorer=reward_function", "trainer=TensorParallelTrainer"],
     "online DPO runs with BasicTrainer or FSDPTrainer."),
    (["model.lora.r=4", *SOFT],
     "reference_update moves the reference, but with model.lora the reference is the frozen base (the policy with its "
     "adapters off), which never moves; set reference_update.mode=null or model.lora.r=null."),
    (["model.lora.r=4", "launcher=ray", "ray.reference_workers=1"],
     "with model.lora the reference is the policy with its adapters off, in each policy worker; set ray.reference_workers=0."),
    (["loss=mix", "loss.losses=[dpo,ld_dpo]", "loss.weights=[1,1]"],
     "loss.losses of loss=mix names 'ld_dpo', which weighs response tokens in its own log-probs, and the mix's "
     "components share one forward; train loss=ld_dpo alone, or mix from "),
    (["loss=mix", "loss.losses=[dpo,wpo]", "loss.weights=[1,1]"],
     "loss.losses of loss=mix names 'wpo', whose inputs come from a forward of its own, and the mix's components share "
     "one forward; train loss=wpo alone, or mix from "),
]  # fmt: skip


@pytest.mark.parametrize("overrides,sentence", REFUSALS, ids=[" ".join(o) for o, _ in REFUSALS])
def test_a_path_that_cannot_honour_a_key_refuses_it_in_one_sentence(overrides, sentence):
    with pytest.raises(utils.ConfigError) as refused:
        checks.validate_config(compose_config([*TINY, *overrides]), 2)
    message = str(refused.value)
    assert message.startswith(sentence) and message.endswith(".") and message.count(". ") == 0, message
