"""Memory and speed on a real vocabulary: this project vs TRL 1.16, DPO (full and LoRA) and SFT, on CPU.

Issue 14's benchmark. SmolLM2-135M-Instruct (49,152-entry vocabulary; build it once with
``bash ../shared/scripts/get-smollm2.sh /tmp/smollm2``), real HH pairs (../shared/data/hh-rlhf),
batch 8, max_length 512, fp32, 2 threads, the SAME token ids on both sides: bench_dpo.py's
pieces, imported (its data preparation and the check that TRL's collator gives our batches,
its workers, its fairness settings: see ``python bench/bench_dpo.py --help``). Configurations
(``--configs``), each side of each in its own subprocess, so the peak RSS (the child's own
``ru_maxrss``) is its own; the parent imports no torch:

  dpo-full      DPO, full fine-tuning, live reference (ours: a second model; TRL: its ref model)
  dpo-full-ac   the same with activation checkpointing on both sides
  dpo-lora      DPO with LoRA r 16 (alpha 32, dropout 0) on q,k,v,o,gate,up,down projections;
                the reference is the base with the adapters disabled on both sides
                (ours ``model.lora.*``; TRL ``peft_config``, the same peft LoraConfig)
  dpo-lora-ac   the same with activation checkpointing
  sft           SFT on the chosen responses: ours ``loss=sft`` vs TRL's SFTTrainer (input_ids
                prompt + chosen, labels -100 on the prompt: the ids and labels of our batches,
                checked batch by batch against TRL's collator); tokens/s
  sft-ac        the same with activation checkpointing (not in the default set)

Equal settings on both sides: AdamW (torch's, unfused; lr --lr, no weight decay), constant
schedule, no warm-up, gradient clipping 1.0, sigmoid DPO loss (beta 0.1), no precompute,
sequential batches; activation checkpointing set explicitly on TRL's side (TRL 1.16's configs
default to ``gradient_checkpointing=True``; transformers 5.24 calls it activation_checkpointing),
non-reentrant on both. Speed: the median step after --warmup steps (pairs/s; SFT tokens/s, the
non-padding tokens of prompt + chosen); memory: peak RSS of the side's process (MiB; the targets
are in GB = 1e9 bytes). The table gives ours/TRL ratios from one run and issue 14's targets,
pass or fail; it is also written as results.md and results.json into --out. Each configuration
also gets a row of ours run again with ``--ours-variant`` (default ``malloc_mmap_threshold_mib=1``,
the CPU memory setting: utils.set_malloc_mmap_threshold) and, with ``--ours-preload LIBRARY``, a
row of ours with ``LD_PRELOAD=LIBRARY`` (tcmalloc, jemalloc), against the same TRL run; each
target is judged on each row alone.

``--profile``: where ours' memory goes in one step, for each chosen configuration (ours only):
the tensors held across steps (weights, reference, AdamW state; gradients during the step) and
their sum (the floor), process RSS before and at the peak of one step, tensor memory at that peak
by category (torch.profiler's memory timeline), what the policy's forward saves for backward by
where it is saved (output layer and log-probs, attention, MLP, blocks' norms, embeddings), the
attention masks given to the blocks, and the share of the step's op time in ops with a
vocabulary-sized operand (a light profiler over the same step). Written as profile.md and profile.json into --out.

    python bench/bench_memory.py                                   # all default configs, about 20 min
    python bench/bench_memory.py --configs dpo-full,sft --steps 2 --warmup 1
    python bench/bench_memory.py --ours-overrides output_layer_chunk=null   # ours on the previous path
    python bench/bench_memory.py --ours-variant                     # no second row of ours
    python bench/bench_memory.py --ours-preload /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4   # and a tcmalloc row
    python bench/bench_memory.py --profile --configs dpo-full,dpo-full-ac
    python bench/bench_memory.py --model ../shared/models/stories260K --batch-size 2 --max-length 128   # mechanics
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dpo  # noqa: E402
import dpo_report  # noqa: E402
import measure  # noqa: E402
import our_worker  # noqa: E402
import trl_worker  # noqa: E402

REPO = bench_dpo.REPO
SHARED = bench_dpo.SHARED
DEFAULT_MODEL_DIRS = (Path("/tmp/smollm2"), SHARED / "models" / "smollm2-135m-instruct")
LORA = {  # issue 14: r 16 on the attention and MLP projections; dropout 0 (TRL disables dropout)
    "r": 16,
    "alpha": 32,
    "dropout": 0.0,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
CONFIGS = {  # name -> (task, LoRA, activation checkpointing)
    "dpo-full": ("dpo", False, False),
    "dpo-full-ac": ("dpo", False, True),
    "dpo-lora": ("dpo", True, False),
    "dpo-lora-ac": ("dpo", True, True),
    "sft": ("sft", False, False),
    "sft-ac": ("sft", False, True),
}
DEFAULT_CONFIGS = ["dpo-full", "dpo-full-ac", "dpo-lora", "dpo-lora-ac", "sft"]
OURS_VARIANT = ("malloc_mmap_threshold_mib=1",)  # the memory setting (utils.set_malloc_mmap_threshold): a row of its own
SIDES = ("ours", "trl")
GB = 1e9
PROFILE_BATCHES = 4  # --profile: a warm-up step, the measured step, the timed step, the memory-timeline step
TARGETS = (  # (config, figure, comparison, bound, text): issue 14's targets on a 2-core CPU
    ("dpo-full", "rss_ratio", "<=", 0.3, "DPO full, no AC: peak RSS <= 0.3x TRL's"),
    ("dpo-full", "speed_ratio", ">=", 4.0, "DPO full, no AC: pairs/s >= 4x TRL's"),
    ("dpo-full-ac", "ours_rss_gb", "<=", 4.0, "DPO full, AC on both: ours <= 4 GB"),
    ("dpo-lora", "speed_ratio", ">=", 3.0, "DPO LoRA: pairs/s >= 3x TRL-with-peft's"),
    ("dpo-lora", "rss_ratio", "<=", 0.3, "DPO LoRA: peak RSS <= 0.3x TRL-with-peft's"),
    ("dpo-lora-ac", "ours_rss_gb", "<=", 2.0, "DPO LoRA, AC: ours <= 2 GB"),
    ("sft", "speed_ratio", ">=", 2.0, "SFT: tokens/s >= 2x TRL SFTTrainer's"),
    ("sft", "rss_ratio", "<=", 0.5, "SFT: peak RSS <= 0.5x TRL SFTTrainer's"),
)


# ============================================================================ specs


def config_spec(base: dict, name: str, side: str, ours_overrides: list[str]) -> dict:
    """The worker spec of one side of configuration ``name``: ``base`` plus the task, LoRA and
    activation checkpointing (for ours as Hydra overrides of the project's config, for TRL as
    spec keys that trl_worker._trl_trainer / :func:`_trl_sft_trainer` read)."""
    task, lora, ac = CONFIGS[name]
    spec = {**base, "config": name, "task": task, "side": side, "mode": "live", "activation_checkpointing": ac}
    spec["lora"] = dict(LORA, r=base.get("lora_r", LORA["r"])) if lora else None
    if side == "ours":
        spec["loss"] = task  # our_worker._our_trainer: loss=<task> (and loss.beta for dpo)
        overrides = [f"activation_checkpointing={str(ac).lower()}"]
        if lora:
            targets = ",".join(spec["lora"]["target_modules"])
            overrides += [
                f"model.lora.r={spec['lora']['r']}",
                f"model.lora.alpha={spec['lora']['alpha']}",
                f"model.lora.dropout={spec['lora']['dropout']}",
                f"model.lora.target_modules=[{targets}]",
            ]
        spec["overrides"] = [*overrides, *ours_overrides]
    return spec


# ============================================================================ workers (in subprocesses)


def checkpointing_on(model) -> bool:
    """Whether activation checkpointing is on in ``model`` (a transformers model, maybe wrapped
    by peft): ``is_activation_checkpointing`` (transformers 5.24), else ``is_gradient_checkpointing``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    on = getattr(base, "is_activation_checkpointing", None)
    return bool(getattr(base, "is_gradient_checkpointing", False) if on is None else on)


def check_our_trainer(trainer, spec: dict) -> dict:
    """Assert that our BasicTrainer runs what ``spec`` asks (activation checkpointing on the
    policy, LoRA or full training, a live reference for full DPO and no second model with LoRA
    or for SFT); return its parameter counts and its malloc_mmap_threshold_mib."""
    policy = trainer.policy
    ac = spec["activation_checkpointing"]
    assert checkpointing_on(policy) == ac, "activation checkpointing not as asked"
    named = dict(policy.named_parameters())
    trainable = sum(p.numel() for p in named.values() if p.requires_grad)
    total = sum(p.numel() for p in named.values())
    if spec["lora"]:
        assert hasattr(policy, "peft_config"), f"LoRA asked, but the policy is a {type(policy).__name__}, not a peft model"
        frozen_base = all(("lora_" in n) == p.requires_grad for n, p in named.items())
        assert frozen_base and trainable, "LoRA asked, but what trains is not exactly the adapters"
        assert trainer.reference_model is None or trainer.reference_model is policy, "LoRA: a second model was loaded"
    else:
        assert trainable == total, "full fine-tuning asked, but some parameters are frozen"
        assert (trainer.reference_model is not None) == (spec["task"] == "dpo"), "full DPO needs its live reference"
    assert trainer.config.loss.name == spec["task"]
    malloc = trainer.config.get("malloc_mmap_threshold_mib")
    return {"n_params": total, "n_trainable": trainable, "malloc_mmap_threshold_mib": malloc}


def worker_ours(spec: dict) -> dict:
    """our_worker.worker_ours (collate + BasicTrainer.train_step, timed per step), with the trainer
    checked by :func:`check_our_trainer` first."""
    built = {}
    make = our_worker._our_trainer

    def checked(spec_, run_dir):
        trainer, elements, precompute_s = make(spec_, run_dir)
        built.update(check_our_trainer(trainer, spec_))
        return trainer, elements, precompute_s

    preload = spec.get("env", {}).get("LD_PRELOAD")
    if preload:  # --ours-preload: the allocator is in this process, not only in its environment
        maps = Path("/proc/self/maps").read_text()
        assert Path(preload).name in maps, f"LD_PRELOAD={preload} is not loaded in the worker"
    our_worker._our_trainer = checked
    try:
        out = our_worker.worker_ours(spec)
    finally:
        our_worker._our_trainer = make
    return {**out, **built}


def _checkpointing_check(spec: dict):
    """A TrainerCallback asserting, at the first step, that the model being trained has activation
    checkpointing on exactly when ``spec`` asks (transformers turns it on inside train())."""
    from transformers import TrainerCallback

    class Check(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 1:
                on = checkpointing_on(model)
                assert on == spec["activation_checkpointing"], f"TRL's activation checkpointing is {on}"

    return Check()


def worker_trl(spec: dict) -> dict:
    """trl_worker.worker_trl: TRL's DPOTrainer (with spec's LoRA and checkpointing), timed per step."""
    return trl_worker.worker_trl(
        spec, build=lambda s, out_dir, callbacks: _with_check(trl_worker._trl_trainer, s, out_dir, callbacks)
    )


def worker_trl_sft(spec: dict) -> dict:
    """trl_worker.worker_trl on TRL's SFTTrainer (:func:`_trl_sft_trainer`)."""
    return trl_worker.worker_trl(spec, build=lambda s, out_dir, callbacks: _with_check(_trl_sft_trainer, s, out_dir, callbacks))


def _with_check(build, spec: dict, out_dir: str, callbacks):
    return build(spec, out_dir, callbacks=[*callbacks, _checkpointing_check(spec)])


def _sft_rows(pairs: list[dict]) -> dict:
    """TRL SFT columns from our ids: input_ids = prompt + chosen, labels -100 on the prompt."""
    return {
        "input_ids": [p["prompt_ids"] + p["chosen_ids"] for p in pairs],
        "labels": [[-100] * len(p["prompt_ids"]) + p["chosen_ids"] for p in pairs],
    }


def _trl_sft_trainer(spec: dict, out_dir: str, callbacks=()):
    """TRL 1.16's SFTTrainer on the chosen responses, fed our token ids, with bench_dpo's
    settings (optimizer, schedule, clipping, fp32, sequential batches, TRL's default logging);
    its dataset preparation keeps a tokenized dataset with labels as it is (checked)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    class BenchSFTTrainer(SFTTrainer):
        """SFTTrainer recording each training loss (as bench_dpo's BenchDPOTrainer does)."""

        precompute_s = 0.0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if model.training:
                self.bench_losses.append((loss[0] if return_outputs else loss).detach())
            return loss

    with open(spec["pairs_file"]) as f:
        pairs = json.load(f)
    rows = _sft_rows(pairs)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], trust_remote_code=False)
    args = SFTConfig(
        **trl_worker.trl_common_args(SFTConfig, spec, out_dir),
        packing=False,
        padding_free=False,
        shuffle_dataset=False,
    )
    trainer = BenchSFTTrainer(
        model=spec["model_dir"],
        args=args,
        train_dataset=Dataset.from_dict(rows),
        processing_class=tokenizer,
        callbacks=list(callbacks),
        peft_config=trl_worker.trl_lora_config(spec),
    )
    trainer.bench_losses = []
    trl_worker.check_trl_trainer(trainer, spec)
    prepared = trainer.train_dataset
    assert prepared["input_ids"] == rows["input_ids"] and prepared["labels"] == rows["labels"], "TRL changed the SFT rows"
    collator = trainer.data_collator
    assert not collator.padding_free and collator.pad_to_multiple_of is None and collator.pad_token_id == tokenizer.pad_token_id
    return trainer


def worker_prepare(spec: dict) -> dict:
    """bench_dpo.worker_prepare (the pairs, tokenized by our code, TRL's preference collator checked
    against our DPO batches), then the same for SFT: TRL's DataCollatorForLanguageModeling on
    :func:`_sft_rows` gives exactly the chosen side of our batches (ids, mask, labels)."""
    out = bench_dpo.worker_prepare(spec)
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import AutoTokenizer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    import preference_datasets as pdata

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer_dir"], trust_remote_code=False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    with open(spec["pairs_file"]) as f:
        pairs = json.load(f)
    rows = _sft_rows(pairs)
    collate_trl = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)
    bs, sft_tokens = spec["batch_size"], []
    for k in range(0, len(pairs), bs):
        els = [
            pdata.tokenize_element(
                p["prompt"],
                p["chosen"],
                p["rejected"],
                p["truncation_mode"],
                tokenizer,
                spec["max_length"],
                spec["max_prompt_length"],
            )
            for p in pairs[k : k + bs]
        ]
        ours = pdata.collate(els, tokenizer.pad_token_id)
        theirs = collate_trl([{key: rows[key][i] for key in rows} for i in range(k, min(k + bs, len(pairs)))])
        mask = ours["chosen_attention_mask"]
        assert torch.equal(mask, theirs["attention_mask"]), f"SFT batch {k // bs}: attention_mask differs"
        assert torch.equal(ours["chosen_input_ids"][mask.bool()], theirs["input_ids"][mask.bool()]), f"SFT batch {k // bs}: ids"
        assert torch.equal(ours["chosen_labels"], theirs["labels"]), f"SFT batch {k // bs}: labels differ"
        sft_tokens.append(int(mask.sum()))
    return {**out, "sft_tokens_per_batch": sft_tokens}


# ---------------------------------------------------------------------------- profile


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


def measure_step(trainer, batch, vocab: int) -> dict:
    """One train_step with accounting hooks: what the policy's forward saves for backward (unique
    storages, weights excluded) by part (:func:`part_of`), with the largest saved shapes; the
    attention masks given to the blocks; and the process's peak RSS during the step (VmHWM,
    reset first through /proc/self/clear_refs; no profiler runs meanwhile: its records would
    count)."""
    import re
    from collections import defaultdict

    import torch

    policy = trainer.policy
    checkpointing = checkpointing_on(policy)
    decoder = _decoder_name(policy)
    weights = held_tensor_bytes(trainer)["weight_ptrs"]
    stack: list[str] = []
    saved: dict[int, tuple[str, tuple, str, int]] = {}
    masks: dict[int, tuple] = {}
    mask_uses: dict[int, int] = defaultdict(int)
    recording = [True]
    handles = []
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

    for name, module in policy.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post))

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
        for h in handles:
            h.remove()
    step_s = time.perf_counter() - t0
    _, hwm = measure._peak_rss_mib()
    by_part: dict[str, int] = defaultdict(int)
    shapes: dict[tuple, list] = {}
    for part, shape, dtype, n in saved.values():
        by_part[part] += n
        entry = shapes.setdefault((part, shape, dtype), [0, 0])
        entry[0] += 1
        entry[1] += n
    largest = sorted(shapes.items(), key=lambda kv: -kv[1][1])[:10]
    return {
        "step_s": step_s,
        "rss_before_step": rss_before,
        "rss_peak_step": hwm,
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


WORKERS = {
    "prepare": worker_prepare,
    "ours": worker_ours,
    "trl": worker_trl,
    "trl_sft": worker_trl_sft,
    "profile": worker_profile,
}


# ============================================================================ figures (parent)


def side_figures(r: dict, task: str, batch_size: int, tokens_per_step: float) -> dict:
    """One side's figures from its worker result: pairs (or sequences) per second and tokens per
    second over the median measured step, peak RSS in MiB (the worker process's own) and GB."""
    return {
        "pairs_per_s": batch_size / r["step_s"],
        "tokens_per_s": tokens_per_step / r["step_s"],
        "per_s": (tokens_per_step if task == "sft" else batch_size) / r["step_s"],
        "step_s": r["step_s"],
        "steps_s": r["steps_s"],
        "rss_peak_mib": r["rss_peak"],
        "rss_peak_gb": r["rss_peak"] * 2**20 / GB,
        "rss_setup_mib": r["rss_setup"],
        "losses": r["losses"],
        "optimizer": r["optimizer"],
        "threads": r["threads"],
        "others_cpu": r["others_cpu"],
        "cpu_util": r["cpu_util"],
        "wall_s": r["wall_s"],
        **{k: r[k] for k in ("n_params", "n_trainable", "malloc_mmap_threshold_mib") if k in r},
    }


def compare(name: str, ours: dict | None, trl: dict | None, variant: list[str] | None = None) -> dict:
    """A table row: both sides' figures and the ratios ours / TRL (speed: pairs/s, or tokens/s for
    SFT; peak RSS), None where a side was not measured. ``variant``: the extra overrides ours ran
    with in this row (``--ours-variant``; TRL's side is the configuration's one TRL run)."""
    task, lora, ac = CONFIGS[name]
    label = " + ".join([name, *(variant or [])])
    row = {"config": name, "variant": list(variant or []), "label": label, "task": task, "lora": lora}
    row.update({"activation_checkpointing": ac, "ours": ours, "trl": trl})
    both = ours is not None and trl is not None and "error" not in ours and "error" not in trl
    row["speed_ratio"] = ours["per_s"] / trl["per_s"] if both else None
    row["rss_ratio"] = ours["rss_peak_mib"] / trl["rss_peak_mib"] if both else None
    row["ours_rss_gb"] = ours["rss_peak_gb"] if ours is not None and "error" not in ours else None
    row["loss0"] = [ours["losses"][0], trl["losses"][0]] if both else None
    row["max_loss_diff"] = max(abs(a - b) for a, b in zip(ours["losses"], trl["losses"])) if both else None
    return row


def verdicts(rows: list[dict]) -> list[dict]:
    """Issue 14's targets (TARGETS) against the rows: for each target, one entry per row of its
    configuration (ours as configured, then each ``--ours-variant`` row; a target with two figures
    of one configuration is judged on each row alone, so "in one run" holds), each {target, config,
    variant, label, value, bound, verdict}, verdict "pass", "FAIL" or "not measured" (its
    configuration not run, or a side failed)."""
    out = []
    for config, figure, op, bound, text in TARGETS:
        mine = [r for r in rows if r["config"] == config] or [{"label": config, "variant": []}]
        for row in mine:
            value = row.get(figure)
            if value is None:
                verdict = "not measured"
            else:
                verdict = "pass" if (value <= bound if op == "<=" else value >= bound) else "FAIL"
            entry = {"target": text, "config": config, "variant": row["variant"], "label": row["label"], "figure": figure}
            out.append({**entry, "value": value, "bound": bound, "verdict": verdict})
    return out


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def results_markdown(rows: list[dict], checks: list[dict], title: str) -> str:
    """The table (one row per configuration, both sides and the ratios) and the targets, as markdown."""
    lines = [
        title,
        "",
        "| config | ours speed | TRL speed | speed ours/TRL | ours tokens/s | TRL tokens/s | ours peak RSS MiB | TRL MiB | RSS ours/TRL "
        "| ours GB | step-0 loss ours / TRL | max abs loss diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o, t = r["ours"], r["trl"]

        def cell(side, key, spec=".2f"):
            if side is None:
                return "-"
            return "failed" if "error" in side else _fmt(side[key], spec)

        unit = " tok/s" if r["task"] == "sft" else " pairs/s"

        def speed(side, unit=unit):
            return cell(side, "per_s", ".3g") + (unit if side is not None and "error" not in side else "")

        loss0 = "-" if r["loss0"] is None else f"{r['loss0'][0]:.6f} / {r['loss0'][1]:.6f}"
        lines.append(
            f"| {r['label']} | {speed(o)} | {speed(t)} | {_fmt(r['speed_ratio'])} "
            f"| {cell(o, 'tokens_per_s', '.0f')} | {cell(t, 'tokens_per_s', '.0f')} | {cell(o, 'rss_peak_mib', '.0f')} "
            f"| {cell(t, 'rss_peak_mib', '.0f')} | {_fmt(r['rss_ratio'])} | {_fmt(r['ours_rss_gb'])} | {loss0} "
            f"| {_fmt(r['max_loss_diff'], '.1e')} |"
        )
    lines += ["", "| target (issue 14) | row | measured | verdict |", "|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['target']} | {c['label']} | {_fmt(c['value'])} | {c['verdict']} |")
    failed = [f"{r['label']} {s}: {r[s]['error']}" for r in rows for s in SIDES if r[s] and "error" in r[s]]
    if failed:
        lines += ["", "Failed runs (first line of each error):", *[f"- {f}" for f in failed]]
    return "\n".join(lines) + "\n"


def _mib(n: float) -> str:
    return f"{n / 2**20:9.1f}"


def profile_markdown(name: str, p: dict) -> str:
    """The memory profile of one configuration (:func:`worker_profile`'s result) as text."""
    h = p["held"]
    floor = h["policy_weights"] + h["reference_weights"] + h["gradients"] + h["optimizer_state"]
    lines = [
        f"### {name}: where ours' memory goes in one step ({p['tokens']} non-padding tokens, vocabulary {p['vocab']})",
        "",
        "```",
        f"{'tensors held by the trainer':50} {'MiB':>9} {'GB':>9}",
        *(
            f"  {label:48} {_mib(n)} {n / GB:9.2f}"
            for label, n in (
                (f"policy weights ({h['policy_params'] / 1e6:.1f}M parameters)", h["policy_weights"]),
                ("reference weights (a model of its own)", h["reference_weights"]),
                (f"gradients ({h['trainable_params'] / 1e6:.2f}M trainable, during a step)", h["gradients"]),
                ("optimizer state (AdamW exp_avg, exp_avg_sq)", h["optimizer_state"]),
                ("sum: the floor", floor),
            )
        ),
        "",
        f"process RSS, MiB: after set-up {p['rss_setup']:.0f}; before the measured step {p['rss_before_step']:.0f}; "
        f"peak during it {p['rss_peak_step']:.0f} ({p['rss_peak_step'] * 2**20 / GB:.2f} GB; "
        f"+{p['rss_peak_step'] - p['rss_before_step']:.0f} over before); the step took {p['step_s']:.2f} s with the hooks",
    ]
    if p.get("peak_by_category"):
        cats = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in sorted(p["peak_by_category"].items(), key=lambda kv: -kv[1]) if v)
        lines += [
            f"tensor memory at the step's peak (torch.profiler memory timeline, at {p['peak_at_fraction_of_step']:.0%} "
            f"of the step): {p['peak_tensor_bytes'] / 2**20:.0f} MiB = {cats} MiB",
        ]
    else:
        lines.append(f"tensor memory by category: not available ({p.get('peak_by_category_error')})")
    total = max(p["saved_total"], 1)
    lines += ["", f"saved for backward by the policy's forward: {p['saved_total'] / 2**20:.0f} MiB (weights excluded), by part:"]
    for part, n in sorted(p["saved_by_part"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {part:58} {_mib(n)} MiB {n / total:6.1%}")
    lines.append("  largest saved tensors (part, shape, dtype, how many, MiB):")
    for s in p["saved_largest"]:
        wide = "  <- vocabulary-wide" if s["vocab_wide"] else ""
        lines.append(
            f"    {s['part'][:40]:40} {str(s['shape']):22} {s['dtype']:9} x{s['count']:<3} {s['bytes'] / 2**20:9.1f}{wide}"
        )
    if p["masks"]:
        n = sum(m["bytes"] for m in p["masks"])
        lines.append(
            f"attention masks given to the blocks in the policy's forward: {len(p['masks'])} distinct, {n / 2**20:.1f} MiB:"
        )
        for m in p["masks"]:
            lines.append(f"  {m['shape']} {m['dtype']}, {m['bytes'] / 2**20:.1f} MiB, given to {m['blocks_using_it']} blocks")
    else:
        lines.append("attention masks given to the blocks: none as tensors (the attention builds its own causal mask)")
    share = p["vocab_ops_self_cpu_s"] / max(p["ops_self_cpu_s"], 1e-9)
    ops = ", ".join(f"{k} {v:.2f} s" for k, v in p["vocab_ops"].items())
    lines += [
        f"time: ops with a {p['vocab']}-wide operand (output layer, log-softmax, their backward) "
        f"{p['vocab_ops_self_cpu_s']:.2f} s of {p['ops_self_cpu_s']:.2f} s self CPU time ({share:.0%}; that step "
        f"{p['timed_step_s']:.1f} s): {ops}",
        "```",
        "",
    ]
    return "\n".join(lines)


# ============================================================================ parent


def find_model(path: str | None) -> Path:
    """The SmolLM2 folder: ``path``, else the first of DEFAULT_MODEL_DIRS holding a config.json.

    Raises:
        SystemExit: one sentence naming the folder looked at and how to build it.
    """
    candidates = [Path(path)] if path else list(DEFAULT_MODEL_DIRS)
    for c in candidates:
        if (c / "config.json").is_file():
            return c
    where = candidates[0]
    raise SystemExit(
        f"Error: no model at {where} (no config.json there): build SmolLM2-135M-Instruct with "
        f"`bash {SHARED / 'scripts' / 'get-smollm2.sh'} {where}` (about a minute, 540 MB) or give --model DIR."
    )


def parse_configs(text: str) -> list[str]:
    """``--configs``: comma-separated names of CONFIGS, in the order given.

    Raises:
        argparse.ArgumentTypeError: naming an unknown configuration and the known ones.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown configuration {unknown[0] if unknown else text!r}; choose from {', '.join(CONFIGS)}"
        )
    return names


def parse_sides(text: str) -> list[str]:
    """``--sides``: ours, trl or both (comma-separated)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in SIDES for n in names):
        raise argparse.ArgumentTypeError(f"--sides takes ours, trl or ours,trl, not {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The command line (defaults: issue 14's settings, sized to about 20 minutes in all)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="SmolLM2-135M-Instruct folder (default /tmp/smollm2; see get-smollm2.sh)")
    parser.add_argument(
        "--configs", type=parse_configs, default=DEFAULT_CONFIGS, help=f"comma-separated subset of {', '.join(CONFIGS)}"
    )
    parser.add_argument("--sides", type=parse_sides, default=list(SIDES), help="ours, trl or ours,trl (default both)")
    parser.add_argument(
        "--steps", type=int, default=2, help="measured steps per run (default 2: TRL takes about a minute a step)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="steps run first, not measured (default 1)")
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per step (default 8)")
    parser.add_argument("--max-length", type=int, default=512, help="prompt + response tokens (default 512)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, both sides (default 2)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate, both sides (default 1e-4)")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta (default 0.1)")
    parser.add_argument("--lora-r", type=int, default=LORA["r"], help="LoRA rank of the lora configs (default 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-optim", default="adamw_torch", help="TRL's optim (default adamw_torch = ours)")
    parser.add_argument(
        "--ours-variant",
        nargs="*",
        default=list(OURS_VARIANT),
        help="Hydra overrides of an extra row per configuration: ours again with them, against the same TRL run "
        f"(default {' '.join(OURS_VARIANT)}; give the flag alone for no such row)",
    )
    parser.add_argument(
        "--ours-preload",
        metavar="LIBRARY",
        help="another row per configuration: ours with LD_PRELOAD=LIBRARY (e.g. tcmalloc or jemalloc: docs/models.md, "
        "'Memory on CPU'), against the same TRL run",
    )
    parser.add_argument(
        "--ours-overrides", nargs="*", default=[], help="extra Hydra overrides for our side, e.g. output_layer_chunk=null"
    )
    parser.add_argument("--out", default="/tmp/bench_memory", help="folder for results.md / .json, profile.md / .json")
    parser.add_argument("--profile", action="store_true", help="instead of the benchmark: where ours' memory goes in one step")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed to each worker process (default 1800)")
    parser.add_argument("--wait-quiet", type=float, default=30, help="before each run, wait up to this long for idle CPUs (s)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def spawn(role: str, spec: dict, tmp: Path, timeout: int) -> dict:
    """One worker of this file in a fresh interpreter (bench_dpo.spawn); a failed worker gives
    ``{"error": its last lines}`` instead of ending the benchmark."""
    try:
        return bench_dpo.spawn(role, spec, tmp, timeout=timeout, script=str(Path(__file__).resolve()))
    except SystemExit as e:
        text = str(e).strip().splitlines()
        errors = [line for line in text if "Error" in line or "error" in line.split(":")[0]]
        return {"error": (errors or text or ["unknown"])[-1][:300], "log": "\n".join(text[-40:])}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen configurations (or the profile) and write the tables; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.worker:
        bench_dpo.run_worker(args.worker, args.spec, args.result, workers=WORKERS)
        return 0
    model = find_model(args.model)
    if args.ours_preload and not Path(args.ours_preload).is_file():
        raise SystemExit(
            f"Error: --ours-preload {args.ours_preload}: no such file; e.g. apt install libtcmalloc-minimal4 gives "
            "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4."
        )
    if not bench_dpo.HH.exists():
        raise SystemExit(f"Error: {bench_dpo.HH} is absent: this benchmark reads ../shared (the folder beside the repository).")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    n_batches = max(args.warmup + args.steps, PROFILE_BATCHES if args.profile else 1)
    n_pairs = n_batches * args.batch_size
    started, code_before = time.time(), dpo_report._code_hash()
    setting = (
        f"{model.name}, batch {args.batch_size}, max_length {args.max_length}, fp32, {args.threads} threads, "
        f"{args.steps} measured steps after {args.warmup}; {dpo_report._code_state()}"
        + (f"; ours with {' '.join(args.ours_overrides)}" if args.ours_overrides else "")
    )
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = bench_dpo.base_spec(args, tmp, n_pairs, lora_r=args.lora_r, model_dir=str(model), tokenizer_dir=str(model))
        prep = spawn("prepare", base, tmp, args.timeout)
        if "error" in prep:
            raise SystemExit(f"Error: preparing the pairs failed: {prep['error']}\n{prep['log']}")
        measured = slice(args.warmup, args.warmup + args.steps)
        dpo_tokens = prep["tokens_per_batch"][measured]
        sft_tokens = prep["sft_tokens_per_batch"][measured]
        print(
            f"{setting}\npairs: {prep['n_fitting']} of {prep['n_hh_pairs']} HH pairs fit max_length {args.max_length} "
            f"untruncated; {n_pairs} used; per measured batch {sum(dpo_tokens) / len(dpo_tokens):.0f} DPO tokens "
            f"(chosen + rejected), {sum(sft_tokens) / len(sft_tokens):.0f} SFT tokens (prompt + chosen); "
            "TRL's collators give our exact batches (checked).",
            flush=True,
        )
        if args.profile:
            text, profiles = [f"## bench_memory.py --profile: {setting}", ""], {}
            for name in args.configs:
                bench_dpo.wait_quiet(args.wait_quiet)
                r = spawn("profile", config_spec(base, name, "ours", args.ours_overrides), tmp, args.timeout)
                if "error" in r:
                    print(f"profile {name}: FAILED: {r['error']}\n{r['log']}", flush=True)
                    text.append(f"### {name}: failed: {r['error']}\n")
                else:
                    r.pop("log", None)
                    text.append(profile_markdown(name, r))
                    print(text[-1], flush=True)
                profiles[name] = r
            (out_dir / "profile.md").write_text("\n".join(text))
            (out_dir / "profile.json").write_text(
                json.dumps({"args": vars(args), "setting": setting, "profiles": profiles}, indent=1)
            )
            print(f"written: {out_dir / 'profile.md'}, {out_dir / 'profile.json'}")
            return 1 if any("error" in r for r in profiles.values()) else 0

        rows = []
        for name in args.configs:
            task = CONFIGS[name][0]
            tokens = sft_tokens if task == "sft" else dpo_tokens
            per_step = sum(tokens) / len(tokens)
            figures = {"ours": None, "trl": None}
            for side in args.sides:
                waited, _ = bench_dpo.wait_quiet(args.wait_quiet)
                role = "trl_sft" if (side, task) == ("trl", "sft") else side
                r = spawn(role, config_spec(base, name, side, args.ours_overrides), tmp, args.timeout)
                if "error" in r:
                    figures[side] = {"error": r["error"]}
                    print(f"{name:12} {side:4} FAILED: {r['error']}\n{r['log']}", flush=True)
                    continue
                f = figures[side] = side_figures(r, task, args.batch_size, per_step)
                f["waited_s"] = waited
                unit = "tokens/s" if task == "sft" else "pairs/s"
                print(
                    f"{name:12} {side:4} {f['per_s']:9.3f} {unit}, peak RSS {f['rss_peak_mib']:.0f} MiB ({f['rss_peak_gb']:.2f} GB), "
                    f"steps {', '.join(f'{s:.1f}' for s in f['steps_s'])} s, step-0 loss {f['losses'][0]:.6f}, "
                    f"other processes {f['others_cpu']:.2f} CPUs, run {f['wall_s']:.0f} s",
                    flush=True,
                )
            rows.append(compare(name, figures["ours"], figures["trl"]))
            variants = [args.ours_variant] if args.ours_variant else []
            variants += [[f"LD_PRELOAD={Path(args.ours_preload).name}"]] if args.ours_preload else []
            for extra in variants if "ours" in args.sides else []:
                bench_dpo.wait_quiet(args.wait_quiet)
                preload = extra[0].startswith("LD_PRELOAD=")
                spec = config_spec(base, name, "ours", args.ours_overrides if preload else [*args.ours_overrides, *extra])
                if preload:
                    spec["env"] = {"LD_PRELOAD": str(Path(args.ours_preload).resolve())}
                r = spawn("ours", spec, tmp, args.timeout)
                label = " + ".join([name, *extra])
                if "error" in r:
                    print(f"{label} ours FAILED: {r['error']}\n{r['log']}", flush=True)
                    variant = {"error": r["error"]}
                else:
                    variant = side_figures(r, task, args.batch_size, per_step)
                    unit = "tokens/s" if task == "sft" else "pairs/s"
                    print(
                        f"{label} ours {variant['per_s']:9.3f} {unit}, peak RSS {variant['rss_peak_mib']:.0f} MiB "
                        f"({variant['rss_peak_gb']:.2f} GB), steps {', '.join(f'{s:.1f}' for s in variant['steps_s'])} s, "
                        f"other processes {variant['others_cpu']:.2f} CPUs, run {variant['wall_s']:.0f} s",
                        flush=True,
                    )
                rows.append(compare(name, variant, figures["trl"], extra))
    checks = verdicts(rows)
    title = (
        f"## bench_memory.py, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs: ours vs TRL "
        f"{_version_or_absent('trl')} (peft {_version_or_absent('peft')}), {setting}"
    )
    text = results_markdown(rows, checks, title)
    if dpo_report._code_hash() != code_before:
        text += "\nWARNING: the project's code changed on disk during this run.\n"
    text += f"\ntotal wall time {time.time() - started:.0f} s\n"
    print("\n" + text)
    (out_dir / "results.md").write_text(text)
    (out_dir / "results.json").write_text(
        json.dumps({"args": vars(args), "setting": setting, "prepare": prep, "rows": rows, "targets": checks}, indent=1)
    )
    print(f"written: {out_dir / 'results.md'}, {out_dir / 'results.json'}")
    return 1 if any(r[s] and "error" in r[s] for r in rows for s in SIDES) else 0


def _version_or_absent(pkg: str) -> str:
    """The installed version of ``pkg``, or "absent"."""
    try:
        return dpo_report._version(pkg)
    except Exception:  # noqa: BLE001 - PackageNotFoundError
        return "absent"


if __name__ == "__main__":
    sys.exit(main())
