"""Run by tests/test_options_act_distributed.py under ``torch.distributed.run --nproc_per_node 2`` (gloo) as
``options_act_worker.py <path> <folder>``: every (objective, key) cell of tests/option_cells.py on the path of several
processes ``path`` (fsdp or tp), one forward and backward on each rank per cell, the models sharded once.

Rank 0 prints one line, ``RESULT <json>``: the cells whose key changed the loss or the gradient on some rank (``acts``),
those it changed on none (``silent``), those the path refuses with runs/checks.py's sentence (``refused``), and the
objectives whose loss or gradient the padded, packed and chunked forwards do not agree on (``differs``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/: option_cells and conftest
import option_cells as oc  # noqa: E402  (puts the repository on sys.path too)
import torch  # noqa: E402

import trainers  # noqa: E402
from parallel import process_group  # noqa: E402


def rebuilt(first: trainers.BasicTrainer, tiny: dict, config) -> trainers.BasicTrainer:
    """A trainer of ``first``'s class for ``config`` on ``first``'s models, which it sharded: BasicTrainer's own
    construction (the objective's settings, the optimizer, the eval batch) without placing the models again."""
    trainer = object.__new__(type(first))
    trainer.device, trainer.dist = first.device, first.dist
    trainer.prepare_models = lambda: None  # sharded once, by ``first``
    args = (first.policy, config, first.run_dir, tiny["tokenizer"], tiny["train"], tiny["test"], first.reference_model)
    trainers.BasicTrainer.__init__(trainer, *args)
    return trainer


def numbers(first, tiny: dict, loss_config: dict, path: str, forward: str = "packed", batch=None) -> tuple:
    """This rank's (loss, gradient shard) of ``loss_config`` on ``path`` with ``forward``'s packing and output layer."""
    trainer = rebuilt(first, tiny, oc.on_path(tiny["config"], loss_config, path))
    trainer.packed, trainer.output_layer_chunk = oc.PATHS[forward].packed, oc.PATHS[forward].chunk
    return oc.trainer_numbers(trainer, batch)


def key_cells(first, tiny: dict, path: str, cells: list, cache: dict, batch=None) -> dict:
    """Each (objective, key) of ``cells``: refused by the path, or whether it changes the loss or gradient on any rank (the
    numbers of each key's default config kept in ``cache``)."""
    out = {"acts": [], "silent": [], "refused": []}
    for name, key in cells:
        before, after = oc.base_config(name, key), oc.second_value(name, key)
        refused = oc.refusal(tiny["config"], before, path) or oc.refusal(tiny["config"], after, path)
        if refused:
            out["refused"].append([name, key, refused])
            continue
        if repr(before) not in cache:
            cache[repr(before)] = numbers(first, tiny, before, path, batch=batch)
        acted = first.dist.any_rank(oc.changed(cache[repr(before)], numbers(first, tiny, after, path, batch=batch)))
        out["acts" if acted else "silent"].append([name, key])
    return out


def forward_agreement(first, tiny: dict, path: str, cache: dict) -> list:
    """The (objective, forward) whose loss or gradient differs from the padded forward's on any rank (the packed
    numbers of ``cache`` where :func:`key_cells` computed them)."""
    differs = []
    for name in oc.TRAINED:
        loss = oc.default_loss(name)
        if oc.refusal(tiny["config"], loss, path):
            continue
        padded = numbers(first, tiny, loss, path, "padded")
        for forward in ("packed", "chunked"):
            known = cache.get(repr(loss)) if forward == "packed" else None
            other = known or numbers(first, tiny, loss, path, forward)
            same = all(torch.allclose(b, a, **oc.SAME) for a, b in zip(padded, other))
            if first.dist.any_rank(not same):
                differs.append([name, forward])
    return differs


def main() -> None:
    path, folder = sys.argv[1], Path(sys.argv[2])
    rank = process_group.init_distributed()
    torch.set_num_threads(1)
    tiny = oc.tiny_setup(folder / f"rank{rank}")
    config = oc.path_config(tiny["config"], oc.default_loss("dpo"), path)
    (tiny["tmp"] / "run").mkdir(parents=True, exist_ok=True)
    args = (tiny["policy"], config, str(tiny["tmp"] / "run"), tiny["tokenizer"], tiny["train"], tiny["test"], tiny["reference"])
    first = trainers.trainer_class(config)(*args)
    cache = {}  # repr(loss config) -> this rank's packed (loss, gradient) on the eval batch
    result = key_cells(first, tiny, path, oc.TRAINER_KEYS, cache)
    unpaired = key_cells(first, tiny, path, oc.UNPAIRED_KEYS, {}, oc.unpaired_rows(tiny))
    for kind, cells in unpaired.items():
        result[kind] += [[name, f"{key} (unpaired rows)", *rest] for name, key, *rest in cells]
    result["differs"] = forward_agreement(first, tiny, path, cache)
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    first.dist.wait_for_all()


if __name__ == "__main__":
    from runs import processes

    processes.exit_rank(main)  # leave without the interpreter's teardown, as training ranks do
