"""bench_memory.py --profile's worker: where ours' memory goes in one step (held tensors, saved activations, masks, vocabulary-wide ops)."""

from __future__ import annotations

import sys
import tempfile
import time

import measure
import our_worker
from memory_workers import REPO, check_our_trainer, checkpointing_on

PROFILE_BATCHES = 4  # --profile: a warm-up step, the measured step, the timed step, the memory-timeline step


def _storage(t) -> tuple[int, int]:
    """(data pointer, bytes) of a tensor's whole storage."""
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def held_tensor_bytes(trainer) -> dict:
    """Bytes of the tensors a BasicTrainer holds across steps: policy weights, trainable weights
    (= their gradients during a step), the reference's own weights (0 when it is the policy's
    base), AdamW state. Each storage counted once."""
    policy = {}
    for p in trainer.policy.parameters():
        policy.setdefault(_storage(p)[0], (p, _storage(p)[1]))
    trainable = sum(p.numel() * p.element_size() for p, _ in policy.values() if p.requires_grad)
    reference = {}
    if trainer.reference_model is not None:
        for p in trainer.reference_model.parameters():
            ptr, n = _storage(p)
            if ptr not in policy:
                reference[ptr] = n
    state = {}
    for per_param in trainer.optimizer.state.values():
        for v in per_param.values():
            if hasattr(v, "untyped_storage") and v.numel() > 1:
                ptr, n = _storage(v)
                state[ptr] = n
    return {
        "policy_weights": sum(n for _, n in policy.values()),
        "policy_params": sum(p.numel() for p, _ in policy.values()),
        "trainable_params": sum(p.numel() for p, _ in policy.values() if p.requires_grad),
        "gradients": trainable,
        "reference_weights": sum(reference.values()),
        "optimizer_state": sum(state.values()),
        "weight_ptrs": set(policy) | set(reference),
    }


def part_of(name: str | None, decoder: str) -> str:
    """Where a module named ``name`` (a qualified name in the policy; None: outside every module)
    belongs, for the memory breakdown. ``decoder`` is the qualified name of the base model (the
    stack of blocks, e.g. "model" in LlamaForCausalLM)."""
    import re

    if name is None:
        return "output layer and log-probs"
    if re.search(r"(^|\.)(self_attn|attention|attn)(\.|$)", name):
        return "attention"
    if re.search(r"(^|\.)(mlp|feed_forward)(\.|$)", name):
        return "MLP"
    if re.search(r"(^|\.)(layers|h)\.\d+(\.|$)", name):
        return "blocks: norms, residual adds"
    if "embed_tokens" in name or name.endswith(("wte", "embed_in")):
        return "embeddings"
    if name.endswith(("lm_head", "embed_out")):
        return "output layer and log-probs"
    if name == decoder or name.startswith(decoder + "."):
        return "base model outside the blocks (final norm, rotary, masks)"
    return "output layer and log-probs"  # the CausalLM (or peft) wrapper itself: the logits


def _decoder_name(policy) -> str:
    """Qualified name of the stack of blocks inside ``policy`` (a transformers CausalLM, maybe peft)."""
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    decoder = getattr(base, base.base_model_prefix, base)
    return next(n for n, m in policy.named_modules() if m is decoder)


def _module_hooks(policy, checkpointing: bool, rec: dict) -> list:
    """Hooks on every module of ``policy``: the stack of the modules running (``rec["stack"]``);
    at each block, during the recorded forward with gradients, the attention masks given to it
    (``rec["masks"]``, ``rec["mask_uses"]``) and, with activation checkpointing, its input, what
    a checkpointed block keeps (``rec["saved"]``). Returns the handles."""
    import re

    import torch

    stack, saved, masks, mask_uses, recording = (rec[k] for k in ("stack", "saved", "masks", "mask_uses", "recording"))
    block = re.compile(r"(^|\.)(layers|h)\.\d+$")

    def pre(name):
        def hook(module, args, kwargs):
            stack.append(name)
            if block.search(name) and recording[0] and torch.is_grad_enabled():
                mask = kwargs.get("attention_mask")
                for m in mask.values() if isinstance(mask, dict) else [mask]:
                    if isinstance(m, torch.Tensor):
                        masks.setdefault(
                            id(m), (tuple(m.shape), str(m.dtype).replace("torch.", ""), m.numel() * m.element_size())
                        )
                        mask_uses[id(m)] += 1
                hidden = args[0] if args else kwargs.get("hidden_states")
                if checkpointing and isinstance(hidden, torch.Tensor):
                    ptr, n = _storage(hidden)  # what a checkpointed block keeps: its input
                    saved.setdefault(ptr, ("blocks' inputs, kept by activation checkpointing", tuple(hidden.shape), "", n))

        return hook

    def post(module, args, output):
        stack.pop()

    handles = []
    for name, module in policy.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post))
    return handles


def _recorded_step(trainer, batch, pack, recording: list) -> tuple[float, float, float]:
    """One train_step with ``pack`` as the saved-tensors hook, recording off during backward, and
    VmHWM reset first. Returns (step seconds, RSS before the step, peak RSS during it), in MiB."""
    import torch

    backward = torch.Tensor.backward

    def backward_unrecorded(self, *a, **kw):
        recording[0] = False  # the recomputation of checkpointed blocks saves again: not counted
        try:
            return backward(self, *a, **kw)
        finally:
            recording[0] = True

    torch.Tensor.backward = backward_unrecorded
    rss_before = measure._rss_now_mib()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    t0 = time.perf_counter()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.train_step(batch)
    finally:
        torch.Tensor.backward = backward
    step_s = time.perf_counter() - t0
    _, hwm = measure._peak_rss_mib()
    return step_s, rss_before, hwm


def _saved_summary(saved: dict, masks: dict, mask_uses: dict, vocab: int) -> dict:
    """The saved tensors by part, their total and the ten largest (part, shape, dtype) groups; the masks."""
    from collections import defaultdict

    by_part: dict[str, int] = defaultdict(int)
    shapes: dict[tuple, list] = {}
    for part, shape, dtype, n in saved.values():
        by_part[part] += n
        entry = shapes.setdefault((part, shape, dtype), [0, 0])
        entry[0] += 1
        entry[1] += n
    largest = sorted(shapes.items(), key=lambda kv: -kv[1][1])[:10]
    return {
        "saved_by_part": dict(by_part),
        "saved_total": sum(by_part.values()),
        "saved_largest": [
            {"part": p, "shape": list(s), "dtype": d, "count": c, "bytes": n, "vocab_wide": vocab in s}
            for (p, s, d), (c, n) in largest
        ],
        "masks": [
            {"shape": list(shape), "dtype": dtype, "bytes": n, "blocks_using_it": mask_uses[k]}
            for k, (shape, dtype, n) in masks.items()
        ],
    }


def measure_step(trainer, batch, vocab: int) -> dict:
    """One train_step with accounting hooks: what the policy's forward saves for backward (unique
    storages, weights excluded) by part (:func:`part_of`), with the largest saved shapes; the
    attention masks given to the blocks; and the process's peak RSS during the step (VmHWM,
    reset first through /proc/self/clear_refs; no profiler runs meanwhile: its records would
    count)."""
    from collections import defaultdict

    policy = trainer.policy
    decoder = _decoder_name(policy)
    weights = held_tensor_bytes(trainer)["weight_ptrs"]
    rec = {"stack": [], "saved": {}, "masks": {}, "mask_uses": defaultdict(int), "recording": [True]}
    stack, saved, recording = rec["stack"], rec["saved"], rec["recording"]
    handles = _module_hooks(policy, checkpointing_on(policy), rec)

    def pack(t):
        if recording[0]:
            ptr, n = _storage(t)
            if ptr not in weights and ptr not in saved and n:
                saved[ptr] = (
                    part_of(stack[-1] if stack else None, decoder),
                    tuple(t.shape),
                    str(t.dtype).replace("torch.", ""),
                    n,
                )
        return t

    try:
        step_s, rss_before, hwm = _recorded_step(trainer, batch, pack, recording)
    finally:
        for h in handles:
            h.remove()
    return {
        "step_s": step_s,
        "rss_before_step": rss_before,
        "rss_peak_step": hwm,
        **_saved_summary(saved, rec["masks"], rec["mask_uses"], vocab),
    }


def vocab_time_share(trainer, batch, vocab: int) -> dict:
    """One train_step under a light torch.profiler (CPU, record_shapes only, so the times are
    close to a plain step's): the self CPU time of all ops, and of the ops with a ``vocab``-wide
    operand (the output layer, its log-softmax and their backward; the embedding's ops left out),
    in seconds, with the largest of those ops, and the step's wall seconds."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        trainer.train_step(batch)
    wall = time.perf_counter() - t0
    total = vocab_us = 0.0
    vocab_ops: dict[str, float] = {}
    for ev in prof.key_averages(group_by_input_shape=True):
        total += ev.self_cpu_time_total
        shapes = ev.input_shapes or []
        if any(isinstance(s, (list, tuple)) and vocab in s for s in shapes) and "embedding" not in ev.key:
            vocab_us += ev.self_cpu_time_total
            vocab_ops[ev.key] = vocab_ops.get(ev.key, 0.0) + ev.self_cpu_time_total
    return {
        "timed_step_s": wall,
        "ops_self_cpu_s": total / 1e6,
        "vocab_ops_self_cpu_s": vocab_us / 1e6,
        "vocab_ops": {k: v / 1e6 for k, v in sorted(vocab_ops.items(), key=lambda kv: -kv[1])[:8]},
    }


def profile_step(trainer, batch) -> dict:
    """One train_step under torch.profiler with profile_memory, record_shapes and with_stack:
    tensor memory at the step's peak by category (parameters, optimizer state, gradients,
    activations, temporaries, ...) from the profiler's memory timeline, a private torch API
    (``peak_by_category`` None, and the error, when it is unavailable)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        trainer.train_step(batch)
    out = {"peak_by_category": None}
    try:
        from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

        times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
        totals = [sum(s) for s in sizes]
        i = max(range(len(totals)), key=totals.__getitem__)
        names = {index + 1: (c.name if c is not None else "unknown") for c, index in _CATEGORY_TO_INDEX.items()}
        out["peak_by_category"] = {names[j]: sizes[i][j] for j in names}
        out["peak_tensor_bytes"] = totals[i]
        out["peak_at_fraction_of_step"] = (times[i] - times[0]) / max(times[-1] - times[0], 1)
    except Exception as e:  # noqa: BLE001 - the private API moved: the rest of the profile stands
        out["peak_by_category_error"] = f"{type(e).__name__}: {e}"
    return out


def worker_profile(spec: dict) -> dict:
    """Where ours' memory goes in one step of configuration ``spec``: one warm-up step (AdamW
    state exists from then on), then :func:`measure_step`, :func:`vocab_time_share` and
    :func:`profile_step`, each on the next batch (PROFILE_BATCHES in all)."""
    measure._set_threads(spec["threads"])
    sys.path.insert(0, str(REPO))
    from preference_datasets import collate

    with tempfile.TemporaryDirectory() as tmp:
        trainer, elements, _ = our_worker._our_trainer(spec, tmp)
        counts = check_our_trainer(trainer, spec)
        rss_setup = measure._rss_now_mib()
        pad, bs = trainer.tokenizer.pad_token_id, spec["batch_size"]
        batches = [collate(elements[k * bs : (k + 1) * bs], pad) for k in range(PROFILE_BATCHES)]
        vocab = trainer.policy.get_output_embeddings().weight.shape[0]
        trainer.policy.train()
        trainer.train_step(batches[0])
        held = held_tensor_bytes(trainer)
        held.pop("weight_ptrs")
        step = measure_step(trainer, batches[1], vocab)
        timed = vocab_time_share(trainer, batches[2], vocab)
        prof = profile_step(trainer, batches[3])
    sides = ("chosen",) if spec["task"] == "sft" else ("chosen", "rejected")
    return {
        **counts,
        "held": held,
        "rss_setup": rss_setup,
        **step,
        **timed,
        **prof,
        "vocab": vocab,
        "tokens": int(sum(batches[1][f"{side}_attention_mask"].sum() for side in sides)),
    }
