"""LoRA through peft (``model.lora.*``, issue 14): the reference is the policy with its adapters
off, checkpoints hold the adapters and their optimizer state, resume is exact, the export is an
adapter folder (``PeftModel.from_pretrained``) and on request a merged model
(``AutoModelForCausalLM.from_pretrained``); with ``model.archive``, online DPO, FSDP over 2
processes, Ray and activation checkpointing; what cannot combine is one sentence.

Expected values come from models loaded here on their own (the base by ``models.load_model`` with
the run's seed, the adapters by peft directly) and log-probs by the formula, never from the
trainer's own code path.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, compose_config, metric_records, needs_shared, run_train
from omegaconf import OmegaConf
from test_distributed import COMMON, assert_resumes_exactly_from_step_32, assert_same_run, cli, finished_run, weights

import losses
import train
import trainers
import utils
from data.loading import load_examples
from modeling import loading, models
from runs import checkpoints, checks, reference_cache
from runs.overrides import override_error

LORA = ["model.lora.r=8"]
# the tiny Llama: 2 blocks of q, k, v, o, gate, up and down projections, each with lora_A and lora_B
N_ADAPTER_TENSORS = 2 * 7 * 2


def hand_logps(model, batch: dict, side: str) -> torch.Tensor:
    """sum_t log p(y_t | y_<t, x) over the labelled tokens of ``side``, from one plain padded forward."""
    ids, mask, labels = (batch[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "labels"))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    targets = labels[:, 1:]
    picked = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (targets != losses.IGNORE_INDEX)).sum(-1)


def base_model(config):
    """The run's base on its own: the model ``model.*`` describes, seeded as the run seeds it."""
    tokenizer = models.load_tokenizer(config.model)
    return models.load_model(config.model, tokenizer, torch.float32, config.seed).eval()


def trained_policy(run_dir: Path, base=None):
    """The run's final policy rebuilt with peft itself: its base plus the adapters of LATEST/policy.pt."""
    import peft

    config = OmegaConf.load(run_dir / "config.yaml")
    base = base_model(config) if base is None else base
    lora = config.model.lora
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    model = peft.get_peft_model(base, peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=targets))
    missing, unexpected = model.get_base_model().load_state_dict(weights(run_dir), strict=False)
    assert not unexpected and not [k for k in missing if ".lora_" in k]
    return model.eval()


def sample_ids() -> torch.Tensor:
    return torch.tensor([[3, 55, 56, 46, 58, 64, 13, 68, 61, 34], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def loaded_models(config, tokenizer) -> tuple[torch.nn.Module, torch.nn.Module | None, int]:
    """``loading.load_models`` on one process, and how many models it loaded (``models.load_model`` calls)."""
    loaded = []
    real = models.load_model
    with pytest.MonkeyPatch.context() as m:
        m.setattr(models, "load_model", lambda *a, **k: loaded.append(1) or real(*a, **k))
        policy, reference = loading.load_models(config, tokenizer, 0, False)
    return policy, reference, len(loaded)


def lora_trainer(tmp_path: Path, overrides: list[str]) -> tuple[trainers.BasicTrainer, int]:
    """A BasicTrainer on the tiny model built as train.main builds it (``loading.load_models``), and
    how many models were loaded for it."""
    config = compose_config([*TINY, f"output_root={tmp_path}", *overrides])
    OmegaConf.resolve(config)
    checks.validate_config(config)
    utils.set_threads(config.num_threads)
    tokenizer = models.load_tokenizer(config.model)
    options = OmegaConf.to_container(config.data)
    train_examples = load_examples(list(config.datasets), "train", options, False, silent=True)
    eval_examples = load_examples(list(config.datasets), "test", options, False, silent=True)
    policy, reference, loaded = loaded_models(config, tokenizer)
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    trainer = trainers.BasicTrainer(policy, config, str(tmp_path / "run"), tokenizer, train_examples, eval_examples, reference)
    return trainer, loaded


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """One LoRA DPO run of the tiny model (48 examples, checkpoints at 24 and 48, samples at each
    eval, the adapter and merged exports), and the number of models it loaded."""
    out = tmp_path_factory.mktemp("lora")
    loaded = []
    real = models.load_model
    with pytest.MonkeyPatch.context() as m:
        m.setattr(models, "load_model", lambda *a, **k: loaded.append(1) or real(*a, **k))
        run_dir = run_train([*LORA, "model.lora.export_merged=true", "sample_during_eval=true"], out)
    return run_dir, len(loaded)


# ----------------------------------------------------------------------------- config


def test_the_lora_block_composes_with_every_model_yaml_and_from_the_command_line():
    for yaml in sorted(p.stem for p in (Path(checks.CONFIG_DIR) / "model").glob("*.yaml")):
        extra = ["model.name_or_path=some/model"] if yaml == "blank_model" else []
        lora = compose_config([f"model={yaml}", *extra]).model.lora
        assert OmegaConf.to_container(lora) == {
            "r": None,
            "alpha": 32,
            "dropout": 0.05,
            "target_modules": "all-linear",
            "export_merged": False,
            "vision": False,
        }, yaml
    overrides = ["model.lora.r=16", "model.lora.target_modules=[q_proj,v_proj]"]
    assert override_error(overrides) is None
    config = compose_config(overrides)
    assert config.model.lora.r == 16 and list(config.model.lora.target_modules) == ["q_proj", "v_proj"]
    assert config.model.config.model_type == "llama"  # the tiny model's own keys are still there
    checks.validate_config(config)
    assert "did you mean model.lora.r?" in override_error(["model.lora.rr=16"])


# ----------------------------------------------------------------------------- the reference is the base


def test_the_reference_is_the_base_with_adapters_off_and_only_the_adapters_train(tmp_path):
    trainer, n_loaded = lora_trainer(tmp_path, LORA)
    assert n_loaded == 1 and trainer.reference_model is None  # no second model
    config = compose_config(TINY)
    _, plain_reference, n_plain = loaded_models(config, models.load_tokenizer(config.model))
    assert n_plain == 2 and plain_reference is not None  # what the count counts, without LoRA: policy and reference
    policy = trainer.policy
    base = base_model(trainer.config)  # loaded on its own
    batch = trainer.eval_batches[0]
    before = trainer.concatenated_forward(policy, batch)[:2]
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters() if ".lora_" not in n}
    adapters = {n: p.detach().clone() for n, p in policy.named_parameters() if ".lora_" in n}
    assert len(adapters) == N_ADAPTER_TENSORS and trainer.trainable_names == set(adapters)

    # one backward: gradients reach the adapters and nothing else
    n_tokens = float((batch["chosen_labels"] != losses.IGNORE_INDEX).sum())
    loss, _ = trainer.get_batch_metrics(batch, len(batch["prompt"]), n_tokens, "train")
    loss.backward()
    for name, p in policy.named_parameters():
        assert (p.grad is not None) == (".lora_" in name), name
    assert any(p.grad.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)
    trainer.optimizer.zero_grad(set_to_none=True)
    for batch_ in list(trainers.get_batch_iterator(trainer.train_examples, trainer.tokenizer, 8, 64, 32, seed=0, n_examples=24)):
        trainer.train_step(batch_)

    for name, p in policy.named_parameters():
        if name in frozen:
            assert torch.equal(p.detach(), frozen[name]), name  # the base never moves
    assert all(not torch.equal(p.detach(), adapters[n]) for n, p in policy.named_parameters() if "lora_B" in n)
    policy.train()
    reference = trainer.reference_logps(batch)
    for i, side in enumerate(("chosen", "rejected")):
        by_hand = hand_logps(base, batch, side)
        torch.testing.assert_close(reference[i], by_hand, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(reference[i], before[i], rtol=0, atol=1e-5)  # the frozen starting policy's
    after = trainer.concatenated_forward(policy, batch)[:2]
    assert (after[0] - reference[0]).abs().max() > 1e-3  # the trained adapters are on for the policy
    assert policy.training and trainer.peft_model.get_model_status().enabled is True  # mode and adapters are back


def test_activation_checkpointing_gives_the_adapters_the_same_gradients(tmp_path):
    grads = {}
    for checkpointing in (False, True):
        trainer, _ = lora_trainer(tmp_path / str(checkpointing), [*LORA, f"activation_checkpointing={checkpointing}"])
        trainer.policy.train()
        batch = trainer.eval_batches[0]
        n_tokens = float((batch["chosen_labels"] != losses.IGNORE_INDEX).sum())
        torch.manual_seed(1)  # the same LoRA dropout masks (the checkpoint replays the RNG)
        loss, _ = trainer.get_batch_metrics(batch, len(batch["prompt"]), n_tokens, "train")
        loss.backward()
        grads[checkpointing] = {n: p.grad.clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}
        assert any(getattr(m, "gradient_checkpointing", False) for m in trainer.policy.modules()) == checkpointing
    assert set(grads[True]) == set(grads[False]) and len(grads[True]) == N_ADAPTER_TENSORS
    assert all(grads[True][n].abs().sum() > 0 for n in grads[True] if "lora_B" in n)
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_merged_export_leaves_the_live_policy_untouched(tmp_path):
    # peft 0.22 merges into the base layers in place; the export's base layers shared the live policy's storage, so every
    # checkpoint with export_merged added the adapters to the policy's base (and to its adapters-off reference)
    from export import hf

    trainer, _ = lora_trainer(tmp_path, [*LORA, "model.lora.export_merged=true", "save_hf_export=true"])
    with torch.no_grad():
        for name, p in trainer.policy.named_parameters():
            if "lora_B" in name:
                p.fill_(0.5)  # a non-zero update to merge
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    assert hf.write_hf_export(trainer, str(tmp_path / "checkpoint")) is None
    assert (tmp_path / "checkpoint" / "hf" / "merged").is_dir()
    after = trainer.policy.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def test_a_lora_run_starts_at_ln2_loads_one_model_and_precompute_gives_the_live_run(lora_run, tmp_path):
    run_dir, n_loaded = lora_run
    assert n_loaded == 1
    rows = metric_records(run_dir)
    first = next(r for r in rows if "loss/eval" in r)
    assert first["loss/eval"] == pytest.approx(math.log(2), abs=1e-6)  # LoRA's B starts at 0: policy == reference
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert {"policy", "reference"} <= set(samples[0])  # the reference samples too (adapters off)

    pre_args = ["model.lora.export_merged=true", "precompute_ref_log_probs=true", "sample_during_eval=true"]
    pre = run_train([*LORA, *pre_args, f"cache_dir={tmp_path}"], tmp_path)  # samples as lora_run does: same RNG draws
    live_evals = [r for r in rows if "loss/eval" in r]
    pre_evals = [r for r in metric_records(pre) if "loss/eval" in r]
    assert len(live_evals) == len(pre_evals) == 3
    for a, b in zip(live_evals, pre_evals):
        assert b["loss/eval"] == pytest.approx(a["loss/eval"], abs=1e-5)
    for name, value in weights(run_dir).items():
        torch.testing.assert_close(weights(pre)[name], value, rtol=0, atol=1e-5)
    # the cache is named by the base's weights: the file a full fine-tuning run of this base uses
    config = compose_config(LORA)
    tokenizer = models.load_tokenizer(config.model)
    lora_policy = models.apply_lora(models.load_model(config.model, tokenizer, torch.float32, 0), config.model.lora)
    plain = models.load_model(config.model, tokenizer, torch.float32, 0)
    examples = load_examples(["arithmetic"], "test", {"arithmetic": {"n_train": 8, "n_test": 8}}, False, silent=True)
    path = reference_cache.reference_cache_path(lora_policy, examples, tokenizer, config, "c")
    assert path == reference_cache.reference_cache_path(plain, examples, tokenizer, config, "c")


# ----------------------------------------------------------------------------- checkpoints and exports


def test_checkpoints_hold_the_adapters_and_their_optimizer_and_resume_exactly(lora_run, tmp_path):
    run_dir, _ = lora_run
    saved = torch.load(run_dir / "LATEST" / "policy.pt", weights_only=False)
    assert len(saved["state"]) == N_ADAPTER_TENSORS and all(".lora_" in k for k in saved["state"])  # no frozen base
    assert saved["lora"]["r"] == 8
    optimizer = torch.load(run_dir / "LATEST" / "optimizer.pt", weights_only=False)["state"]
    assert len(optimizer["state"]) == N_ADAPTER_TENSORS  # AdamW's moments of the adapters alone

    cut = tmp_path / "cut" / run_dir.name  # cut back to the checkpoint after 24 examples, then resumed
    shutil.copytree(run_dir, cut, symlinks=True)
    shutil.rmtree(cut / "step-48")
    (cut / "LATEST").unlink()
    (cut / "LATEST").symlink_to("step-24")
    (cut / checkpoints.FINISHED).unlink()
    train.main(compose_config([f"resume={cut}"]))
    for name, value in weights(run_dir).items():
        torch.testing.assert_close(weights(cut)[name], value, rtol=0, atol=1e-6, msg=name)
    resumed = torch.load(cut / "LATEST" / "optimizer.pt", weights_only=False)["state"]
    for index, moments in optimizer["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(resumed["state"][index][key], moments[key], rtol=0, atol=1e-7)


def test_the_adapter_export_loads_with_peft_and_the_merged_one_with_transformers_giving_the_trained_logits(lora_run):
    import peft
    from transformers import AutoModelForCausalLM

    run_dir, _ = lora_run
    hf = run_dir / "LATEST" / "hf"
    config = OmegaConf.load(run_dir / "config.yaml")
    ids = sample_ids()
    expected = logits(trained_policy(run_dir), ids)
    assert (expected - logits(base_model(config), ids)).abs().max() > 1e-3  # the adapters have learned something
    assert not (hf / "model.safetensors").exists()  # the frozen base is not exported again
    adapter_config = json.loads((hf / "adapter_config.json").read_text())
    assert adapter_config["r"] == 8 and adapter_config["base_model_name_or_path"] is None  # a random base
    loaded = peft.PeftModel.from_pretrained(base_model(config), hf).eval()
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=1e-5, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(hf / "merged").eval()
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(logits(merged, ids), expected, rtol=1e-5, atol=1e-5)


def test_lora_on_an_archive_starts_from_its_weights_and_the_export_names_it_as_the_base(lora_run, tmp_path):
    from peft import AutoPeftModelForCausalLM

    stories = needs_shared("models", "stories260K")
    common = ["model=blank_model", f"model.name_or_path={stories}", "sample_during_eval=false", "lr=1e-3"]
    common += ["n_examples=16", "eval_every=16"]
    sft = run_train([*common, "loss=sft", "exp_name=sft"], tmp_path)
    archive = sft / "LATEST" / "policy.pt"
    dpo = run_train([*common, *LORA, f"model.archive={archive}", "exp_name=dpo"], tmp_path)
    sft_last = [r for r in metric_records(sft) if "loss/eval" in r][-1]
    first = next(r for r in metric_records(dpo) if "loss/eval" in r)
    assert first["loss/eval"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["logps_eval/chosen"] == pytest.approx(sft_last["logps_eval/chosen"], rel=1e-5)  # the archive's weights
    # the adapter folder names the archive's own export as its base, so peft loads both from it
    adapter_config = json.loads((dpo / "LATEST" / "hf" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str((sft / "LATEST").resolve() / "hf")
    from transformers import AutoModelForCausalLM

    expected = logits(trained_policy(dpo, AutoModelForCausalLM.from_pretrained(sft / "LATEST" / "hf")), sample_ids())
    loaded = AutoPeftModelForCausalLM.from_pretrained(dpo / "LATEST" / "hf").eval()
    torch.testing.assert_close(logits(loaded, sample_ids()), expected, rtol=1e-5, atol=1e-5)
    # a LoRA run's policy.pt holds adapters alone: as an archive it is one sentence
    adapters_only = lora_run[0] / "LATEST" / "policy.pt"
    with pytest.raises(utils.ConfigError, match="holds only the LoRA adapters of a run with model.lora.r set"):
        run_train([f"model.archive={adapters_only}"], tmp_path / "refused")


# ----------------------------------------------------------------------------- online DPO


def test_online_dpo_with_lora_samples_with_the_adapters_on_and_references_the_base(tmp_path, monkeypatch):
    from test_online import ONLINE, save_tiny_reward_model

    from online import trainer as online

    enabled_when_sampling = []
    real = online.OnlineSampling.sample_completions

    def sample_completions(self, batch, n):
        enabled_when_sampling.append(self.peft_model.get_model_status().enabled)
        return real(self, batch, n)

    monkeypatch.setattr(online.OnlineSampling, "sample_completions", sample_completions)
    rm = save_tiny_reward_model(tmp_path / "rm")
    # LoRA dropout 0: the KL to the reference then comes from the trained adapters alone
    overrides = [*ONLINE, *LORA, "model.lora.dropout=0", f"reward_model.name_or_path={rm}", "n_examples=24", "eval_every=8"]
    run_dir = run_train(overrides, tmp_path / "o")
    assert enabled_when_sampling and all(e is True for e in enabled_when_sampling)
    train_rows = [r for r in metric_records(run_dir) if "objective/kl" in r]
    assert train_rows[0]["objective/kl"] == 0.0  # step 0: policy (B = 0) and base agree exactly
    assert abs(train_rows[-1]["objective/kl"]) > 1e-4  # trained adapters: the policy leaves the base, the reference does not
    assert (run_dir / checkpoints.FINISHED).exists()


# ----------------------------------------------------------------------------- FSDP and Ray

FSDP_LORA = [*COMMON, *LORA, "model.lora.dropout=0", "sample_during_eval=false"]  # dropout 0: ranks see other micro-batches
FSDP_LORA += ["model.lora.export_merged=true"]  # rank 0 gathers the frozen base too, for hf/merged


@pytest.fixture(scope="module")
def basic_lora_run(tmp_path_factory) -> Path:
    """What FSDP and Ray must reproduce: BasicTrainer with LoRA, 64 examples, checkpoints at 32 and 64."""
    return finished_run(FSDP_LORA, tmp_path_factory.mktemp("basic-lora"))


def test_fsdp_with_lora_on_two_processes_equals_basic_and_resumes_exactly(basic_lora_run, tmp_path):
    import peft

    run_dir = finished_run([*FSDP_LORA, "trainer=FSDPTrainer", "world_size=2"], tmp_path / "fsdp")
    assert_same_run(basic_lora_run, run_dir)  # eval losses, log-probs and the adapters (policy.pt)
    assert len(weights(run_dir)) == N_ADAPTER_TENSORS
    assert_resumes_exactly_from_step_32(run_dir, tmp_path)  # from the adapters' shards and their optimizer's
    from transformers import AutoModelForCausalLM

    config, ids = OmegaConf.load(run_dir / "config.yaml"), sample_ids()
    expected = logits(trained_policy(run_dir), ids)
    loaded = peft.PeftModel.from_pretrained(base_model(config), run_dir / "LATEST" / "hf").eval()  # rank 0's export
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=1e-5, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "LATEST" / "hf" / "merged").eval()
    torch.testing.assert_close(logits(merged, ids), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(420)
def test_ray_with_lora_on_two_workers_equals_basic(basic_lora_run, tmp_path_factory, monkeypatch):
    pytest.importorskip("ray.train.torch", reason="launcher=ray needs Ray Train: pip install -r requirements-ray.txt")
    from test_ray import TOKEN_FILE, ray_environment

    base = tmp_path_factory.mktemp("r")  # short: Ray's socket paths must stay under 107 characters
    ray_environment(monkeypatch, base)
    token_existed = TOKEN_FILE.exists()
    args = [*FSDP_LORA, "trainer=FSDPTrainer", "launcher=ray", "ray.num_workers=2", "ray.num_cpus=2"]
    code, text = cli(args, base / "out", timeout=360)
    assert code == 0, text[-4000:]
    assert_same_run(basic_lora_run, next((base / "out").iterdir()))
    assert token_existed or not TOKEN_FILE.exists()


# ----------------------------------------------------------------------------- what cannot combine


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.lora.r=0"], r"model.lora.r must be a whole number >= 1 \(the adapters' rank, e.g. 16\) or null, got 0"),
        (["model.lora.r=8", "model.lora.alpha=0"], "model.lora.alpha must be a number > 0"),
        (["model.lora.r=8", "model.lora.dropout=1"], r"model.lora.dropout must be a number in \[0, 1\)"),
        (["model.lora.r=8", "model.lora.target_modules=q_proj"], "must be all-linear or a list of module names"),
        (["model.lora.r=8", "model.lora.export_merged=yes"], "model.lora.export_merged must be true or false"),
        (["model.lora.r=8", "loss=reward"], "not loss=reward's score head; set model.lora.r=null"),
        (["model.lora.r=8", "trainer=TensorParallelTrainer"], "model.lora does not work with tensor parallelism"),
        (["model.lora.r=8", "reference_update.mode=soft"], "with model.lora the reference is the frozen base"),
        (["model.lora.r=8", "launcher=ray", "ray.reference_workers=1"], "set ray.reference_workers=0"),
        (["model.lora.r=8", "model.reference_dtype=bfloat16"], "set model.reference_dtype=null"),
    ],
)
def test_what_cannot_combine_with_lora_is_one_sentence_before_any_model_loads(overrides, message, tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", no_model)
    with pytest.raises(utils.ConfigError, match=message) as caught:
        train.main(compose_config([*TINY, f"output_root={tmp_path}", *overrides]))
    assert "\n" not in str(caught.value) and str(caught.value).endswith(".")
    assert not any(tmp_path.iterdir())  # no run folder


def test_tensor_parallel_inside_fsdp_and_a_missing_peft_are_refused(monkeypatch):
    with pytest.raises(utils.ConfigError, match="model.lora does not work with tensor parallelism"):
        checks.validate_config(compose_config([*LORA, "trainer=FSDPTrainer", "tensor_parallel_size=2", "batch_size=4"]), 2)
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(utils.ConfigError, match="the peft library is not installed; pip install -r requirements.txt"):
        checks.validate_config(compose_config(LORA))


def test_target_modules_the_model_lacks_are_one_sentence_naming_its_layers_and_leave_no_run_folder(tmp_path):
    with pytest.raises(utils.ConfigError) as caught:  # train.hydra_main prints it as one "Error:" line, exit 2
        run_train([*LORA, "model.lora.target_modules=[query_key_value]"], tmp_path)
    text = str(caught.value)
    assert "\n" not in text and text.startswith(
        "model.lora.target_modules=[query_key_value] matches no module of LlamaForCausalLM"
    )
    assert text.endswith(
        "its linear layers are named down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj: name some of them, or all-linear."
    )
    assert not any(tmp_path.iterdir())
