"""The cells of "every option acts" (issue 37, part 3), generated from the objectives' declarations: each ``loss.*`` key
with a second valid value (:func:`second_value`), the paths a key is checked on (:data:`PATHS`), each path's config and
its refusal (:func:`refusal`), the trainer built on a path (:func:`build`) and its loss and gradient
(:func:`trainer_numbers`). Shared by tests/test_options_act*.py and tests/options_act_worker.py (run under torchrun);
``python tests/option_cells.py`` prints the count of (key, path) cells by path."""

from __future__ import annotations

import copy
import dataclasses
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for ``python tests/option_cells.py``
import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import TINY, compose_config  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import losses  # noqa: E402
import objectives  # noqa: E402, F401  (registers every objective)
import trainers  # noqa: E402
import utils  # noqa: E402
from evaluation.equivalence import NOT_TRAINED as OBJECTIVE_ONLY  # noqa: E402  (objectives the tiny trainer cannot train)
from modeling import models  # noqa: E402
from runs import checks, reference_cache  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
B = 4  # pairs of the objective-level inputs and of the trainer's batch
SAME = {"rtol": 1e-4, "atol": 1e-5}  # fp32: two paths computing the same numbers in another order agree this closely
CHUNK = 3  # positions per output-layer call on the chunked path (the tiny batch's rows are 17-18 long)
SETUP = ["n_eval_examples=4", f"eval_batch_size={B}", "warmup_steps=0"]  # the tiny config's additions: one eval batch of B


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


@dataclasses.dataclass(frozen=True)
class PathSpec:
    """A way the trainer computes the loss: its config overrides (what runs/checks.py sees), forward and processes."""

    overrides: tuple[str, ...] = ()
    packed: bool = True  # the packed forward (modeling/packing.py); False: the padded one
    chunk: int = 0  # output_layer_chunk: positions per output-layer call (0: all at once)
    processes: int = 1  # ranks (the paths of several run in tests/options_act_worker.py under torchrun)


PATHS = {
    "padded": PathSpec(packed=False),
    "packed": PathSpec(),
    "chunked": PathSpec(chunk=CHUNK),
    "precomputed": PathSpec(("precompute_ref_log_probs=true",)),  # the reference's log-probs computed once, then read
    "lora": PathSpec(("model.lora.r=4",)),  # the policy's adapters trained, the reference the policy with them off
    "fsdp": PathSpec(("trainer=FSDPTrainer", "world_size=2"), processes=2),
    "tp": PathSpec(("trainer=TensorParallelTrainer", "world_size=2"), processes=2),
}
ONE_PROCESS = [name for name, path in PATHS.items() if path.processes == 1]


# ----------------------------------------------------------------------------- configs from the declarations


def default_loss(name: str) -> dict:
    """config/loss/<name>.yaml as a dict (the objective's default loss config); ``{"name": name}`` without one."""
    return copy.deepcopy(_loss_file(name))


@functools.cache
def _loss_file(name: str) -> dict:
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


def candidates(default, choices: list | None = None) -> list:
    """Second values to try, nearest first, by the default's type (a string: ``choices``)."""
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, (int, float)):
        return [default * 2, default / 2, default + 0.25, default + 1, 0.25, 0.5, 1.0, 2.0]
    if isinstance(default, str):
        return list(choices or [])
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
    for value in candidates(default, _choices(spec) if isinstance(default, str) else None):
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


OBJECTIVE_KEYS = [pair for pair in declared_keys() if level(*pair) == "objective"]
TRAINER_KEYS = [(n, k) for n, k in declared_keys() if n not in OBJECTIVE_ONLY and level(n, k) != "data"]
TRAINED = sorted(n for n in losses.OBJECTIVES if n not in OBJECTIVE_ONLY and not losses.OBJECTIVES[n].sft_data)


def changed(a: tuple, b: tuple) -> bool:
    """True if the losses or the gradients of ``a`` and ``b`` differ beyond fp32 rounding (or in shape)."""
    return any(x.shape != y.shape or not torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b))


def one_sentence(message: str) -> bool:
    """True if ``message`` is one sentence: it ends with a full stop and holds no other."""
    return message.endswith(".") and message.count(". ") == 0


# ----------------------------------------------------------------------------- the paths' configs and refusals


def tiny_config(tmp: Path, *overrides: str):
    """The tiny config (conftest's TINY, one eval batch of B pairs) with ``overrides``, resolved."""
    config = compose_config([*TINY, f"output_root={tmp}", *SETUP, *overrides])
    OmegaConf.resolve(config)
    return config


def path_config(config, loss_config: dict, path: str, **settings):
    """A copy of ``config`` with ``loss_config`` on ``path`` (its overrides and output layer) and ``settings``."""
    config = OmegaConf.create(OmegaConf.to_container(config))
    config.loss = loss_config
    config = OmegaConf.merge(config, OmegaConf.from_dotlist(list(PATHS[path].overrides)))
    config.output_layer_chunk = PATHS[path].chunk
    for key, value in settings.items():
        OmegaConf.update(config, key, value)
    return config


_ON_PATH: dict[tuple[int, str], tuple] = {}  # (id(config), path) -> (config, its copy on path)


def on_path(config, loss_config: dict, path: str):
    """:func:`path_config` of ``config`` without settings, copied once per path and given ``loss_config`` in place (a
    copy per call costs 10 times the check): read it, or train with it before the next call."""
    if (id(config), path) not in _ON_PATH:
        _ON_PATH[id(config), path] = (config, path_config(config, loss_config, path))
    copied = _ON_PATH[id(config), path][1]
    copied.loss = loss_config
    return copied


def refusal(config, loss_config: dict, path: str) -> str | None:
    """runs/checks.py's sentence refusing ``loss_config`` on ``path`` (before anything loads), or None."""
    try:
        checks.validate_config(on_path(config, loss_config, path), PATHS[path].processes)
    except utils.ConfigError as e:
        return str(e)
    return None


# ----------------------------------------------------------------------------- the trainer on a path


def tiny_setup(tmp: Path) -> dict:
    """The tiny config, tokenizer, examples and models (the reference from another seed, so h != 0)."""
    from data.loading import load_examples

    config = tiny_config(tmp)
    tokenizer = models.load_tokenizer(config.model)
    options = OmegaConf.to_container(config.data)
    train, test = (load_examples(list(config.datasets), s, options, False, silent=True) for s in ("train", "test"))
    policy = models.load_model(config.model, tokenizer, torch.float32, 0)
    reference = models.load_model(config.model, tokenizer, torch.float32, 1)
    return dict(config=config, tokenizer=tokenizer, train=train, test=test, policy=policy, reference=reference, tmp=tmp, cache={})


def lora_policy(tiny: dict):
    """The tiny policy with LoRA adapters (``PATHS["lora"]``'s r), made once; their B matrices are random (seeded) rather
    than zero, so the policy differs from its reference (the adapters off) as the other paths' do."""
    if "lora" not in tiny:
        lora = path_config(tiny["config"], default_loss("dpo"), "lora").model.lora
        policy = models.apply_lora(copy.deepcopy(tiny["policy"]), lora)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        tiny["lora"] = policy
    return tiny["lora"]


def build(tiny: dict, loss_config: dict, path: str = "packed", config=None, weights=None, **settings) -> trainers.BasicTrainer:
    """A BasicTrainer on the tiny models (or ``weights``, (policy, reference)) with ``loss_config`` on the one-process
    ``path``, from the tiny config (or ``config``) with ``settings`` (config keys, e.g. gradient_accumulation_steps);
    the precomputed path's reference log-probs computed as train.py computes them (then the reference is dropped)."""
    policy, reference = weights or (tiny["policy"], tiny["reference"])
    config = config or tiny["config"]
    config = path_config(config, loss_config, path, **settings) if settings else on_path(config, loss_config, path)
    uses_reference = losses.get_objective(loss_config["name"]).uses_reference(loss_config)
    if path == "lora":
        policy, reference = lora_policy(tiny), None
    run_dir = tiny["tmp"] / "run"
    run_dir.mkdir(exist_ok=True)
    args = (policy, config, str(run_dir), tiny["tokenizer"], tiny["train"], tiny["test"])
    trainer = trainers.BasicTrainer(*args, reference if uses_reference else None)
    trainer.packed = PATHS[path].packed
    if path == "precomputed":
        cache = tiny["tmp"] / "reference_logps.pt"
        trainer.reference_cache = reference_cache.precompute_reference(trainer, tiny["test"], str(cache))
        trainer.reference_model = None
    return trainer


UNPAIRED_KEYS = [(n, k) for n, k in TRAINER_KEYS if losses.OBJECTIVES[n].unpaired]  # also checked on unpaired rows


def unpaired_rows(tiny: dict) -> dict:
    """A batch of B unpaired rows {prompt, completion, label}, half of them desirable, read by data/formats.py's json
    loader."""
    import json

    import preference_datasets
    from data.loading import load_examples

    rows = [{"prompt": f"Q: {i}+{i}=\nA:", "completion": f" {2 * i + i % 2}", "label": i % 2 == 0} for i in range(B)]
    path = tiny["tmp"] / "unpaired.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    options = {"json": {"path": {"train": str(path), "test": str(path)}, "holdout_fraction": 0.1}}
    examples = load_examples(["json"], "train", options, False, silent=True)
    c = tiny["config"]
    batch = next(
        preference_datasets.get_batch_iterator(examples, tiny["tokenizer"], B, c.max_length, c.max_prompt_length, n_epochs=1)
    )
    assert "rejected_input_ids" not in batch and batch["label"].tolist().count(True) == B // 2
    return batch


def gradient(policy) -> torch.Tensor:
    """The policy's gradient, flattened (this rank's shards of a sharded model)."""
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    return torch.cat([(g.to_local() if hasattr(g, "to_local") else g).flatten() for g in grads])


def trainer_numbers(trainer: trainers.BasicTrainer, batch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the micro-batch's loss, the policy's gradient, flattened) of one ``get_batch_metrics`` on the eval batch (this
    rank's part of it)."""
    whole = batch or trainer.eval_batches[0]
    batch, _ = trainer.dist.local_batch(whole)
    trainer.policy.zero_grad(set_to_none=True)
    loss, _ = trainer.get_batch_metrics(batch, len(whole["prompt"]), 1.0, "train")
    loss.backward()
    grad = gradient(trainer.policy)
    trainer.policy.zero_grad(set_to_none=True)
    return loss.detach(), grad


def _tally(config, path: str, cells: list) -> dict[str, int]:
    refused = [refusal(config, base_config(n, k), path) or refusal(config, second_value(n, k), path) for n, k in cells]
    return {"acts": sum(not r for r in refused), "refused": sum(bool(r) for r in refused)}


def cell_counts(tmp: Path) -> dict[str, dict[str, int]]:
    """Per path, the (objective, key) cells the tests check to act and those the path refuses in one sentence, generated
    as the tests generate them: the objective level (pairs, and unpaired rows where declared); each of :data:`PATHS`
    (the trainer-level keys on pairs and on unpaired rows, the data-level ones on one process); online DPO's pairs; and
    online DPO's own keys (tests/test_options_act_online.py)."""
    config = tiny_config(tmp)
    data_keys = [pair for pair in declared_keys() if level(*pair) == "data"]
    counts = {"objective": {"acts": len(OBJECTIVE_KEYS) + len(UNPAIRED_KEYS), "refused": 0}}
    for path, spec in PATHS.items():
        counts[path] = _tally(config, path, TRAINER_KEYS + UNPAIRED_KEYS + (data_keys if spec.processes == 1 else []))
    online = tiny_config(tmp, "online.enabled=true", "online.scorer=reward_function")
    capable = [(n, k) for n, k in TRAINER_KEYS if checks.online_capable(losses.OBJECTIVES[n])]
    counts["online pairs"] = _tally(online, "packed", capable)
    counts["online.*"] = {"acts": len(online.online), "refused": 0}
    return counts


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        counts = cell_counts(Path(folder))
    for path, n in counts.items():
        print(f"{path:13} {n['acts']:4} (key, path) cells act, {n['refused']:3} refused in one sentence")
    acts, refused = (sum(n[kind] for n in counts.values()) for kind in ("acts", "refused"))
    print(f"{'all':13} {acts:4} (key, path) cells act, {refused:3} refused in one sentence")
