"""End-to-end tests of train.py and BasicTrainer on the tiny embedded default."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, compose_config, metric_records, run_train
from omegaconf import OmegaConf

import train
import trainers
import utils
from data import splits
from data.loading import load_examples
from evaluation import in_training
from modeling import models, optimization
from runs import checks, launch, tracking

CONFIG_DIR = REPO / "config"
MODEL_YAMLS = sorted(p.stem for p in (CONFIG_DIR / "model").glob("*.yaml"))
LOSS_YAMLS = sorted(p.stem for p in (CONFIG_DIR / "loss").glob("*.yaml"))
REFERENCE_KEYS = [
    "seed",
    "exp_name",
    "batch_size",
    "eval_batch_size",
    "gradient_accumulation_steps",
    "lr",
    "optimizer",
    "warmup_steps",
    "max_grad_norm",
    "max_length",
    "max_prompt_length",
    "n_epochs",
    "n_examples",
    "n_eval_examples",
    "eval_every",
    "do_first_eval",
    "sample_during_eval",
    "n_eval_model_samples",
    "activation_checkpointing",
    "minimum_log_interval_secs",
    "trainer",
    "datasets",
    "output_root",
]


run, records = run_train, metric_records


# ----------------------------------------------------------------------------- config


def test_model_and_loss_lists_are_complete():
    expected = {
        "blank_model",
        "tiny",
        "gpt2-large",
        "gpt2-xl",
        "gptj",
        "llama7b",
        "pythia28",
        "pythia69",
        "pythia410m",
        "pythia1b",
    }
    assert expected <= set(MODEL_YAMLS)
    assert {"sft", "dpo", "ipo"} <= set(LOSS_YAMLS)


def composed(model: str = "tiny", loss: str = "dpo"):
    """``python train.py model=<model> loss=<loss>``'s config (a hub id for blank_model, which names none)."""
    extra = ["model.name_or_path=some/model"] if model == "blank_model" else []
    return compose_config([f"model={model}", f"loss={loss}", *extra])


def assert_complete_and_valid(config, loss: str) -> None:
    """The reference repository's keys are all there, the loss is ``loss`` and the shipped config passes every check."""
    config = copy.deepcopy(config)
    OmegaConf.resolve(config)
    for key in REFERENCE_KEYS:
        assert key in config, key
    for key in ("enabled", "entity", "project", "mode"):
        assert key in config.wandb
    for key in (
        "name_or_path",
        "tokenizer_name_or_path",
        "archive",
        "block_name",
        "policy_dtype",
        "reference_dtype",
        "fsdp_policy_mp",
    ):
        assert key in config.model
    assert config.loss.name == ("mix" if loss == "mpo" else loss)  # mpo.yaml is a preset of loss=mix
    checks.validate_config(config)


@pytest.mark.parametrize("model", MODEL_YAMLS)
def test_every_model_yaml_composes(model):
    assert_complete_and_valid(composed(model=model), "dpo")


@pytest.mark.parametrize("loss", LOSS_YAMLS)
def test_every_loss_yaml_composes(loss):
    assert_complete_and_valid(composed(loss=loss), loss)


def test_every_model_and_loss_pair_is_valid():
    # Every shipped pair passes the checks (a rule may join a model's keys and a loss's): each yaml composed once,
    # each pair put together from them, as Hydra does: the loss group is the `loss` node, and no model yaml sets it.
    models = {model: composed(model=model) for model in MODEL_YAMLS}
    loss_nodes = {loss: composed(loss=loss).loss for loss in LOSS_YAMLS}
    assert not any("loss" in OmegaConf.load(CONFIG_DIR / "model" / f"{m}.yaml") for m in MODEL_YAMLS)
    for config in models.values():
        for loss, node in loss_nodes.items():
            pair = copy.deepcopy(config)
            pair.loss = node
            assert_complete_and_valid(pair, loss)
    # the put-together pair is what Hydra composes (two pairs that are neither yaml's default)
    for model, loss in (("pythia28", "ipo"), ("blank_model", "mpo")):
        pair = copy.deepcopy(models[model])
        pair.loss = loss_nodes[loss]
        assert OmegaConf.to_container(pair) == OmegaConf.to_container(composed(model=model, loss=loss))


def test_reference_presets_keep_reference_learning_rate():
    # The tiny model's own lr must not leak into the pretrained presets.
    assert compose_config(["model=pythia28"]).lr == 5e-7
    assert compose_config([]).lr > 1e-4
    assert compose_config(["model=pythia28"]).model.name_or_path == "EleutherAI/pythia-2.8b"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss.label_smoothing=0.5"], "label_smoothing must be in \\[0, 0.5\\)"),
        (["loss.label_smoothing=-0.1"], "label_smoothing must be in"),
        (["loss.beta=null"], "loss=dpo needs loss.beta"),
        (["loss=ipo", "loss.beta=null"], "loss=ipo needs loss.beta"),
        (["datasets=[nope]"], "Unknown dataset.*nope.*registered datasets are"),
        (["batch_size=6", "gradient_accumulation_steps=4"], "divisible by gradient_accumulation_steps"),
        (["max_prompt_length=64", "max_length=64"], "max_prompt_length"),
        (["model.archive=/no/such/policy.pt"], "model.archive=/no/such/policy.pt does not exist"),
        (
            [f"model.archive={REPO / 'config'}"],
            f"model.archive={REPO / 'config'} is a folder; give a checkpoint's policy.pt: the policy.pt of a checkpoint "
            r"\(<run>/LATEST/policy.pt\); this folder holds none.",
        ),
        (["wandb.mode=sometimes"], "wandb.mode"),
        (["datasets=[hhh]"], "Unknown dataset 'hhh' in datasets; did you mean 'hh'\\?"),
        (
            ["datasets=[arithmetic,hh,arithmetic]"],
            "^datasets lists 'arithmetic' twice, so each of its examples would be trained on twice; list each dataset "
            "once \\(n_epochs sets how often the data is seen\\).$",
        ),
        (["loss=ipo", "+loss.label_smoothing=0.1"], "loss=ipo has no key 'label_smoothing'"),
        (["loss=ipo", "+loss.reference_free=true"], "loss=ipo has no key 'reference_free'"),
        (["loss=sft", "+loss.beta=0.1"], "loss=sft has no key 'beta'"),
    ],
)
def test_bad_override_is_one_clear_sentence(overrides, message):
    config = compose_config(overrides)
    with pytest.raises(utils.ConfigError, match=message):
        checks.validate_config(config)


def test_a_model_folder_without_weights_is_one_sentence_and_leaves_no_run_folder(tmp_path):
    # The tokenizer loads but the model does not: the run folder is made only after the models
    # load, so no folder holding just config.yaml is left behind.
    from conftest import needs_shared

    folder = tmp_path / "no_weights"
    shutil.copytree(needs_shared("tokenizers", "gpt2"), folder)  # skipped, with the reason, without ../shared
    config = compose_config(["model=blank_model", f"model.name_or_path={folder}", f"output_root={tmp_path / 'out'}"])
    with pytest.raises(utils.ConfigError, match=f"Could not load model.name_or_path={folder}: .* Check model.name_or_path"):
        train.main(config)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_an_archive_of_another_model_is_one_sentence(tmp_path):
    # SFT with one model, DPO with another: the weights do not fit.
    archive = tmp_path / "policy.pt"
    torch.save({"step_idx": 8, "state": {"lm_head.weight": torch.zeros(3, 3)}}, archive)
    config = compose_config([f"model.archive={archive}", f"output_root={tmp_path / 'out'}"])
    with pytest.raises(
        utils.ConfigError, match="holds another model's weights .*Missing key.*; give the policy.pt of a run of this model"
    ):
        train.main(config)


def test_batch_size_must_divide_by_world_size():
    with pytest.raises(utils.ConfigError, match="number of processes"):
        checks.validate_config(compose_config(["batch_size=6"]), world_size=4)


def test_eval_batch_larger_than_eval_set_is_a_note_and_the_eval_is_one_batch_of_the_set():
    # Regression (issue 34): a README command on a small file was refused for the preset's eval_batch_size=64.
    import preference_datasets

    config = compose_config(["eval_batch_size=64"])
    note = splits.check_eval_size(config, 10)
    assert note == "eval_batch_size (64) is larger than the eval set (10 examples), so the eval runs as one batch of 10."
    examples = [{"prompt": f"Q{i}", "chosen": " a", "rejected": " b", "truncation_mode": "keep_end"} for i in range(10)]
    tokenizer = models.load_tokenizer(config.model)
    batches = list(preference_datasets.get_batch_iterator(examples, tokenizer, 64, 64, 32, n_examples=10))
    assert [len(b["prompt"]) for b in batches] == [10]
    assert splits.check_eval_size(config, 64) is None
    with pytest.raises(utils.ConfigError, match="^The eval split is empty"):
        splits.check_eval_size(config, 0)


def test_unknown_override_is_rejected_by_hydra():
    out = subprocess.run([sys.executable, "train.py", "no_such_key=1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "no_such_key" in out.stderr and "Traceback" not in out.stderr


# ----------------------------------------------------------------------------- runs


def test_dpo_run_writes_reference_layout_and_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = run(["sample_during_eval=true", "plot_curves=true"], tmp_path)
    assert run_dir.parent == tmp_path
    assert OmegaConf.load(run_dir / "config.yaml").loss.name == "dpo"
    latest = run_dir / "LATEST"
    assert latest.resolve().name == "step-48"
    for name in ("policy.pt", "optimizer.pt", "scheduler.pt"):
        saved = torch.load(latest / name, weights_only=False)
        assert saved["step_idx"] == 48 and "state" in saved
    recs = records(run_dir)
    first_eval = next(r for r in recs if "loss/eval" in r)
    assert first_eval["step"] == 0
    # Policy == reference at step 0: every reward is 0 and the loss is ln 2.
    assert first_eval["loss/eval"] == pytest.approx(math.log(2), abs=1e-6)
    assert first_eval["rewards_eval/margins"] == pytest.approx(0, abs=1e-7)
    train_keys = set().union(*(r.keys() for r in recs))
    for key in [
        "rewards_train/chosen",
        "rewards_train/rejected",
        "rewards_train/accuracies",
        "rewards_train/margins",
        "logps_train/chosen",
        "logps_train/rejected",
        "loss/train",
        "grad_norm",
        "examples_per_second",
        "counters/examples",
        "rewards_eval/accuracies",
        "logps_eval/chosen",
        "loss/eval",
    ]:
        assert key in train_keys, key
    assert sorted({r["step"] for r in recs if "loss/eval" in r}) == [0, 24, 48]
    assert (run_dir / "curves" / "rewards_train.png").stat().st_size > 1000
    assert (run_dir / "samples.md").exists() and (run_dir / "samples.jsonl").exists()

    model = AutoModelForCausalLM.from_pretrained(latest / "hf")
    tokenizer = AutoTokenizer.from_pretrained(latest / "hf")
    state = torch.load(latest / "policy.pt", weights_only=False)["state"]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, state[name])
    ids = tokenizer("Q: 1+2=\nA:", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == len(tokenizer)


def test_progress_bar_false_hides_hugging_face_bars_for_the_run_only(tmp_path, capfd):
    # a fresh user's log with progress_bar=false held transformers' "Writing model shards" bar of each hf/ export
    import transformers

    run_train(["loss=sft", "n_examples=8", "eval_every=8", "save_hf_export=true"], tmp_path)
    assert (tmp_path / next(p.name for p in tmp_path.iterdir()) / "LATEST").exists()
    assert "Writing model shards" not in capfd.readouterr().err
    assert transformers.utils.logging.is_progress_bar_enabled()  # the process's own setting again after the run


def test_sft_then_dpo_from_archive_starts_at_ln2(tmp_path):
    sft_dir = run(["loss=sft", "exp_name=sft"], tmp_path)
    sft_first = next(r for r in records(sft_dir) if "loss/eval" in r)
    sft_last = [r for r in records(sft_dir) if "loss/eval" in r][-1]
    assert sft_last["loss/eval"] < sft_first["loss/eval"]
    archive = sft_dir / "LATEST" / "policy.pt"
    dpo_dir = run(["loss=dpo", f"model.archive={archive}", "exp_name=dpo"], tmp_path)
    first = next(r for r in records(dpo_dir) if "loss/eval" in r)
    assert first["loss/eval"] == pytest.approx(math.log(2), abs=1e-6)
    # The SFT weights were loaded: the eval log-probs at step 0 match the SFT run's final ones.
    assert first["logps_eval/chosen"] == pytest.approx(sft_last["logps_eval/chosen"], rel=1e-4)


def test_an_archive_that_is_not_a_checkpoint_is_one_sentence(tmp_path):
    archive = tmp_path / "policy.pt"
    archive.write_text("not a checkpoint")
    with pytest.raises(utils.ConfigError, match=r"could not be read \(UnpicklingError\); give the policy.pt of an earlier run"):
        run([f"model.archive={archive}"], tmp_path)


@pytest.mark.parametrize(
    "loss", [["loss=dpo"], ["loss=ipo"], ["loss=dpo", "loss.label_smoothing=0.2"], ["loss=dpo", "loss.reference_free=true"]]
)
def test_other_losses_start_at_their_formula_and_the_first_step_lowers_the_loss(tmp_path, loss):
    # One eval example (its means are its values) and 8 training pairs in one batch of 8, two
    # steps: step 2 sees the same 8 pairs as step 1 with the weights after the first update.
    small = ["data.arithmetic.n_train=8", "batch_size=8", "n_examples=16", "eval_every=16", "n_eval_examples=1"]
    run_dir = run([*loss, *small, "eval_batch_size=1", "sample_during_eval=false", "save_hf_export=false"], tmp_path)
    assert (run_dir / "LATEST" / "policy.pt").exists()
    recs = records(run_dir)
    first_eval = next(r for r in recs if "loss/eval" in r)
    step1, step2 = [r for r in recs if "loss/train" in r]
    assert (first_eval["step"], step1["step"], step2["step"]) == (0, 8, 16)
    beta = 0.1
    if "loss.reference_free=true" in loss:
        # No reference: r = beta * log pi, loss = -log sigmoid(beta * (log pi(y_w) - log pi(y_l))), not ln 2.
        chosen, rejected = first_eval["logps_eval/chosen"], first_eval["logps_eval/rejected"]
        assert first_eval["rewards_eval/chosen"] == pytest.approx(beta * chosen, rel=1e-6)
        assert first_eval["rewards_eval/rejected"] == pytest.approx(beta * rejected, rel=1e-6)
        expected = math.log1p(math.exp(-beta * (chosen - rejected)))
        assert abs(expected - math.log(2)) > 0.01  # the data make this case differ from ln 2
    else:
        # Policy == reference at step 0: h = 0, so DPO and cDPO give ln 2 (whatever the label
        # smoothing: (1 - eps) ln 2 + eps ln 2) and IPO gives (0 - 1 / (2 beta))^2 = 25.
        expected = 25.0 if "loss=ipo" in loss else math.log(2)
        for record, split in ((first_eval, "eval"), (step1, "train")):
            assert record[f"loss/{split}"] == pytest.approx(expected, rel=1e-6)
            assert record[f"rewards_{split}/margins"] == 0.0 and record[f"rewards_{split}/accuracies"] == 0.0
    assert first_eval["loss/eval"] == pytest.approx(expected, rel=1e-6)
    # Every loss here falls as the margin beta * h grows: the first update must raise the margin
    # on the same pairs and lower the loss.
    assert step2["rewards_train/margins"] > step1["rewards_train/margins"] + 1e-3
    assert step2["loss/train"] < step1["loss/train"]


def build_trainer(overrides: list[str], tmp_path: Path) -> trainers.BasicTrainer:
    """A BasicTrainer built the way train.main builds it, without running it."""
    config = compose_config([*TINY, f"output_root={tmp_path}", "sample_during_eval=false", *overrides])
    OmegaConf.resolve(config)
    tokenizer = models.load_tokenizer(config.model)
    options = OmegaConf.to_container(config.data)
    sft = config.loss.name == "sft"
    tr = load_examples(list(config.datasets), "train", options, sft, silent=True)
    ev = load_examples(list(config.datasets), "test", options, sft, silent=True)
    policy = models.load_model(config.model, tokenizer, torch.float32, config.seed)
    reference = None if sft else models.load_model(config.model, tokenizer, torch.float32, config.seed)
    os.makedirs(tmp_path / "run", exist_ok=True)
    return trainers.BasicTrainer(policy, config, str(tmp_path / "run"), tokenizer, tr, ev, reference)


@pytest.mark.parametrize("loss", ["dpo", "sft"])
def test_gradient_accumulation_gives_the_same_step(tmp_path, loss):
    weights = []
    for accumulation in (1, 4):
        t = build_trainer(
            [f"loss={loss}", f"gradient_accumulation_steps={accumulation}", "optimizer=SGD", "lr=0.5", "warmup_steps=0"],
            tmp_path / str(accumulation),
        )
        batch = next(iter(trainers.get_batch_iterator(t.train_examples, t.tokenizer, 8, 64, 32, seed=0, n_examples=8)))
        t.train_step(batch)
        weights.append({k: v.clone() for k, v in t.policy.state_dict().items()})
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=1e-5, atol=1e-6)


def test_dropout_is_disabled_in_policy_and_reference():
    from omegaconf import OmegaConf as OC

    tokenizer = models.load_tokenizer(compose_config([]).model)
    for fields in (
        {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "attn_pdrop": 0.5, "resid_pdrop": 0.5, "embd_pdrop": 0.5},
        {
            "model_type": "llama",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "attention_dropout": 0.5,
        },
    ):
        model = models.load_model(OC.create({"config": fields}), tokenizer, torch.float32, seed=0)
        model.train()
        ids = torch.arange(3, 20).unsqueeze(0)
        torch.testing.assert_close(model(ids).logits, model(ids).logits)


def test_nan_loss_stops_with_step_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    config = compose_config([*TINY, f"output_root={tmp_path}", "sample_during_eval=false", "eval_every=16"])
    calls = {"n": 0}
    real = trainers.losses.dpo_loss

    def flaky(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 7:  # eval (2 calls), steps 1-2, eval at 16 (2 calls): call 7 is step 3
            return (out[0] * float("nan"), *out[1:])
        return out

    monkeypatch.setattr(trainers.losses, "dpo_loss", flaky)
    with pytest.raises(trainers.NonFiniteLossError, match=r"loss is nan at step 3 \(after 16 examples\)") as err:
        train.main(config)
    run_dir = next(tmp_path.iterdir())
    assert (run_dir / "LATEST").resolve().name == "step-16"
    assert str((run_dir / "LATEST").resolve()) in str(err.value)
    assert not list(run_dir.glob("step-24*")) and not list(run_dir.glob(".step-*"))


def test_crash_while_saving_leaves_latest_complete(tmp_path, monkeypatch):
    t = build_trainer([], tmp_path)
    first = t.save()
    real_save = torch.save

    def crash(obj, path, *args, **kwargs):
        if str(path).endswith("scheduler.pt"):
            raise OSError("disk full")
        return real_save(obj, path, *args, **kwargs)

    t.example_counter = 8
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        t.save()
    latest = Path(t.run_dir) / "LATEST"
    assert str(latest.resolve()) == str(Path(first).resolve())
    assert {p.name for p in latest.iterdir()} >= {"policy.pt", "optimizer.pt", "scheduler.pt", "trainer_state.pt"}
    assert not (Path(t.run_dir) / "step-8").exists()


# ----------------------------------------------------------------------------- peer bugs (../shared/PEER_BUGS.md)


def test_eval_size_check_counts_n_eval_examples():
    config = compose_config(["eval_batch_size=64", "n_eval_examples=32"])
    assert "is larger than the eval set (32 examples), so the eval runs as one batch of 32" in splits.check_eval_size(config, 256)
    assert splits.check_eval_size(compose_config(["eval_batch_size=32", "n_eval_examples=32"]), 256) is None


@pytest.mark.parametrize(
    "schedule, expected",
    [
        # warmup 3 of 10 steps: (step + 1) / 4 during warmup, as the reference repository
        ("constant", [0.25, 0.5, 0.75, 1, 1, 1, 1, 1, 1, 1]),
        ("linear", [0.25, 0.5, 0.75, 1, 6 / 7, 5 / 7, 4 / 7, 3 / 7, 2 / 7, 1 / 7]),
        ("cosine", [0.25, 0.5, 0.75] + [0.5 * (1 + math.cos(math.pi * k / 7)) for k in range(7)]),
    ],
)
def test_lr_schedule_first_step_is_not_zero(schedule, expected):
    got = [optimization.lr_multiplier(step, 3, 10, schedule) for step in range(10)]
    assert got == pytest.approx(expected)


def test_one_step_run_moves_the_policy_and_logs_the_lr_used(tmp_path):
    run_dir = run(["n_examples=8", "eval_every=8", "warmup_steps=150", "lr=1e-2", "minimum_log_interval_secs=1000"], tmp_path)
    recs = records(run_dir)
    train_recs = [r for r in recs if "loss/train" in r]
    assert len(train_recs) == 1  # the final steps are logged despite the log interval
    assert train_recs[0]["lr"] == pytest.approx(1e-2 / 151)
    assert [r for r in recs if "loss/eval" in r][-1]["loss/eval"] != pytest.approx(math.log(2), abs=1e-7)


def test_ipo_is_selectable_length_normalised_and_refuses_dpo_only_keys():
    config = compose_config(["loss=ipo"])
    assert config.loss.name == "ipo" and config.loss.average_log_prob is True
    for key in ("loss.label_smoothing=0.1", "loss.reference_free=true"):
        with pytest.raises(Exception, match="label_smoothing|reference_free"):
            compose_config(["loss=ipo", key])


def test_reference_defaults_to_policy_dtype_so_step0_rewards_are_zero(tmp_path):
    # The reference repo kept the reference in float16 next to a bf16/fp32 policy.
    assert compose_config(["model=pythia28"]).model.reference_dtype is None
    run_dir = run(["model.policy_dtype=bfloat16", "n_examples=8", "eval_every=8", "sample_during_eval=false"], tmp_path)
    first = next(r for r in records(run_dir) if "loss/eval" in r)
    assert first["rewards_eval/chosen"] == 0.0 and first["rewards_eval/rejected"] == 0.0
    assert first["loss/eval"] == pytest.approx(math.log(2), abs=1e-6)


def test_eval_samples_continue_a_left_padded_prompt_as_alone_on_gpt2(tmp_path):
    # BasicTrainer.sample on absolute position embeddings: a short prompt left-padded beside a
    # longer one (in one eval batch, or in the next batch) must continue token for token as it
    # does alone. sample_top_p=1e-6 keeps only the most likely token: greedy.
    from preference_datasets import collate, tokenize_prompt

    gpt2 = ["~model.config", "+model.config={model_type:gpt2,n_embd:32,n_layer:2,n_head:2,n_positions:128}"]
    t = build_trainer([*gpt2, "model.block_name=GPT2Block", "sample_top_p=1e-6"], tmp_path)
    pad = t.tokenizer.pad_token_id
    short, long = (tokenize_prompt(p, t.tokenizer, 32, "keep_start") for p in ["1+1=", "123456+654321="])
    n_short, n_long = len(short["prompt_input_ids"]), len(long["prompt_input_ids"])
    assert n_long > n_short + 5
    generated = []  # what generate returned, policy then reference
    for model in (t.policy, t.reference_model):
        real = model.generate
        model.generate = lambda *args, real=real, **kwargs: generated.append(real(*args, **kwargs)) or generated[-1]

    def first_row_continuation(batches, n, width):
        generated.clear()
        t.eval_batches, t.config.n_eval_model_samples = batches, n
        rows = in_training.sample(t)
        assert [r["prompt"] for r in rows] == [short["prompt"], long["prompt"]][:n]
        return [out[0, width:].tolist() for out in generated]

    alone = first_row_continuation([collate([short], pad)], 1, n_short)
    together = first_row_continuation([collate([short, long], pad)], 2, n_long)
    next_batch = first_row_continuation([collate([short], pad), collate([long], pad)], 2, n_long)
    for continuations in (together, next_batch):
        for got, expected in zip(continuations, alone):  # policy, reference
            k = min(len(got), len(expected))
            assert k >= 8 and got[:k] == expected[:k]


def test_wandb_offline_run_logs_beside_metrics_jsonl(tmp_path):
    pytest.importorskip("wandb")
    run_dir = run(["wandb.enabled=true", "wandb.mode=offline", "n_examples=8", "eval_every=8"], tmp_path)
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb wrote no offline run"
    assert (run_dir / "metrics.jsonl").exists()


def test_stories260k_sft_then_dpo_on_local_hh(tmp_path):
    # The hub-loading code (from_pretrained) on a local folder, and hh from a local copy.
    from conftest import needs_shared

    model_dir = needs_shared("models", "stories260K")
    hh_dir = needs_shared("data", "hh-rlhf")
    common = [
        "model=blank_model",
        f"model.name_or_path={model_dir}",
        "datasets=[hh]",
        f"data.hh.local_dir={hh_dir}",
        "data.hh.subsets=[harmless-base]",
        "data.hh.holdout_fraction=0.1",
        "max_length=128",
        "max_prompt_length=64",
        "lr=1e-4",
        "sample_during_eval=false",
        "n_examples=16",
        "eval_every=16",
    ]
    sft_dir = run([*common, "loss=sft"], tmp_path)
    dpo_dir = run([*common, "loss=dpo", f"model.archive={sft_dir / 'LATEST' / 'policy.pt'}"], tmp_path)
    first = next(r for r in records(dpo_dir) if "loss/eval" in r)
    assert first["loss/eval"] == pytest.approx(math.log(2), abs=1e-6)
    assert any("rewards_train/accuracies" in r for r in records(dpo_dir))


def test_precomputed_reference_equals_live_reference_and_is_reused(tmp_path, capsys):
    common = ["sample_during_eval=false", f"cache_dir={tmp_path / 'cache'}"]
    live = run(common, tmp_path / "live")
    cached = run([*common, "precompute_ref_log_probs=true"], tmp_path / "cached")
    assert "cached in" in capsys.readouterr().out
    for a, b in zip(records(live), records(cached)):
        for key in ("loss/eval", "rewards_eval/margins", "loss/train", "rewards_train/margins"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    wa = torch.load(live / "LATEST" / "policy.pt", weights_only=False)["state"]
    wb = torch.load(cached / "LATEST" / "policy.pt", weights_only=False)["state"]
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=1e-5)
    run([*common, "precompute_ref_log_probs=true"], tmp_path / "again")
    assert "reusing" in capsys.readouterr().out
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_resuming_a_finished_run_changes_nothing(tmp_path):
    run_dir = run(["n_examples=8", "eval_every=8", "sample_during_eval=false"], tmp_path)
    before = (run_dir / "metrics.jsonl").read_text()
    out = subprocess.run([sys.executable, "train.py", f"resume={run_dir}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Nothing to do: this run is complete (8/8 examples)" in out.stdout
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_a_non_number_or_out_of_range_number_is_one_sentence_before_any_model_loads(tmp_path, monkeypatch):
    """``lr=abc`` reached torch's optimizer after the models loaded (a TypeError traceback)."""
    import utils
    from modeling import models
    from runs import checks

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    for override, message in [
        ("lr=abc", "lr must be a number > 0, got 'abc'; e.g. lr=5e-07."),
        ("lr=0", "lr must be a number > 0, got 0"),
        ("batch_size=0", "batch_size must be a whole number >= 1, got 0"),
        ("n_epochs=1.5", "n_epochs must be a whole number >= 1, got 1.5"),
        ("weight_decay=-0.1", "weight_decay must be a number >= 0, got -0.1"),
    ]:
        with pytest.raises(utils.ConfigError) as e:
            checks.validate_config(compose_config([override]))
        assert str(e.value).startswith(message), str(e.value)


def test_samples_md_is_rewound_with_samples_jsonl(tmp_path):
    # Regression (issue 24): after a resume from step 24, samples.md kept the sections logged after
    # it, and the resumed run wrote them again (samples.jsonl was rewound, samples.md was not).
    rows = [{"step": s, "prompt": f"Q{i}|", "policy": f"p{s}\n", "reference": "r"} for s in (0, 24, 48) for i in range(2)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tracking.rewind_jsonl(str(tmp_path / "samples.jsonl"), 24)
    in_training.write_samples_md(str(tmp_path))
    text = (tmp_path / "samples.md").read_text()
    assert text.count("## after 0 examples") == 1 and text.count("## after 24 examples") == 1
    assert "## after 48" not in text
    assert "| prompt | policy | reference |" in text and "| Q1\\| | p24<br> | r |" in text


def test_a_run_alone_ends_comparing_its_last_eval_with_its_step_0_eval(tmp_path):
    # Regression (fresh-user trial): a run with model.archive ended on a bare "rewards_eval/accuracies: 1", compared with
    # nothing. Hand-made metrics: step 0 accuracy 0.00 and answers 0.50; step 100 accuracy 0.75 and answers 0.90.
    rows = [
        {"step": 0, "rewards_eval/accuracies": 0.0, "answers_eval/arithmetic": 0.5, "answers_eval/n": 20},
        {"step": 50, "loss/train": 0.6},
        {"step": 100, "rewards_eval/accuracies": 0.75, "answers_eval/arithmetic": 0.9, "answers_eval/n": 20},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text("loss:\n  name: dpo\n")
    assert launch.stage_summary(None, str(tmp_path)) == [
        "answers_eval/arithmetic (mean score of the greedy answers to the held-out prompts): 0.50 at the start, "
        "0.90 after dpo (20 prompts).",
        "rewards_eval/accuracies (chosen ranked above rejected, held-out pairs): 0.00 at the start of dpo "
        "(policy = reference: every margin 0; chance 0.5), 0.75 at its end.",
    ]
    (tmp_path / "config.yaml").write_text("loss:\n  name: simpo\n")  # no reference: the start is not margin 0
    assert launch.stage_summary(None, str(tmp_path))[1].endswith("0.00 at the start of simpo (chance 0.5), 0.75 at its end.")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[1:]))  # do_first_eval=false
    assert launch.stage_summary(None, str(tmp_path)) == []
