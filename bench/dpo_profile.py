"""bench_dpo.py --profile's worker: torch.profiler, cProfile and a phase breakdown of a few steps of one side."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from measure import _mark, _set_threads, _steady
from our_worker import _our_trainer
from trl_worker import _trl_trainer

REPO = Path(__file__).resolve().parents[1]


def _ops_and_cprofile(trainer, batch_at, n_warm: int, n_prof: int) -> dict:
    """torch.profiler's op table over ``n_prof`` steps after ``n_warm`` warm-up steps, then
    cProfile over the next ``n_prof``; ``batch_at(k)`` is batch k."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    out: dict = {}
    batches = [batch_at(k) for k in range(n_warm + 3 * n_prof)]
    trainer.policy.train()
    for b in batches[:n_warm]:
        trainer.train_step(b)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for k in range(n_warm, n_warm + n_prof):
            trainer.train_step(batch_at(k))
    out["ops"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=48)
    pr = cProfile.Profile()
    pr.enable()
    for k in range(n_warm + n_prof, n_warm + 2 * n_prof):
        trainer.train_step(batch_at(k))
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(28)
    out["cprofile"] = s.getvalue()
    return out


def _timer(phases: dict):
    """``timed(name, fn)``: ``fn`` wrapped to add its wall seconds to ``phases[name]`` (``name``
    may be a callable giving the label at call time)."""

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                label = name() if callable(name) else name
                phases[label] += time.perf_counter() - t0

        return wrapper

    return timed


def _phase_breakdown(trainer, elements: list, pad: int, bs: int, steps: range) -> dict:
    """The real train_step over ``steps``, with timers wrapped around its pieces (model forwards
    by hooks; no file of the project is changed); "other" is the rest of the step. Returns
    {"phases": seconds per step by piece, "others_cpu"}."""
    from collections import defaultdict

    import torch

    import losses as L
    from modeling import logprobs, optimization
    from preference_datasets import collate

    phases: dict[str, float] = defaultdict(float)
    timed = _timer(phases)

    def grad_label(what):
        return lambda: f"{what} ({'policy' if torch.is_grad_enabled() else 'reference'})"

    for label, model in (("policy", trainer.policy), ("reference", trainer.reference_model)):
        if model is not None:
            starts: list[float] = []
            model.register_forward_pre_hook(lambda m, a, s=starts: s.append(time.perf_counter()))
            model.register_forward_hook(
                lambda m, a, o, s=starts, n=label: phases.__setitem__(
                    f"{n} model forward", phases[f"{n} model forward"] + time.perf_counter() - s.pop()
                )
            )
    logprobs.get_batch_logps = timed(grad_label("get_batch_logps"), logprobs.get_batch_logps)
    L.dpo_loss = timed("dpo_loss", L.dpo_loss)
    torch.Tensor.backward = timed("backward", torch.Tensor.backward)
    optimization.clip_gradients = timed("clip_gradients", optimization.clip_gradients)
    trainer.optimizer.step = timed("optimizer.step (AdamW)", trainer.optimizer.step)
    total = 0.0
    m0 = _mark()
    for k in steps:
        t0 = time.perf_counter()
        batch = timed("collate", collate)(elements[k * bs : (k + 1) * bs], pad)
        trainer.train_step(batch)
        total += time.perf_counter() - t0
    phases["other (python, metrics, inputs, scheduler, zero_grad)"] = total - sum(phases.values())
    return {"others_cpu": _steady([m0, _mark()], 0)["others_cpu"], "phases": {k: v / len(steps) for k, v in phases.items()}}


def _profile_trl(spec: dict, n_warm: int, n_prof: int) -> dict:
    """torch.profiler's op table over TRL's steps ``n_warm`` to ``n_warm + n_prof``."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    class Prof(TrainerCallback):
        def __init__(self):
            self.prof = profile(activities=[ProfilerActivity.CPU])

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == n_warm:
                self.prof.__enter__()
            elif state.global_step == n_warm + n_prof:
                self.prof.__exit__(None, None, None)

    p = Prof()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trl_trainer({**spec, "steps": n_prof}, tmp, callbacks=[p])
        trainer.train()
    return {"ops": p.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22, max_name_column_width=48)}


def worker_profile(spec: dict) -> dict:
    """torch.profiler over a few steps (after warm-up) of one side; for ours also a phase
    breakdown that replays BasicTrainer.get_batch_metrics / train_step piece by piece."""
    sys.path.insert(0, str(REPO))
    _set_threads(spec["threads"])

    n_warm, n_prof = spec["warmup"], spec["steps"]
    if spec["side"] != "ours":
        return _profile_trl(spec, n_warm, n_prof)
    from preference_datasets import collate

    with tempfile.TemporaryDirectory() as tmp:
        trainer, elements, _ = _our_trainer(spec, tmp)
        pad, bs = trainer.tokenizer.pad_token_id, spec["batch_size"]
        out = _ops_and_cprofile(trainer, lambda k: collate(elements[k * bs : (k + 1) * bs], pad), n_warm, n_prof)
        out.update(_phase_breakdown(trainer, elements, pad, bs, range(n_warm + 2 * n_prof, n_warm + 3 * n_prof)))
    return out
