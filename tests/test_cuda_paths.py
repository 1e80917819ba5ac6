"""What differs on CUDA, checked on CPU: foreach optimizer kernels (torch's default on CUDA,
forced here with ``optimizer_foreach=true``), tensor parallelism with one process, the process
group's timeout and device, the reference precomputed by every rank, a model split over local
GPUs, more processes than GPUs, and the FSDP reference resharded after its forward.

Distributed runs are 2 processes (gloo) in their own process group, killed on timeout. Run as a
script under ``torch.distributed.run``, this file is the worker of
:func:`test_fsdp_reference_is_resharded_after_every_forward`.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

if __name__ == "__main__":  # the worker: this repository and tests/ on the path, as pytest has them
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import pytest
import torch
from conftest import compose_config, run_torchrun
from test_distributed import cli, weights
from test_distributed import finished_run as finished

import train
import trainers
import utils
from modeling import optimization, packing
from parallel import process_group
from runs import checkpoints, checks, launch, reference_cache

# 16 train and 8 eval examples, two batches of 8; checkpoints after 8 and 16 examples
SMALL = [
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=8",
    "n_examples=16",
    "eval_every=8",
    "data.arithmetic.n_train=16",
    "data.arithmetic.n_test=8",
    "progress_bar=false",
    "minimum_log_interval_secs=0",
    "warmup_steps=2",
    "keep_checkpoints=0",
    "sample_during_eval=false",
    "optimizer_foreach=true",  # as torch does on CUDA
    "sft_first.n_examples=null",  # one run, not model=tiny's two stages
]


def small(*overrides: str) -> list[str]:
    """SMALL with ``overrides`` in place of its settings of the same keys."""
    keys = {o.split("=")[0] for o in overrides}
    return [o for o in SMALL if o.split("=")[0] not in keys] + list(overrides)


def same_weights(a: Path, b: Path, atol: float) -> None:
    wa, wb = weights(a), weights(b)
    assert set(wa) == set(wb)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=atol, msg=name)


@pytest.fixture(scope="module")
def basic_run(tmp_path_factory) -> Path:
    """The single-process run (foreach kernels too) that the tensor-parallel runs must equal."""
    out = tmp_path_factory.mktemp("basic")
    run_dir, stop = train.main(compose_config([*SMALL, f"output_root={out}"]))
    assert stop is None
    return Path(run_dir)


# ----------------------------------------------------------------------------- 1, 2: tensor parallelism, foreach
# (2 processes with foreach kernels, resumed from shards: test_distributed.py::test_tensor_parallel_matches_basic[llama])


def test_tensor_parallel_with_one_process_trains_to_the_end(basic_run, tmp_path):
    # One GPU gives world_size 1: clip_grad_norm_ over DTensors (a 1-process mesh) and plain
    # tensors crashed even on CPU.
    run_dir = finished([*SMALL, "trainer=TensorParallelTrainer", "world_size=1"], tmp_path)
    assert (run_dir / checkpoints.FINISHED).exists()
    same_weights(basic_run, run_dir, atol=5e-5)


def test_parameter_groups_split_plain_tensors_from_dtensors_of_each_mesh():
    from torch.distributed.tensor import DTensor

    class FakeDTensor(DTensor):  # only the mesh matters; no process group needed
        def __new__(cls, mesh):
            obj = torch.Tensor._make_subclass(cls, torch.zeros(1))
            obj._spec = SimpleNamespace(mesh=mesh)
            return obj

    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    dp, tp = "dp-mesh", "tp-mesh"
    x, y, z = FakeDTensor(tp), FakeDTensor(dp), FakeDTensor(tp)
    groups = optimization.parameter_groups([a, x, b, y, z, c])
    assert [[id(t) for t in g] for g in groups] == [[id(a), id(b), id(c)], [id(x), id(z)], [id(y)]]
    assert [[id(t) for t in g] for g in optimization.parameter_groups([a, b])] == [[id(a), id(b)]]


@pytest.mark.parametrize("value", [1, "yes"])
def test_a_bad_optimizer_foreach_is_one_sentence(value):
    with pytest.raises(utils.ConfigError) as e:
        checks.validate_config(compose_config([f"optimizer_foreach={value}"]))
    assert str(e.value) == (
        f"optimizer_foreach must be true, false or null (torch's default: foreach kernels on GPU), got {value!r}."
    )


# ----------------------------------------------------------------------------- 3: the process group's timeout and device


@pytest.fixture
def fake_process_group(monkeypatch):
    """torch.distributed's init_process_group recorded instead of run; returns the calls."""
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    return calls


def test_the_timeout_reaches_init_process_group_and_no_device_on_cpu(fake_process_group, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert process_group.init_distributed(25) == 0
    assert fake_process_group == [(("gloo",), {"timeout": datetime.timedelta(minutes=25)})]


def test_on_cuda_the_group_is_bound_to_the_local_gpu(fake_process_group, monkeypatch):
    devices = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    process_group.init_distributed(90)
    assert devices == [1]
    assert fake_process_group == [(("nccl",), {"timeout": datetime.timedelta(minutes=90), "device_id": torch.device("cuda", 1)})]


def test_the_configured_timeout_is_what_train_main_passes(monkeypatch, tmp_path):
    seen = []

    class Stop(Exception):
        pass

    def init(minutes):
        seen.append(minutes)
        raise Stop

    monkeypatch.setattr(process_group, "init_distributed", init)
    for extra, minutes in (([], 60), (["dist_timeout_minutes=7.5"], 7.5)):
        with pytest.raises(Stop):
            train.main(compose_config([*SMALL, "trainer=FSDPTrainer", *extra, f"output_root={tmp_path}"]))
        assert seen.pop() == minutes


@pytest.mark.parametrize("value", [0, -5, "ten", "inf"])
def test_a_bad_timeout_is_one_sentence(value):
    with pytest.raises(utils.ConfigError) as e:
        checks.validate_config(compose_config([f"dist_timeout_minutes={value}"]))
    shown = float("inf") if value == "inf" else value
    assert str(e.value) == (
        "dist_timeout_minutes must be a number of minutes > 0 (how long a rank waits for the others before the run "
        f"aborts), got {shown!r}; e.g. dist_timeout_minutes=60."
    )


def test_a_bad_timeout_on_the_command_line_is_one_error_line_before_any_process_starts(tmp_path):
    code, text = cli(["trainer=FSDPTrainer", "world_size=2", "dist_timeout_minutes=0"], tmp_path / "out", timeout=120)
    assert code == 2, text[-3000:]
    assert [line for line in text.splitlines() if line.startswith("Error:")] == [
        "Error: dist_timeout_minutes must be a number of minutes > 0 (how long a rank waits for the others before the run "
        "aborts), got 0; e.g. dist_timeout_minutes=60."
    ]
    assert "Starting" not in text and "Traceback" not in text and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- 4: the reference precomputed by every rank


def test_fsdp_precompute_is_shared_by_the_ranks_and_equals_one_process(tmp_path, capsys):
    args = small("n_examples=8", "data.arithmetic.n_test=9", "eval_batch_size=4", "precompute_ref_log_probs=true")
    train.main(compose_config([*args, f"cache_dir={tmp_path / 'one'}", f"output_root={tmp_path / 'out1'}"]))
    assert "pairs cached in" in capsys.readouterr().out
    code, text = cli([*args, "trainer=FSDPTrainer", "world_size=2", f"cache_dir={tmp_path / 'two'}"], tmp_path / "out2")
    assert code == 0, text[-4000:]
    # 16 train + 9 eval examples, a contiguous share each, round(25 / 2) = 12 for rank 0 and 13 for
    # rank 1: batches of 4 make 3 calls on rank 0 and 4 on rank 1, so rank 0 adds a stand-in
    assert text.count("(12 + 13 computed by the 2 data-parallel ranks)") == 1, text[-3000:]
    [one] = list((tmp_path / "one").iterdir())
    [two] = list((tmp_path / "two").iterdir())
    assert one.name == two.name  # the same hash of the whole weights, taken on rank 0 before sharding
    a, b = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    assert set(a) == set(b) and len(a) > 0
    for key, (chosen, rejected) in a.items():
        assert b[key] == pytest.approx((chosen, rejected), rel=1e-5, abs=1e-5), key


def test_a_cache_that_cannot_be_written_is_a_reason_not_an_error(tmp_path):
    (tmp_path / "file").write_text("")
    reason = reference_cache.write_reference_cache(str(tmp_path / "file" / "cache.pt"), {"k": (1.0, 2.0)})
    assert reason.startswith(("NotADirectoryError", "FileExistsError")), reason
    assert reference_cache.write_reference_cache(str(tmp_path / "ok" / "cache.pt"), {"k": (1.0, 2.0)}) is None
    assert torch.load(tmp_path / "ok" / "cache.pt") == {"k": (1.0, 2.0)}


# ----------------------------------------------------------------------------- 5: a model split over local GPUs


def test_the_keep_mask_of_a_split_model_goes_to_the_cpu():
    split = SimpleNamespace(hf_device_map={"model.embed_tokens": 0, "model.layers": 0, "model.norm": 1, "lm_head": 1})
    one = SimpleNamespace(hf_device_map={"": 0})
    cuda0 = torch.device("cuda", 0)
    assert packing.keep_mask_device(split, cuda0) == torch.device("cpu")
    assert packing.keep_mask_device(one, cuda0) == cuda0
    assert packing.keep_mask_device(torch.nn.Linear(1, 1), "cuda:0") == cuda0


def test_the_packed_forward_indexes_the_logits_where_they_came_out(monkeypatch):
    # A split model returns logits on its last GPU; "meta" stands in for it here. The target
    # indices must go there, the mask into the model on the CPU, the log-probs back to ``device``.
    seen = {}

    class SplitModel(torch.nn.Module):
        hf_device_map = {"model.embed_tokens": 0, "lm_head": 1}
        config = SimpleNamespace(_attn_implementation="sdpa")

        def forward(self, input_ids, use_cache, logits_to_keep, **kwargs):
            seen["mask"] = logits_to_keep.device
            return SimpleNamespace(logits=torch.zeros(int(logits_to_keep.sum()), 11, device="meta"))

    def gathered(logits, rows, targets):
        seen["logits"], seen["rows"], seen["targets"] = logits.device, rows.device, targets.device
        return torch.zeros(len(rows))

    monkeypatch.setattr(packing.logprobs, "gathered_token_logps", gathered)
    rows = [
        packing.PackedRow([1, 2, 3], None, None, [0, 1], [2, 3], [0, 0]),
        packing.PackedRow([4, 5], None, None, [0], [5], [1]),
    ]
    token_logps, seqs = packing._packed_chunk_logps(SplitModel(), rows, torch.device("cpu"), keep_bool=True)
    assert seen == {
        "mask": torch.device("cpu"),
        "logits": torch.device("meta"),
        "rows": torch.device("meta"),
        "targets": torch.device("meta"),
    }
    assert token_logps.device == torch.device("cpu") and seqs.tolist() == [0, 0, 1]


def test_a_model_placed_by_device_map_is_never_moved():
    moved = []

    class Model(torch.nn.Linear):
        def to(self, *args, **kwargs):
            moved.append(self.name)
            return self

    def model(name, split):
        m = Model(2, 2)
        m.name = name
        if split:
            m.hf_device_map = {"": "cpu", "other": 1}
        return m

    for policy_split, reference_split in ((True, True), (False, True), (True, False)):
        moved.clear()
        fake = SimpleNamespace(policy=model("policy", policy_split), reference_model=model("reference", reference_split))
        trainers.BasicTrainer.prepare_models(fake)
        assert moved == [n for n, split in (("policy", policy_split), ("reference", reference_split)) if not split]
        assert fake.device == torch.device("cpu")


# ----------------------------------------------------------------------------- 6: more processes than GPUs


def test_more_processes_than_gpus_is_one_sentence_before_any_process_starts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    with pytest.raises(utils.ConfigError) as e:
        launch.launch(compose_config(["trainer=FSDPTrainer", "world_size=2"]))
    assert str(e.value) == (
        "world_size=2 asks for 2 processes on this machine, one per GPU, but it has 1 GPU; "
        "start at most 1 (world_size=1, or torchrun --nproc_per_node=1)."
    )


def test_under_torchrun_more_processes_per_node_than_gpus_is_the_same_sentence_on_every_rank(fake_process_group, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("set_device before the check"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    for local_rank in ("0", "2"):  # a rank with a GPU says it too: the node's first process prints it
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        with pytest.raises(
            utils.ConfigError,
            match=r"^LOCAL_WORLD_SIZE=3 \(processes per node\) asks for 3 processes on this machine, one per GPU, but it has 2 GPUs; start at most 2 ",
        ):
            process_group.init_distributed()
    assert fake_process_group == []


# ----------------------------------------------------------------------------- 7: the FSDP reference resharded


def test_fsdp_reference_is_resharded_after_every_forward(tmp_path):
    # FSDP2 keeps the root's weights (embeddings, norm, output layer) gathered after a forward,
    # waiting for a backward the no-grad reference never runs.
    returncode, text = run_torchrun(["tests/test_cuda_paths.py", str(tmp_path)], env={"PYTHONUNBUFFERED": "1"})
    assert returncode == 0, text[-4000:]
    # eval at 0 and 8 (one batch each), 2 training steps, and the final eval: 5 reference forwards
    for rank in (0, 1):
        assert f"rank {rank}: root sharded after 5 of 5 reference forwards" in text, text[-3000:]


def reshard_worker(out: str) -> None:
    """Train FSDP over 2 ranks with a live reference; after each reference forward, check that its
    root's parameters (all outside the transformer blocks) are DTensors, i.e. sharded again."""
    from torch.distributed.tensor import DTensor

    checks = []

    def attach(trainer):
        reference, real = trainer.reference_model, trainer.reference_logps
        root = {n for n, _ in reference.named_parameters() if ".layers." not in n}
        assert root and all(isinstance(p, DTensor) for n, p in reference.named_parameters() if n in root)

        def spy(batch):
            result = real(batch)
            checks.append(all(isinstance(p, DTensor) for n, p in reference.named_parameters() if n in root))
            return result

        trainer.reference_logps = spy

    config = compose_config([*SMALL, "trainer=FSDPTrainer", "world_size=2", f"output_root={out}"])
    rank = int(os.environ["RANK"])
    code = 0
    try:
        train.main(config, attach=attach)
        print(f"rank {rank}: root sharded after {sum(checks)} of {len(checks)} reference forwards", flush=True)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    os._exit(code)  # as processes.exit_rank: no interpreter teardown under gloo's threads


if __name__ == "__main__":
    reshard_worker(sys.argv[1])
