"""The chunked output layer (packing.output_layer_logps, config ``output_layer_chunk``): log-probs
taken from the last hidden states a few positions at a time, never the logits of a whole
forward call, with the backward recomputing each chunk. It must give what the unchunked path
gives (log-probs and gradients, float64 here so that only reduction order differs) for DPO
(shared prompt and not, packed and padded), SFT (now packed, without padding), the reference
(no gradient) and KTO's single sequences, on every family the repository trains, under FSDP and
tensor parallelism, with activation checkpointing, and with tied embeddings.
"""

from __future__ import annotations

import collections
import math
import os
import types

import pytest
import torch
from conftest import compose_config, needs_shared

import trainers
import utils
from losses import IGNORE_INDEX
from modeling import forward, logprobs, models, packing
from preference_datasets import collate
from runs import checks

transformers = pytest.importorskip("transformers")

VOCAB = 40


def family_config(family: str):
    """A tiny random config of ``family`` (hidden 32, 2 layers, 40-entry vocabulary)."""
    t = transformers
    small = dict(vocab_size=VOCAB, num_hidden_layers=2, num_attention_heads=4)
    llama_like = dict(small, hidden_size=32, intermediate_size=64, num_key_value_heads=2)
    return {
        "llama": lambda: t.LlamaConfig(**llama_like),
        "qwen2": lambda: t.Qwen2Config(**llama_like),
        "mistral": lambda: t.MistralConfig(**llama_like, sliding_window=None),
        "phi3": lambda: t.Phi3Config(**llama_like, pad_token_id=0),
        "gpt_neox": lambda: t.GPTNeoXConfig(**small, hidden_size=32, intermediate_size=64),
        "gpt2": lambda: t.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, bos_token_id=1, eos_token_id=1
        ),
        "gptj": lambda: t.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, rotary_dim=4),
        "opt": lambda: t.OPTConfig(**small, hidden_size=32, ffn_dim=64, word_embed_proj_dim=32),
        "phi": lambda: t.PhiConfig(**small, hidden_size=32, intermediate_size=64),
        "falcon": lambda: t.FalconConfig(**small, hidden_size=32),
        # families whose forward changes the logits after the output layer
        "gemma2": lambda: t.Gemma2Config(**llama_like, head_dim=8, final_logit_softcapping=2.0),
        "cohere": lambda: t.CohereConfig(**llama_like, logit_scale=0.5),
    }[family]()


FAMILIES = ["llama", "qwen2", "mistral", "phi3", "gpt_neox", "gpt2", "gptj", "opt", "phi", "falcon", "stories260K"]


def make_model(family: str = "llama", seed: int = 0, dtype=torch.float64):
    """A random tiny model of ``family`` (stories260K: the real pretrained one, tied embeddings,
    its 512-entry vocabulary) in ``dtype``, dropout off, in train mode."""
    torch.manual_seed(seed)
    if family == "stories260K":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            needs_shared("models", "stories260K"), attn_implementation="sdpa"
        )
    else:
        attn = "eager" if family == "gemma2" else "sdpa"
        model = transformers.AutoModelForCausalLM.from_config(family_config(family), attn_implementation=attn)
    models.disable_dropout(model)
    return model.to(dtype).train()


def element(prompt: list[int], chosen: list[int], rejected: list[int], rejected_prompt: list[int] | None = None) -> dict:
    """One tokenized pair in preference_datasets.tokenize_element's layout; ``rejected_prompt``
    (another first token) makes a pair that shares no prefix."""
    el = {"prompt": "p", "prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
    for side, response in (("chosen", chosen), ("rejected", rejected)):
        p = rejected_prompt if side == "rejected" and rejected_prompt is not None else prompt
        el[f"{side}_input_ids"] = p + response
        el[f"{side}_attention_mask"] = [1] * (len(p) + len(response))
        el[f"{side}_labels"] = [IGNORE_INDEX] * len(p) + response
    return el


def random_elements(seed: int = 0) -> list[dict]:
    """Four pairs: three share their prompt (of very different lengths), one shares nothing."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(2, VOCAB, (n,), generator=g).tolist()

    out = [element(ids(p), ids(c), ids(r)) for p, c, r in [(5, 7, 3), (12, 2, 20), (3, 11, 13)]]
    prompt = ids(4)
    out.append(element(prompt, ids(6), ids(5), rejected_prompt=[(prompt[0] + 1) % VOCAB or 2] + prompt[1:]))
    return out


ELEMENTS = random_elements()
N_TARGETS = sum(len(r) for el in ELEMENTS for r in (el["chosen_labels"], el["rejected_labels"])) - sum(
    el[f"{side}_labels"].count(IGNORE_INDEX) for el in ELEMENTS for side in ("chosen", "rejected")
)


def stub(chunk, average: bool = False, max_chunks: int | None = None):
    """What BasicTrainer.concatenated_forward / one_side_logps read from the trainer."""
    return types.SimpleNamespace(
        average_log_prob=average,
        device=torch.device("cpu"),
        max_forward_chunks=max_chunks,
        output_layer_chunk=chunk,
        packed=True,
    )


def dpo(model, batch, chunk, average=False, max_chunks=None):
    return trainers.BasicTrainer.concatenated_forward(stub(chunk, average, max_chunks), model, batch)


def one_side(model, rows, chunk, average=False, max_chunks=None):
    return trainers.BasicTrainer.one_side_logps(stub(chunk, average, max_chunks), model, rows)


def chosen_rows(batch: dict) -> dict:
    return {k: batch[f"chosen_{k}"] for k in ("input_ids", "attention_mask", "labels")}


def padded_sft(model, rows, average=False):
    """SFT's forward before this change: the padded batch, all its logits at once."""
    logits, labels = forward.response_logits(model, rows)
    return logprobs.get_batch_logps(logits, labels, average)


def by_hand(model, elements, sides=("chosen", "rejected")) -> torch.Tensor:
    """Independent log-probs: each sequence forwarded alone, full logits, log_softmax, gather of
    the next token at every labelled position; chosen of all pairs, then rejected."""
    out = []
    for side in sides:
        for el in elements:
            ids, labels = el[f"{side}_input_ids"], el[f"{side}_labels"]
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            out.append(sum(logp[t - 1, labels[t]] for t in range(1, len(ids)) if labels[t] != IGNORE_INDEX))
    return torch.stack(out)


def grads(model, fn) -> list[torch.Tensor]:
    """Gradients of a weighted sum of ``fn()``'s first output(s), one per parameter (zeros for none)."""
    model.zero_grad(set_to_none=True)
    out = fn()
    values = torch.cat([o for o in out[:-1]]) if isinstance(out, tuple) and len(out) == 3 else out[0]
    weights = torch.linspace(-1.0, 2.0, len(values), dtype=values.dtype)
    (values * weights).sum().backward()
    result = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return result


def assert_close_all(got, expected, tol=1e-9):
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- chunked == unchunked


def test_the_batch_needs_several_chunks_not_dividing_its_positions():
    assert N_TARGETS > 7 and N_TARGETS % 3 and N_TARGETS % 7, N_TARGETS


@pytest.mark.parametrize("family", FAMILIES)
def test_dpo_chunked_equals_unchunked_logps_and_gradients(family):
    model = make_model(family)
    if family == "stories260K":
        assert model.lm_head.weight is model.model.embed_tokens.weight  # the tied case
    assert packing.packed_forward_support(model) == (True, True)
    batch = collate(ELEMENTS, pad_token_id=0)
    expected = grads(model, lambda: dpo(model, batch, None))
    for chunk in (3, 7):
        assert_close_all(grads(model, lambda c=chunk: dpo(model, batch, c)), expected)
    with torch.no_grad():
        want = dpo(model, batch, None)
        for chunk, max_chunks in ((3, None), (7, 1), (1, 2)):
            assert_close_all(dpo(model, batch, chunk, max_chunks=max_chunks), want)
            assert_close_all(dpo(model, batch, chunk, average=True), dpo(model, batch, None, average=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_is_packed_and_chunked_with_the_padded_forwards_values_and_gradients(family):
    model = make_model(family)
    rows = chosen_rows(collate(ELEMENTS, pad_token_id=0))
    assert packing.pack_single_rows(rows) is not None  # the packed rows, not the padded fallback
    for average in (False, True):
        with torch.no_grad():
            want_logps, want_n = padded_sft(model, rows, average)
            for chunk in (None, 3, 7):
                logps, n = one_side(model, rows, chunk, average)
                torch.testing.assert_close(logps, want_logps, rtol=1e-9, atol=1e-9)
                assert n.tolist() == want_n.tolist() == [7.0, 2.0, 11.0, 6.0]  # the chosen responses' lengths
    expected = grads(model, lambda: padded_sft(model, rows))
    for chunk in (None, 3):
        assert_close_all(grads(model, lambda c=chunk: one_side(model, rows, c)), expected)


def test_a_call_with_no_target_gives_no_log_probs_and_still_calls_the_head_once():
    # An IndexError before: the chunk bounds assumed at least one position. The head is still called (on
    # nothing) because under FSDP every rank must run its all-gather.
    calls = []
    head = torch.nn.Linear(4, 5, bias=False)
    head.register_forward_hook(lambda module, args, out: calls.append(tuple(args[0].shape)))
    none = torch.zeros(0, dtype=torch.long)
    hidden = torch.randn(1, 3, 4, requires_grad=True)
    logps = packing.ChunkedOutputLayer(head, none, none, chunk=2)(hidden)
    assert (logps.shape, logps.dtype, calls) == ((0,), torch.float32, [(0, 4)])
    logps.sum().backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))


def test_log_probs_equal_a_full_log_softmax_gather_written_here():
    model = make_model("llama")
    batch = collate(ELEMENTS, pad_token_id=0)
    with torch.no_grad():
        want = by_hand(model, ELEMENTS)
        chosen, rejected, n = dpo(model, batch, 3)
        torch.testing.assert_close(torch.cat([chosen, rejected]), want, rtol=1e-9, atol=1e-9)
        sft, _ = one_side(model, chosen_rows(batch), 3)
        torch.testing.assert_close(sft, want[: len(ELEMENTS)], rtol=1e-9, atol=1e-9)
        # the padded fallback (a left-padded batch is not packed) gives them too
        padded, _ = forward.response_logps(model, left_padded(chosen_rows(batch)), chunk=3)
        torch.testing.assert_close(padded, want[: len(ELEMENTS)], rtol=1e-9, atol=1e-9)


def left_padded(rows: dict) -> dict:
    """``rows`` with each row's padding moved to its left."""
    out = {}
    lengths = rows["attention_mask"].sum(1).tolist()
    for key, pad in (("input_ids", 0), ("attention_mask", 0), ("labels", IGNORE_INDEX)):
        t = rows[key].clone()
        for i, n in enumerate(lengths):
            t[i] = torch.cat([torch.full((t.shape[1] - n,), pad), rows[key][i, :n]])
        out[key] = t
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_padded_fallback_chunked_equals_unchunked(family):
    model = make_model(family)
    batch = collate(ELEMENTS, pad_token_id=0)
    rows = left_padded(chosen_rows(batch))
    assert packing.pack_single_rows(rows) is None  # not right-padded: the padded forward
    expected = grads(model, lambda: forward.response_logps(model, rows, chunk=None))
    assert_close_all(grads(model, lambda: forward.response_logps(model, rows, chunk=3)), expected)
    assert_close_all(grads(model, lambda: one_side(model, rows, 3)), expected)
    pairs = {f"{side}_{k}": v for side in ("chosen", "rejected") for k, v in left_padded(chosen_rows(batch)).items()}
    with torch.no_grad():
        assert_close_all(dpo(model, pairs, 3), dpo(model, pairs, None))


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_reference_path_is_chunked_without_checkpoint(family, monkeypatch):
    # The reference (and precompute_reference) call concatenated_forward under no_grad: chunks,
    # and nothing kept for a backward (no checkpoint, nothing requiring grad)
    model = make_model(family)
    batch = collate(ELEMENTS, pad_token_id=0)
    with torch.no_grad():
        want = dpo(model, batch, None)

    def refuse(*args, **kwargs):
        raise AssertionError("no checkpoint without gradients")

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", refuse)
    with torch.no_grad():
        got = dpo(model, batch, 3)
    assert_close_all(got, want)
    assert not any(t.requires_grad for t in got)


def test_unpaired_rows_take_the_chunked_packed_forward():
    # KTO's completions and their mismatched pairs go through one_side_logps
    model = make_model("llama")
    rows = chosen_rows(collate(ELEMENTS, pad_token_id=0))
    with torch.no_grad():
        want = by_hand(model, ELEMENTS, sides=("chosen",))
        assert_close_all([one_side(model, rows, 3)[0]], [want])


# ----------------------------------------------------------------------------- memory: never all logits


def test_full_logits_are_never_materialised():
    model = make_model("llama")
    batch = collate(ELEMENTS, pad_token_id=0)
    head = model.get_output_embeddings()
    sizes = []
    handle = head.register_forward_hook(lambda module, args, output: sizes.append(output.shape))
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            chosen, rejected, _ = dpo(model, batch, 3, max_chunks=1)
        n_forward = len(sizes)
        (chosen.sum() - rejected.sum()).backward()
    finally:
        handle.remove()
    # distinct predicting positions (a shared prompt's last one predicts both first tokens)
    positions = sum(len(set(r.target_cols)) for r in packing.pack_preference_rows(batch))
    assert positions < N_TARGETS
    assert n_forward == math.ceil(positions / 3)
    assert len(sizes) == 2 * n_forward  # the backward recomputes every chunk
    assert all(s[0] <= 3 and s[-1] == VOCAB for s in sizes)
    # nothing of a vocabulary's width is saved for the backward beyond one chunk's
    assert not [s for s in saved if s[-1] == VOCAB and math.prod(s) > 3 * VOCAB], saved
    sizes.clear()
    handle = head.register_forward_hook(lambda module, args, output: sizes.append(output.shape))
    try:
        with torch.no_grad():
            dpo(model, batch, None, max_chunks=1)
    finally:
        handle.remove()
    assert [s[0] for s in sizes] == [positions]  # the unchunked path: every kept position at once


def test_a_peft_model_is_packed_and_chunked():
    # LoRA (model.lora): peft's wrapper takes forward(*args, **kwargs); the packed forward is
    # judged by the model it wraps, and its output layer is found through it
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(make_model("llama"), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():  # B = 0 at init: move it so the adapters matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    assert packing.packed_forward_support(model) == (True, True)
    batch = collate(ELEMENTS, pad_token_id=0)
    expected = grads(model, lambda: dpo(model, batch, None))
    assert_close_all(grads(model, lambda: dpo(model, batch, 3)), expected)
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(dpo(model, batch, 3)[:2]), by_hand(model, ELEMENTS), rtol=1e-9, atol=1e-9)


def test_the_output_layer_is_restored_after_a_failed_forward(monkeypatch):
    model = make_model("stories260K")
    head, embed = model.lm_head, model.model.embed_tokens
    batch = collate(ELEMENTS, pad_token_id=0)

    def fail(*args, **kwargs):
        raise RuntimeError("planted failure")

    monkeypatch.setattr(model.model.norm, "forward", fail)
    with pytest.raises(RuntimeError, match="planted failure"):
        dpo(model, batch, 3)
    assert model.get_output_embeddings() is head and model.lm_head is head
    assert head.weight is embed.weight  # still tied
    assert [n for n, _ in model.named_modules() if "lm_head" in n] == ["lm_head"]


def test_tied_embeddings_stay_tied_through_a_chunked_step():
    model = make_model("stories260K", dtype=torch.float32)
    batch = collate(ELEMENTS, pad_token_id=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    chosen, rejected, _ = dpo(model, batch, 3)
    (rejected.sum() - chosen.sum()).backward()
    optimizer.step()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})


def test_a_split_models_chunks_are_indexed_where_its_head_puts_them(monkeypatch):
    # A model split by device_map: the mask goes in on the CPU (keep_mask_device), the last
    # hidden states and its head's logits come out on another device ("meta" stands in for the
    # last GPU); each chunk's indices must go there, the log-probs back to ``device``.
    seen = {"hidden": set(), "rows": set(), "targets": set()}

    class Head(torch.nn.Module):
        def forward(self, hidden):
            seen["hidden"].add(hidden.device)
            return torch.zeros(hidden.shape[0], 11, device="meta")

    class SplitModel(torch.nn.Module):
        hf_device_map = {"model.embed_tokens": 0, "lm_head": 1}
        config = types.SimpleNamespace(_attn_implementation="sdpa")

        def __init__(self):
            super().__init__()
            self.lm_head = Head()

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, input_ids, use_cache, logits_to_keep, **kwargs):
            seen["mask"] = logits_to_keep.device
            return types.SimpleNamespace(logits=self.lm_head(torch.zeros(int(logits_to_keep.sum()), 4, device="meta")))

    def gathered(logits, rows, targets):
        seen["rows"].add(rows.device)
        seen["targets"].add(targets.device)
        return torch.zeros(len(rows))  # (a real one: on the logits' device, which "meta" cannot leave)

    monkeypatch.setattr(packing.logprobs, "gathered_token_logps", gathered)
    rows = [
        packing.PackedRow([1, 2, 3], None, None, [0, 1, 2], [2, 3, 4], [0, 0, 0]),
        packing.PackedRow([4, 5], None, None, [0, 1], [5, 6], [1, 1]),
    ]
    with torch.no_grad():
        logps, seqs = packing._packed_chunk_logps(SplitModel(), rows, torch.device("cpu"), keep_bool=True, chunk=2)
    meta = torch.device("meta")
    assert seen == {"mask": torch.device("cpu"), "hidden": {meta}, "rows": {meta}, "targets": {meta}}
    assert logps.device == torch.device("cpu") and seqs.tolist() == [0, 0, 0, 1, 1]


# ----------------------------------------------------------------------------- masks and attention


def saved_shapes(fn) -> list[tuple[tuple, torch.dtype, int]]:
    """(shape, dtype, storage) of every tensor ``fn`` saves for its backward."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_the_packed_mask_is_built_once_per_call_not_per_layer(monkeypatch):
    # A boolean mask would be turned into a float one by SDPA in every layer, each copy kept
    # for the backward; the additive mask in the compute dtype is the same tensor in all layers.
    monkeypatch.delenv(packing.GQA_SWITCH, raising=False)
    model = make_model("llama", dtype=torch.float32)
    batch = collate(ELEMENTS[:3], pad_token_id=0)  # three rows sharing their prompts: one call
    saved = saved_shapes(lambda: dpo(model, batch, 3, max_chunks=1))
    width = max(len(r.ids) for r in packing.pack_preference_rows(batch))
    masks = [s for s in saved if s[0] == (3, 1, width, width)]
    assert len(masks) == model.config.num_hidden_layers  # one per layer's attention...
    assert {dtype for _, dtype, _ in masks} == {torch.float32} and len({ptr for *_, ptr in masks}) == 1  # ...one tensor
    # grouped key/value heads go to SDPA as they are (2 here), not repeated for the 4 query heads
    assert os.environ[packing.GQA_SWITCH] == "1"
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    # (heads, head_dim) tensors saved per layer; rotary's cos and sin are (rows, 1, L, head_dim)
    per_layer = collections.Counter(s[0][1] for s in saved if len(s[0]) == 4 and s[0][-1] == head_dim and s[0][1] > 1)
    assert per_layer == {2: 2 * model.config.num_hidden_layers, 4: 2 * model.config.num_hidden_layers}  # k, v; q, out


def test_masked_gqa_is_left_alone_off_the_cpu_and_when_set(monkeypatch):
    monkeypatch.delenv(packing.GQA_SWITCH, raising=False)
    packing.prefer_masked_gqa("meta")
    assert packing.GQA_SWITCH not in os.environ
    monkeypatch.setenv(packing.GQA_SWITCH, "0")
    packing.prefer_masked_gqa("cpu")
    assert os.environ[packing.GQA_SWITCH] == "0"


def test_the_mask_takes_fsdp_mixed_precisions_compute_dtype():
    fsdp_like = types.SimpleNamespace(
        _get_fsdp_state=lambda: types.SimpleNamespace(_mp_policy=types.SimpleNamespace(param_dtype=torch.bfloat16)),
        parameters=lambda: iter([torch.zeros(1)]),
    )
    assert packing.compute_dtype(fsdp_like) == torch.bfloat16
    fsdp_like._get_fsdp_state = lambda: types.SimpleNamespace(_mp_policy=types.SimpleNamespace(param_dtype=None))
    assert packing.compute_dtype(fsdp_like) == torch.float32
    assert packing.compute_dtype(torch.nn.Linear(2, 2).double()) == torch.float64


# ----------------------------------------------------------------------------- logits changed after the head


@pytest.mark.parametrize("family", ["gemma2", "cohere"])
@pytest.mark.parametrize("detect", ["config", "output"])
def test_families_that_change_logits_after_the_head_take_the_unchunked_path(family, detect, monkeypatch, capsys):
    # Gemma 2's soft-capping (cap * tanh(logits / cap)) and Cohere's scale act on the head's
    # output: chunked log-probs of the bare head would be silently wrong. Known config keys are
    # read first; the generic check (the returned logits are not the stand-in's output) is
    # tested by hiding them.
    if detect == "output":
        monkeypatch.setattr(packing, "LOGIT_TRANSFORMS", ())
    model = make_model(family)
    batch = collate(ELEMENTS, pad_token_id=0)
    with torch.no_grad():
        want = by_hand(model, ELEMENTS)
        got = dpo(model, batch, 3)
    torch.testing.assert_close(torch.cat(got[:2]), want, rtol=1e-9, atol=1e-9)
    note = capsys.readouterr().out
    reason = "changes its logits after the output layer" if detect == "config" else "does not return its output layer's output"
    assert note.count("Note:") == 1 and reason in note and "unchunked output layer" in note, note
    with torch.no_grad():
        dpo(model, batch, 3)
    assert "Note:" not in capsys.readouterr().out  # said once per model
    # the bare head's log-probs differ: the transform matters for these settings
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ELEMENTS[0]["chosen_input_ids"]]), output_hidden_states=True).hidden_states[-1]
        bare = torch.log_softmax(model.get_output_embeddings()(hidden), -1)
        full = torch.log_softmax(model(input_ids=torch.tensor([ELEMENTS[0]["chosen_input_ids"]])).logits, -1)
    assert (bare - full).abs().max() > 1e-3


# ----------------------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_activation_checkpointing_gives_the_same_gradients(family):
    model = make_model(family)
    batch = collate(ELEMENTS, pad_token_id=0)
    rows = chosen_rows(batch)
    expected = grads(model, lambda: dpo(model, batch, None))
    expected_sft = grads(model, lambda: one_side(model, rows, None))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
    for chunk in (None, 3):
        assert_close_all(grads(model, lambda c=chunk: dpo(model, batch, c)), expected)
        assert_close_all(grads(model, lambda c=chunk: one_side(model, rows, c)), expected_sft)


# ----------------------------------------------------------------------------- the trainer and the config


def _trainer(tmp_path, overrides):
    from test_train import build_trainer

    return build_trainer(overrides, tmp_path)


@pytest.mark.parametrize("loss", ["dpo", "sft"])
def test_train_step_with_output_layer_chunk_equals_without(tmp_path, loss):
    from test_packed import _first_batch

    metrics, params = [], []
    for chunk in ("3", "null"):
        overrides = [f"loss={loss}", "do_first_eval=false", "optimizer=SGD", "lr=0.1", "warmup_steps=0"]
        trainer = _trainer(tmp_path / chunk, [*overrides, f"output_layer_chunk={chunk}"])
        assert trainer.output_layer_chunk == (3 if chunk == "3" else None)
        metrics.append(trainer.train_step(_first_batch(trainer)))
        params.append([p.detach().clone() for p in trainer.policy.parameters()])
    for key in ("loss/train", "logps_train/chosen", "grad_norm"):
        torch.testing.assert_close(torch.tensor(metrics[0][key]), torch.tensor(metrics[1][key]), rtol=1e-5, atol=1e-5)
    for p, q in zip(*params):  # SGD: the weights differ by lr times the gradients' float noise
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", ["-1", "1.5", "abc", "true"])
def test_a_bad_output_layer_chunk_is_one_sentence(value):
    config = compose_config([f"output_layer_chunk={value}"])
    with pytest.raises(utils.ConfigError, match="output_layer_chunk must be"):
        checks.validate_config(config)


def test_output_layer_chunk_null_and_zero_are_the_previous_path():
    for value in ("null", "0", "1024"):
        checks.validate_config(compose_config([f"output_layer_chunk={value}"]))
    assert compose_config([]).output_layer_chunk == packing.DEFAULT_OUTPUT_LAYER_CHUNK == 1024
