"""The packed DPO forward (packing.packed_sequence_logps): no padding computed, each prompt
forwarded once per pair. It must give what the plain forward gives: log-probs, token counts,
losses and gradients, checked against each sequence forwarded alone (no padding at all) and
against the padded forward of chosen stacked over rejected that it replaced."""

from __future__ import annotations

import types

import pytest
import torch

import losses
import trainers
from losses import IGNORE_INDEX
from modeling import logprobs, models, packing
from modeling.forward import response_logits
from preference_datasets import collate

transformers = pytest.importorskip("transformers")

VOCAB = 40


def make_model(family: str = "llama", attn: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    elif family == "gpt_neox":
        cfg = transformers.GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
        )
    else:
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=1
        )
    cfg._attn_implementation = attn
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    models.disable_dropout(model)
    return model.train()


def element(prompt: list[int], chosen: list[int], rejected: list[int]) -> dict:
    """One tokenized pair in preference_datasets.tokenize_element's layout."""
    el = {"prompt": "p", "prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
    for side, response in (("chosen", chosen), ("rejected", rejected)):
        el[f"{side}_input_ids"] = prompt + response
        el[f"{side}_attention_mask"] = [1] * (len(prompt) + len(response))
        el[f"{side}_labels"] = [IGNORE_INDEX] * len(prompt) + response
    return el


def random_pairs(lengths: list[tuple[int, int, int]], seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(2, VOCAB, (n,), generator=g).tolist()

    return [element(ids(p), ids(c), ids(r)) for p, c, r in lengths]


def stub(average: bool = False, max_chunks: int | None = None):
    """What BasicTrainer.concatenated_forward reads from the trainer."""
    return types.SimpleNamespace(average_log_prob=average, device=torch.device("cpu"), max_forward_chunks=max_chunks, packed=True)


def forward(model, batch, average=False, max_chunks=None):
    return trainers.BasicTrainer.concatenated_forward(stub(average, max_chunks), model, batch)


def plain(model, batch, average=False):
    """The replaced path: chosen stacked over rejected, padded, one forward."""
    inputs = trainers.concatenated_inputs(batch)
    logits, labels = response_logits(model, inputs)
    logps, n = logprobs.get_batch_logps(logits, labels, average)
    b = batch["chosen_input_ids"].shape[0]
    return logps[:b], logps[b:], n


def alone(model, elements, average=False):
    """The independent reference: every sequence forwarded by itself, no padding, no mask."""
    out = {"chosen": [], "rejected": []}
    counts = {"chosen": [], "rejected": []}
    for el in elements:
        for side in out:
            ids = torch.tensor([el[f"{side}_input_ids"]])
            logits = model(input_ids=ids).logits
            logp, n = logprobs.get_batch_logps(logits, torch.tensor([el[f"{side}_labels"]]), average)
            out[side].append(logp[0])
            counts[side].append(n[0])
    return torch.stack(out["chosen"]), torch.stack(out["rejected"]), torch.stack(counts["chosen"] + counts["rejected"])


def assert_same(a, b, tol=2e-5):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


def grads_of(model, fn) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    chosen, rejected, _ = fn()
    per_example, _, _ = losses.dpo_loss(chosen, rejected, torch.zeros_like(chosen), torch.zeros_like(rejected) - 1.0, beta=0.5)
    per_example.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


# Prompt, chosen, rejected lengths: very different lengths, a batch of 1, equal lengths.
CASES = {
    "mixed": [(5, 7, 3), (12, 2, 30), (3, 40, 41), (20, 1, 1), (8, 9, 9)],
    "very_different": [(2, 1, 1), (60, 70, 2), (1, 3, 90)],
    "batch_of_one": [(6, 4, 9)],
    "equal": [(10, 10, 10)] * 4,
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("average", [False, True])
def test_packed_logps_equal_each_sequence_forwarded_alone(case, average):
    model = make_model()
    elements = random_pairs(CASES[case], seed=len(case))
    batch = collate(elements, pad_token_id=0)
    with torch.no_grad():
        expected = alone(model, elements, average)
        for max_chunks in (None, 1, 2):
            assert_same(forward(model, batch, average, max_chunks), expected)
        assert_same(plain(model, batch, average), expected)


@pytest.mark.parametrize(
    "family,attn", [("llama", "sdpa"), ("llama", "eager"), ("gpt_neox", "sdpa"), ("gpt2", "sdpa"), ("gpt2", "eager")]
)
def test_packed_gradients_equal_padded_forward(family, attn):
    model = make_model(family, attn)
    elements = random_pairs(CASES["mixed"], seed=3)
    batch = collate(elements, pad_token_id=0)
    assert packing.packed_forward_support(model) == (True, True)
    expected = grads_of(model, lambda: plain(model, batch))
    for max_chunks in (None, 1):
        got = grads_of(model, lambda m=max_chunks: forward(model, batch, max_chunks=m))
        for g, e in zip(got, expected):  # float32 noise: relative to each tensor's largest entry
            assert (g - e).abs().max() <= 1e-4 * e.abs().max() + 1e-8
    with torch.no_grad():
        assert_same(forward(model, batch), alone(model, elements))


def test_rows_share_the_common_prefix_and_mixed_rows_go_together():
    # pair 0 shares its prompt and the first response token; pair 1 shares nothing (different
    # first tokens: two plain rows); pair 2: chosen is a prefix of rejected; pair 3: identical
    elements = [
        element([5, 6, 7], [8, 9, 10], [8, 11]),
        {**element([5], [3], [4]), "rejected_input_ids": [6, 4], "rejected_labels": [IGNORE_INDEX, 4]},
        element([9, 9], [3], [3, 4, 5]),
        element([2, 3], [4, 5], [4, 5]),
    ]
    batch = collate(elements, pad_token_id=0)
    rows = packing.pack_preference_rows(batch)
    assert len(rows) == 5
    first = rows[0]
    assert first.ids == [5, 6, 7, 8, 9, 10, 11]  # prompt + 8 once, then 9 10 (chosen), then 11 (rejected)
    assert first.positions == [0, 1, 2, 3, 4, 5, 4]
    assert first.branch == [0, 0, 0, 0, 1, 1, 2]
    # chosen's 8 and rejected's 8 are both predicted at column 2; rejected's 11 at column 3
    assert list(zip(first.target_cols, first.target_ids, first.target_seqs)) == [
        (2, 8, 0),
        (3, 9, 0),
        (4, 10, 0),
        (2, 8, 4),
        (3, 11, 4),
    ]
    assert [r.branch for r in rows[1:3]] == [None, None]
    assert rows[4].ids == [2, 3, 4, 5] and rows[4].branch == [0, 0, 0, 0]
    assert packing.pack_preference_rows(batch, share_prompt=False)[0].branch is None
    model = make_model()
    with torch.no_grad():
        for max_chunks in (None, 1):  # one call holding plain and shared rows together
            assert_same(forward(model, batch, max_chunks=max_chunks), alone(model, elements))


def test_batch_that_is_not_right_padded_takes_the_plain_forward():
    model = make_model()
    elements = random_pairs([(4, 3, 5), (6, 2, 2)], seed=1)
    batch = collate(elements, pad_token_id=0)
    left = dict(batch)
    for side in ("chosen", "rejected"):  # move the padding of row 1 to the left
        for key, pad in (("input_ids", 0), ("attention_mask", 0), ("labels", IGNORE_INDEX)):
            t = batch[f"{side}_{key}"].clone()
            n = int(batch[f"{side}_attention_mask"][1].sum())
            t[1] = torch.cat([torch.full((t.shape[1] - n,), pad), t[1, :n]])
            left[f"{side}_{key}"] = t
    assert packing.pack_preference_rows(left) is None
    assert packing.packed_sequence_logps(model, left, False, "cpu") is None
    with torch.no_grad():
        assert_same(forward(model, left), plain(model, left), tol=0)


@pytest.mark.parametrize("keep_bool,share", [(False, True), (False, False), (True, False)])
def test_without_boolean_logits_to_keep_or_prompt_sharing_the_result_is_the_same(monkeypatch, keep_bool, share):
    # transformers 4.x has no boolean logits_to_keep; flash attention takes no 4-D mask
    model = make_model()
    elements = random_pairs(CASES["mixed"], seed=5)
    batch = collate(elements, pad_token_id=0)
    monkeypatch.setattr(packing, "packed_forward_support", lambda m: (keep_bool, share))
    with torch.no_grad():
        assert_same(forward(model, batch), alone(model, elements))


def test_packed_support_refuses_sliding_windows_and_other_attention():
    model = make_model()
    assert packing.packed_forward_support(model) == (True, True)
    model.config._attn_implementation = "flash_attention_2"
    assert packing.packed_forward_support(model) == (True, False)
    model.config._attn_implementation = "sdpa"
    model.config.sliding_window = 16
    assert packing.packed_forward_support(model) == (True, False)
    assert packing.packed_forward_support(torch.nn.Linear(2, 2)) == (False, False)


@pytest.mark.parametrize(
    "lengths", [[], [7], [3, 3, 3], [10] * 8 + [200] * 8, [5, 90, 17, 200, 64, 64, 3, 150], list(range(1, 130))]
)
@pytest.mark.parametrize("max_chunks", [None, 1, 2, 3])
def test_plan_chunks_takes_every_row_once_in_few_calls(lengths, max_chunks):
    groups = packing.plan_chunks(lengths, max_chunks)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(g for g in groups)
    assert [lengths[i] for i in flat] == sorted(lengths)
    if max_chunks is not None:
        assert len(groups) <= max_chunks
    assert len(groups) <= int(1 / packing.PACKED_CHUNK_COST) + 1


def test_plan_chunks_splits_two_length_modes_and_keeps_equal_lengths_together():
    assert packing.plan_chunks([10] * 8 + [200] * 8) == [list(range(8)), list(range(8, 16))]
    assert packing.plan_chunks([50] * 16) == [list(range(16))]
    with pytest.raises(ValueError):
        packing.plan_chunks([1, 2], max_chunks=0)


def test_gathered_token_logps_and_sum_by_sequence_by_hand():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]], requires_grad=True)
    rows, targets = torch.tensor([0, 0, 1]), torch.tensor([2, 1, 0])
    tok = logprobs.gathered_token_logps(logits, rows, targets)
    lse0 = torch.logsumexp(torch.tensor([0.0, 1.0, 2.0]), 0)
    lse1 = torch.logsumexp(torch.tensor([3.0, 0.0, 0.0]), 0)
    torch.testing.assert_close(tok, torch.stack([2.0 - lse0, 1.0 - lse0, 3.0 - lse1]))
    total, n = logprobs.sum_by_sequence(tok, torch.tensor([0, 2, 2]), 4)
    assert n.tolist() == [1.0, 0.0, 2.0, 0.0]
    torch.testing.assert_close(total, torch.stack([tok[0], torch.tensor(0.0), tok[1] + tok[2], torch.tensor(0.0)]))
    mean, _ = logprobs.sum_by_sequence(tok, torch.tensor([0, 2, 2]), 4, average_log_prob=True)
    assert torch.isfinite(mean).all() and mean[1].item() == 0.0
    total.sum().backward()
    assert torch.isfinite(logits.grad).all()
    with pytest.raises(ValueError):
        logprobs.gathered_token_logps(logits[0], rows, targets)


def test_bf16_logits_give_float32_logps():
    logits = torch.randn(4, 7).bfloat16()
    out = logprobs.gathered_token_logps(logits, torch.tensor([0, 3]), torch.tensor([1, 6]))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.log_softmax(logits.float(), -1)[[0, 3], [1, 6]])


def test_fsdp_trainer_makes_one_forward_call_per_batch():
    assert trainers.FSDPTrainer.max_forward_chunks == 1
    assert trainers.BasicTrainer.max_forward_chunks is None
    assert trainers.TensorParallelTrainer.max_forward_chunks is None  # every rank sees the same batch


def _trainer(tmp_path, overrides):
    """A BasicTrainer on the tiny default (tests/test_train.py's build_trainer)."""
    from test_train import build_trainer

    return build_trainer(overrides, tmp_path)


def _first_batch(trainer):
    from preference_datasets import get_batch_iterator

    c = trainer.config
    batches = get_batch_iterator(
        trainer.train_examples, trainer.tokenizer, c.batch_size, c.max_length, c.max_prompt_length, seed=c.seed, n_epochs=1
    )
    return next(iter(batches))


@pytest.mark.parametrize("loss", ["dpo", "ipo"])
def test_train_step_equals_the_padded_forward_step(tmp_path, monkeypatch, loss):
    packed = _trainer(tmp_path / "a", [f"loss={loss}", "do_first_eval=false"])
    batch = _first_batch(packed)
    packed_metrics = packed.train_step(batch)
    monkeypatch.setattr(trainers.BasicTrainer, "packed", False)  # the padded forward of chosen over rejected
    padded = _trainer(tmp_path / "b", [f"loss={loss}", "do_first_eval=false"])
    padded_metrics = padded.train_step(batch)
    for key in ("loss/train", "logps_train/chosen", "logps_train/rejected", "grad_norm"):
        torch.testing.assert_close(torch.tensor(packed_metrics[key]), torch.tensor(padded_metrics[key]), rtol=1e-5, atol=1e-5)
    # AdamW moves every coordinate by about lr (1e-3 here) whatever its gradient's size, so a
    # coordinate whose gradient is float noise may differ by a little of that
    for p, q in zip(packed.policy.parameters(), padded.policy.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=2e-5)


def test_sft_does_not_take_the_pairs_forward(tmp_path, monkeypatch):
    """SFT trains on the chosen rows alone (packed as single sequences), never on pairs."""
    trainer = _trainer(tmp_path, ["loss=sft", "do_first_eval=false"])

    def refuse(*args, **kwargs):
        raise AssertionError("SFT must not call the DPO pairs' forward")

    monkeypatch.setattr(trainers, "packed_sequence_logps", refuse)
    metrics = trainer.train_step(_first_batch(trainer))
    assert all(torch.isfinite(torch.tensor(v)).all() for v in metrics.values())
