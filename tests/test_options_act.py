"""Every option acts (issue 37, part 3): each ``loss.*`` key every registered objective declares, changed to a second
valid value generated from its declaration, changes the loss or the gradient, at the objective level
(``Objective.compute`` on fixed random inputs) and on the one-process trainer's paths (padded, packed and chunked
forwards, a precomputed reference, LoRA), on pairs and, for an objective that declares them, unpaired rows; a path that
cannot honour a key refuses it in one sentence; the settings that must not change the numbers (packing, the output
layer's chunking, ``max_forward_chunks``, a precomputed reference, gradient accumulation) change neither; each
``reference_update`` key moves the reference. The paths of several processes: tests/test_options_act_distributed.py;
online DPO: tests/test_options_act_online.py.

A new objective or key is covered without a new line here: the keys come from ``decl.keys_for``, their second values
from option_cells.second_value, which fails naming a key whose alternatives it cannot generate."""

from __future__ import annotations

import copy
import dataclasses
import types

import pytest
import torch
from conftest import TINY, compose_config
from omegaconf import OmegaConf
from option_cells import (
    NEEDS,
    OBJECTIVE_KEYS,
    OBJECTIVE_ONLY,
    ONE_PROCESS,
    REPO,
    SAME,
    SETUP,
    TRAINED,
    TRAINER_KEYS,
    UNPAIRED_KEYS,
    B,
    base_config,
    build,
    changed,
    declared_keys,
    default_loss,
    level,
    one_sentence,
    refusal,
    second_value,
    tiny_setup,
    trainer_numbers,
    unpaired_rows,
)

import losses
import preference_datasets
import trainers
import utils
from data import chat
from evaluation.equivalence import micro_batch_coupled
from objectives import bema
from runs import checks

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


def unpaired(inputs: losses.ObjectiveInputs) -> losses.ObjectiveInputs:
    """``inputs`` as B unpaired rows (KTO's): each chosen completion with a label, half of them desirable, no rejected."""
    return dataclasses.replace(
        inputs, policy_rejected_logps=None, reference_rejected_logps=None, label=torch.tensor([True, False, True, False])
    )


def objective_numbers(loss_config: dict, rows=lambda inputs: inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed loss, d loss / d the policy's chosen and rejected log-probs and scores) of ``loss_config`` on
    :func:`random_inputs` (through ``rows``, e.g. :func:`unpaired`)."""
    inputs = rows(random_inputs())
    decl = losses.get_objective(loss_config["name"])
    loss = decl.compute(inputs, loss_config).losses.sum()
    leaves = [inputs.policy_chosen_logps, inputs.policy_rejected_logps, inputs.chosen_scores]
    grads = iter(torch.autograd.grad(loss, [x for x in leaves if x is not None], allow_unused=True))
    grads = [None if x is None else next(grads) for x in leaves]
    return loss.detach(), torch.cat([torch.zeros(B) if g is None else g for g in grads])


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
    """option_cells.tiny_setup's config, tokenizer, examples and models, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_setup(tmp_path_factory.mktemp("options"))
    torch.set_num_threads(threads)


def cached_numbers(tiny: dict, loss_config: dict, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`trainer_numbers` of ``loss_config`` on ``path``, computed once per module (the defaults recur per key)."""
    key = (repr(sorted(loss_config.items())), path)
    if key not in tiny["cache"]:
        tiny["cache"][key] = trainer_numbers(build(tiny, loss_config, path))
    return tiny["cache"][key]


@pytest.mark.parametrize("name,key", TRAINER_KEYS, ids=[f"{n}.{k}" for n, k in TRAINER_KEYS])
def test_each_key_changes_the_loss_or_the_gradient_on_each_trainer_path(tiny, name, key):
    # A path that cannot honour the objective or the key's second value (the precomputed reference of a reference-free
    # one) refuses it in one sentence before anything loads; on every other path the key acts.
    before, after = base_config(name, key), second_value(name, key)
    for path in ONE_PROCESS:
        refused = refusal(tiny["config"], before, path) or refusal(tiny["config"], after, path)
        if refused:
            assert one_sentence(refused), f"loss={name} loss.{key} on the {path} path: {refused}"
            continue
        a, b = cached_numbers(tiny, before, path), trainer_numbers(build(tiny, after, path))
        assert changed(a, b), f"loss.{key} of loss={name} does not act on the {path} path: {before} vs {after}"


@pytest.mark.parametrize("name", TRAINED)
def test_packing_chunking_and_a_precomputed_reference_change_neither_loss_nor_gradient(tiny, name):
    config = default_loss(name)
    padded = trainer_numbers(build(tiny, config, "padded"))
    for path in ("packed", "chunked", "precomputed"):  # the precomputed reference: the live one's numbers, read back
        if path == "precomputed" and refusal(tiny["config"], config, path):  # its sentence: the key test checks it
            continue
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


@pytest.mark.parametrize("name", [n for n in TRAINED if n not in micro_batch_coupled()])
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


@pytest.mark.parametrize("path", ONE_PROCESS)
def test_sft_all_assistant_turns_changes_the_labels_and_the_loss_on_each_path(tiny, path):
    refused = refusal(tiny["config"], {"name": "sft", "all_assistant_turns": True}, path)
    if refused:  # the precomputed reference of an objective without one
        assert one_sentence(refused) and "loss=sft uses no reference" in refused
        return
    numbers = []
    for every in (False, True):
        batch = rendered_sft_batch(tiny, every)
        trainer = build(tiny, {"name": "sft", "all_assistant_turns": every}, path)
        numbers.append((batch["chosen_labels"].ne(losses.IGNORE_INDEX).sum(), *trainer_numbers(trainer, batch)))
    assert numbers[1][0] > numbers[0][0]  # the first assistant turn is trained too
    assert changed(numbers[0][1:], numbers[1][1:]), f"all_assistant_turns does not act on the {path} forward"


# ----------------------------------------------------------------------------- unpaired rows (KTO's)


@pytest.fixture(scope="module")
def unpaired_batch(tiny):
    return unpaired_rows(tiny)


@pytest.mark.parametrize("name,key", UNPAIRED_KEYS, ids=[f"{n}.{k}" for n, k in UNPAIRED_KEYS])
def test_each_key_acts_on_unpaired_rows_at_the_objective_level_and_on_each_path(tiny, unpaired_batch, name, key):
    before, after = base_config(name, key), second_value(name, key)
    assert changed(objective_numbers(before, unpaired), objective_numbers(after, unpaired)), f"loss={name} loss.{key}"
    for path in ONE_PROCESS:
        refused = refusal(tiny["config"], before, path) or refusal(tiny["config"], after, path)
        if refused:  # a precomputed reference cannot hold KTO's mismatched pairs
            assert one_sentence(refused), f"loss={name} loss.{key} on the {path} path: {refused}"
            continue
        a, b = (trainer_numbers(build(tiny, config, path), unpaired_batch) for config in (before, after))
        assert changed(a, b), f"loss.{key} of loss={name} does not act on unpaired rows on the {path} path"


# ----------------------------------------------------------------------------- reference_update moves the reference

SOFT = ["reference_update.mode=soft", "reference_update.alpha=0.6", "reference_update.every=1"]
# BEMA updates its average every step and copies it into the reference at step 2 alone, so that each of its keys, one
# unit more (a whole number + 1, a real + 1.0), acts within 2 steps: ref_model_update_after=1 copies at step 1 instead,
# ref_model_update_freq=3 never, update_after=1 restarts theta_0 at step 1, min_ema_multiplier=1 makes the EMA the policy.
BEMA = ["reference_update=bema", "reference_update.update_freq=1", "reference_update.ref_model_update_freq=2"]


def bema_settings() -> dict[str, list[str]]:
    """``"bema <key>"``: :data:`BEMA` with that key one unit more, for every key of config/reference_update/bema.yaml."""
    config = OmegaConf.merge(
        {"reference_update": OmegaConf.load(REPO / "config" / "reference_update" / "bema.yaml")},
        OmegaConf.from_dotlist([o for o in BEMA if "." in o]),
    ).reference_update
    keys = [key for key in config if key != "mode"]
    assert set(keys) == set(bema.KEYS + bema.POWERS), "config/reference_update/bema.yaml and objectives/bema.py name other keys"
    return {f"bema {key}": [*BEMA, f"reference_update.{key}={config[key] + 1}"] for key in keys}


UPDATES = {  # each pair below differs in one reference_update key
    "fixed": [],
    "soft": SOFT,
    "soft alpha": [*SOFT, "reference_update.alpha=0.3"],
    "soft every": [*SOFT, "reference_update.every=2"],
    "hard": ["reference_update.mode=hard", "reference_update.every=1"],
    "bema": BEMA,
    **bema_settings(),
}
DIFFER = [
    ("fixed", "soft"),
    ("soft", "soft alpha"),
    ("soft", "soft every"),
    ("soft", "hard"),
    ("fixed", "bema"),
    *[("bema", name) for name in UPDATES if name.startswith("bema ")],
]


@pytest.fixture(scope="module")
def reference_after_two_steps(tiny):
    """Each :data:`UPDATES` setting's reference log-probs of the eval batch after 2 DPO steps from the same weights."""
    out = {}
    for name, overrides in UPDATES.items():
        config = compose_config([*TINY, f"output_root={tiny['tmp']}", *SETUP, *overrides])
        checks.validate_config(config)
        weights = (copy.deepcopy(tiny["policy"]), copy.deepcopy(tiny["reference"]))  # the steps move them
        trainer = build(tiny, default_loss("dpo"), "packed", config=config, weights=weights)
        batch = trainer.eval_batches[0]
        for _ in range(2):
            trainer.train_step(batch)
            trainer.batch_counter += 1  # as run_batches counts the steps: the updates' schedule reads it
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
    (["online.enabled=true", "online.scorer=reward_model_judge", "reward_model.name_or_path=org/rm", "online.missing_eos_penalty=1"],
     "online.missing_eos_penalty is subtracted from scores, and online.scorer=reward_model_judge gives none (it picks one "
     "of two); set online.missing_eos_penalty=null, or online.scorer=reward_model or reward_function."),
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
