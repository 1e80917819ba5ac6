"""FSDPTrainer and TensorParallelTrainer on CPU: 2 processes, gloo, started by train.py itself.

Every run is a subprocess in its own process group with a timeout; on timeout the whole group
is killed, so no test can hang CI.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, compose_config, one_run, run_torchrun

import utils

COMMON = [
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=16",
    "n_examples=64",
    "eval_every=32",
    "data.arithmetic.n_train=64",
    "data.arithmetic.n_test=16",
    "progress_bar=false",
    "minimum_log_interval_secs=0",
    "warmup_steps=2",
    "keep_checkpoints=0",
    "optimizer_foreach=true",  # torch's default on CUDA: one foreach kernel per param group
    "sft_first.n_examples=null",  # one run, not model=tiny's two stages
    "plot_curves=false",  # a few seconds a run; tests/test_model_card.py and test_train.py look at the curves
]
FAMILIES = {
    "llama": [],
    "gpt_neox": [
        "~model.config",
        "+model.config={model_type:gpt_neox,hidden_size:64,intermediate_size:128,num_hidden_layers:2,"
        "num_attention_heads:4,max_position_embeddings:256,tie_word_embeddings:false}",
        "model.block_name=GPTNeoXLayer",
    ],
    "gpt2": [
        "~model.config",
        "+model.config={model_type:gpt2,n_embd:64,n_layer:2,n_head:4,n_positions:256}",
        "model.block_name=GPT2Block",
    ],
}


def start_train(args: list[str], out: Path) -> subprocess.Popen:
    """Start ``python train.py args`` in its own process group, output captured as text."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "train.py", *one_run(args), f"output_root={out}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def cli(args: list[str], out: Path, timeout: int = 300) -> tuple[int, str]:
    """Run ``python train.py args`` in its own process group; kill the group on timeout."""
    proc = start_train(args, out)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        pytest.fail(f"train.py {' '.join(args)} did not finish in {timeout} s (killed):\n{text[-3000:]}")
    return proc.returncode, text


def finished_run(args: list[str], out: Path) -> Path:
    code, text = cli(args, out)
    assert code == 0, text[-4000:]
    return next(p for p in out.iterdir() if p.is_dir())


def evals(run_dir: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "loss/eval" in r]


def weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "LATEST" / "policy.pt", weights_only=False)["state"]


def assert_same_run(a: Path, b: Path, atol: float = 5e-5) -> None:
    ea, eb = evals(a), evals(b)
    assert [r["step"] for r in ea] == [r["step"] for r in eb]
    for ra, rb in zip(ea, eb):
        for key in ("loss/eval", "logps_eval/chosen", "logps_eval/rejected"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), key
    # Adam divides by sqrt(v): a reduction-order difference of 1e-7 in a tiny gradient can move
    # one weight by ~1e-5 after a few steps, hence atol 5e-5 on weights of magnitude ~0.1.
    wa, wb = weights(a), weights(b)
    assert set(wa) == set(wb)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=atol, msg=name)


def assert_resumes_exactly_from_step_32(run_dir: Path, tmp_path: Path) -> None:
    """A copy of ``run_dir`` cut back to its step-32 checkpoint and resumed must end with the
    same weights as the full 64-example run."""
    cut = tmp_path / "cut" / run_dir.name
    shutil.copytree(run_dir, cut, symlinks=True)
    shutil.rmtree(cut / "step-64")
    (cut / "LATEST").unlink()
    (cut / "LATEST").symlink_to("step-32")
    (cut / "metrics.jsonl").write_text("")
    code, text = cli([f"resume={cut}"], tmp_path / "unused")
    assert code == 0, text[-4000:]
    assert "Resuming after 32 examples" in text
    for name, value in weights(run_dir).items():
        torch.testing.assert_close(weights(cut)[name], value, rtol=0, atol=1e-6, msg=name)


# Every run below, parallel or not, uses a constant learning rate (model=tiny's cosine schedule is
# stretched by an extension, so a run extended from 32 to 64 examples would differ from a 64-example one).
BASE = [*COMMON, "lr_scheduler=constant", "sample_during_eval=false"]
UNCHUNKED = "output_layer_chunk=null"  # the single-process runs take all logits at once ...
CHUNKED = "output_layer_chunk=5"  # ... and the parallel runs 5 positions at a time, which must change no number


@pytest.fixture(scope="module")
def basic_runs(tmp_path_factory):
    """One BasicTrainer run per model family: what the parallel trainers must reproduce."""
    runs = {}
    for family, extra in FAMILIES.items():
        out = tmp_path_factory.mktemp(f"basic-{family}")
        runs[family] = finished_run([*BASE, *extra, UNCHUNKED], out)
    return runs


def parallel_run(args: list[str], out: Path) -> tuple[Path, str]:
    """A finished parallel run of ``args`` (chunked output layer) and its output; the chunks were taken, not the fallback."""
    code, text = cli([*BASE, CHUNKED, *args], out)
    assert code == 0, text[-4000:]
    assert "unchunked output layer" not in text
    return next(p for p in out.iterdir() if p.is_dir()), text


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """One FSDP run of 2 processes with gradient accumulation, a precomputed reference and a chunked
    output layer: 32 examples, then extended with resume=<run> n_examples=64 (each rank works the
    extension out itself, from the shards written after 32 examples)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    args = ["trainer=FSDPTrainer", "world_size=2", "gradient_accumulation_steps=2", "precompute_ref_log_probs=true"]
    run_dir, text = parallel_run([*args, f"cache_dir={tmp / 'cache'}", "n_examples=32"], tmp / "out")
    finished_32 = (run_dir / "FINISHED").read_text()
    code, extended = cli([f"resume={run_dir}", "n_examples=64"], tmp / "unused")
    assert code == 0, extended[-4000:]
    return SimpleNamespace(run_dir=run_dir, text=text, extended=extended, finished_32=finished_32, cache=tmp / "cache")


def test_fsdp_with_accumulation_precomputed_reference_chunks_and_an_extension_matches_basic(basic_runs, fsdp_run):
    # gradient_accumulation_steps=2 (no reduction on the first micro-batch); rank 0 alone holds the
    # reference's weights, computes the log-probs once and sends them to rank 1; 32 examples, then
    # 64: the run must end as the single-process 64-example run with a live reference does, with its
    # evals at 0, 32 and 64.
    run_dir = fsdp_run.run_dir
    assert fsdp_run.text.count("pairs cached in") == 1, fsdp_run.text[-3000:]
    assert len(list(fsdp_run.cache.glob("reference_logps-*.pt"))) == 1
    assert fsdp_run.finished_32 == "32\n"
    message = f"Extending {run_dir} from n_examples=32 (32 examples) to n_examples=64 (64 examples)"
    assert fsdp_run.extended.count(message) == 1, fsdp_run.extended[-3000:]
    assert_same_run(basic_runs["llama"], run_dir)
    assert (run_dir / "FINISHED").read_text() == "64\n"
    assert sorted(p.name for p in (run_dir / "LATEST" / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_fsdp_resumes_exactly_from_shards(fsdp_run, tmp_path):
    assert_resumes_exactly_from_step_32(fsdp_run.run_dir, tmp_path)  # from the shards written after 32 examples


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_matches_basic(basic_runs, tmp_path, family):
    run_dir, _ = parallel_run([*FAMILIES[family], "trainer=TensorParallelTrainer", "world_size=2"], tmp_path / "tp")
    assert_same_run(basic_runs[family], run_dir)
    # Each rank's peak memory is logged, though both ranks see the same data.
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    memory = {k for r in recs for k in r if k.startswith("memory/")}
    assert {"memory/rank0_peak_rss_mib", "memory/rank1_peak_rss_mib"} <= memory
    assert {"memory/rank0_peak_setup_rss_mib", "memory/rank1_peak_setup_rss_mib"} <= memory
    # The export is the family's own Hugging Face layout (GPT-2's Conv1D restored).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "LATEST" / "hf")
    assert model.config.model_type == family
    if family == "llama":
        # Embeddings and norms stay plain tensors beside the blocks' DTensors (COMMON takes foreach
        # kernels, where one call over both failed at the first step): the optimizer's two param groups
        # come back from the shards written after 32 examples.
        assert_resumes_exactly_from_step_32(run_dir, tmp_path)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fsdp_by_tensor_parallel_2d_matches_basic_and_resumes_from_shards(basic_runs, tmp_path, family):
    # 4 processes: a 2 x 2 mesh, tensor parallel within each pair, FSDP across the pairs; each
    # pair takes half of every batch. Losses and weights must equal the single-process run's.
    args = [*FAMILIES[family], "trainer=FSDPTrainer", "world_size=4", "tensor_parallel_size=2"]
    run_dir, _ = parallel_run(args, tmp_path / "2d")
    assert_same_run(basic_runs[family], run_dir)
    assert len(list((run_dir / "LATEST" / "sharded").glob("*.distcp"))) == 4
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run_dir / "LATEST" / "hf").config.model_type == family
    if family != "llama":
        return
    assert_resumes_exactly_from_step_32(run_dir, tmp_path)  # from the 2-D shards


# FSDP over 2 ranks, and 2-D: 2 data-parallel groups of 2 tensor-parallel ranks
TOPOLOGIES = {"fsdp": ["world_size=2"], "fsdp_x_tp": ["world_size=4", "tensor_parallel_size=2"]}


def two_prompt_fsdp_args(tmp_path: Path, topology: str = "fsdp") -> list[str]:
    """FSDP over a json dataset of two prompts of very different lengths (1 and 90 characters),
    one per data-parallel group, so the groups' generations differ in length."""
    rows = [{"prompt": "Q" * n, "chosen": " yes", "rejected": " no"} for n in (1, 90)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["trainer=FSDPTrainer", *TOPOLOGIES[topology], "datasets=[json]", f"data.json.path={{train: {data}, test: {data}}}"]


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_fsdp_sampling_with_very_different_prompt_lengths_does_not_hang(tmp_path, topology):
    args = [
        *two_prompt_fsdp_args(tmp_path, topology),
        "batch_size=2",
        "eval_batch_size=2",
        "n_eval_examples=2",
        "n_examples=2",
        "eval_every=2",
        "n_eval_model_samples=2",
        "max_length=128",
        "max_prompt_length=100",
        "sample_top_p=1.0",
        "progress_bar=false",
    ]
    run_dir = finished_run(args, tmp_path / "out")
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert sorted(len(s["prompt"]) for s in samples if s["step"] == 0) == [1, 90]  # one prompt per data-parallel group


def test_fsdp_world_size_one_saves_and_checkpoints_load_in_other_trainers(tmp_path):
    # The reference repository crashed at its first save with one GPU under FSDP.
    # Its output layer takes 5 positions at a time (the live FSDP reference's too), the loading runs' 1024:
    # the same log-probs.
    fsdp = finished_run([*COMMON, "trainer=FSDPTrainer", "world_size=1", CHUNKED, "sample_during_eval=false"], tmp_path / "fsdp1")
    archive = fsdp / "LATEST" / "policy.pt"
    final_logps = evals(fsdp)[-1]["logps_eval/chosen"]
    for trainer in ("BasicTrainer", "TensorParallelTrainer"):
        run_dir = finished_run(
            [
                *COMMON,
                f"trainer={trainer}",
                "world_size=2",
                f"model.archive={archive}",
                "n_examples=8",
                "sample_during_eval=false",
            ],
            tmp_path / trainer,
        )
        first = evals(run_dir)[0]
        assert first["loss/eval"] == pytest.approx(math.log(2), abs=1e-6)
        assert first["logps_eval/chosen"] == pytest.approx(final_logps, rel=1e-5)


def test_only_rank_0_loads_weights_and_every_rank_gets_its_shard():
    # rank 1 builds its model on the meta device and receives its FSDP / TP shard from rank 0;
    # the sharded model must give the whole model's logits, with ties and rotary buffers kept.
    returncode, text = run_torchrun(["tests/shard_from_rank0_worker.py"])
    assert returncode == 0, text[-4000:]
    for rank in (0, 1):
        for family in ("llama", "gpt_neox", "gpt2"):
            for how in ("fsdp", "tp"):
                assert f"rank {rank}: {family} {how} ok" in text


def test_under_torchrun_a_model_tp_cannot_split_is_one_sentence_and_leaves_no_run_folder(tmp_path):
    # torchrun starts the ranks itself, so train.py's launcher check never runs: each rank must
    # check before making the run folder.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "train.py"]
    cmd += [*COMMON, "trainer=TensorParallelTrainer", f"output_root={tmp_path / 'out'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "cannot be split over 3 processes; choose a world_size that divides them" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [b"not a checkpoint", None], ids=["garbage", "no-state"])
def test_unreadable_archive_under_fsdp_is_one_sentence_on_every_rank(tmp_path, content):
    # Only rank 0 reads model.archive: its error must reach rank 1 (which would otherwise wait
    # for its shard forever) and be said once.
    archive = tmp_path / "policy.pt"
    if content is None:
        torch.save({"step_idx": 8}, archive)
    else:
        archive.write_bytes(content)
    code, text = cli([*COMMON, "trainer=FSDPTrainer", "world_size=2", f"model.archive={archive}"], tmp_path / "out", timeout=180)
    assert code == 2, text[-3000:]
    assert text.count(f"Error: model.archive={archive}") == 1, text[-3000:]
    assert "give the policy.pt of an earlier run" in text
    assert "Traceback" not in text


def test_tensor_parallel_rejects_other_families_by_name():
    from transformers import AutoConfig, AutoModelForCausalLM

    from parallel.tensor_parallel import tensor_parallel_plan

    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("opt", hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32, vocab_size=32)
    )
    with pytest.raises(utils.ConfigError, match="supports the Llama, GPT-NeoX \\(Pythia\\) and GPT-2 families, not 'opt'"):
        tensor_parallel_plan(model, 2)


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["trainer=TensorParallelTrainer", "world_size=3"],
            "4 attention heads \\(4 key/value heads\\) cannot be split over 3 processes",
        ),
        (
            [
                "trainer=TensorParallelTrainer",
                "world_size=2",
                "~model.config",
                "+model.config={model_type:opt,hidden_size:16,num_hidden_layers:1,num_attention_heads:2,ffn_dim:32}",
            ],
            "not 'opt'",
        ),
        (["trainer=FSDPTrainer", "world_size=2", "model=blank_model", "model.name_or_path=../no/such/model"], "is not a folder"),
        (
            ["trainer=FSDPTrainer", "world_size=2", "tensor_parallel_size=3"],
            "tensor_parallel_size \\(3\\) must divide the number of processes \\(2\\)",
        ),
        (
            ["trainer=FSDPTrainer", "world_size=3", "tensor_parallel_size=3"],
            "cannot be split over 3 processes; choose a tensor_parallel_size",
        ),
        (["trainer=FSDPTrainer", "world_size=4", "tensor_parallel_size=2", "batch_size=3"], "data-parallel groups .* \\(2\\)"),
        (
            ["trainer=TensorParallelTrainer", "world_size=2", "tensor_parallel_size=2"],
            "tensor_parallel_size is for trainer=FSDPTrainer",
        ),
    ],
)
def test_parallel_mistakes_are_one_sentence_before_any_process_starts(tmp_path, args, message):
    code, text = cli(args, tmp_path)
    assert code == 2, text[-3000:]
    assert "Starting" not in text and "Traceback" not in text
    assert len([line for line in text.splitlines() if line.startswith("Error:")]) == 1
    import re

    assert re.search(message, text), text[-2000:]


def test_sigterm_to_train_py_stops_all_ranks_after_a_checkpoint_of_a_bfloat16_run(tmp_path):
    # SIGTERM to the launching process reaches every rank once; they save, and it waits for them.
    # The run trains in bfloat16 mixed precision with activation checkpointing: its losses are finite.
    args = [
        *COMMON,
        "trainer=FSDPTrainer",
        "world_size=2",
        "model.fsdp_policy_mp=bfloat16",
        "activation_checkpointing=true",
        "n_examples=40000",  # a run far longer than the wait below (4000 was about 3 s: a late signal found it done)
        "data.arithmetic.n_train=400",
        "eval_every=100000",
        "sample_during_eval=false",
    ]
    proc = start_train(args, tmp_path)
    try:
        import time

        deadline = time.time() + 180
        while time.time() < deadline:
            runs = list(tmp_path.glob("*/metrics.jsonl"))
            if runs and sum(1 for _ in runs[0].open()) > 3:
                break
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode == 143, out[-3000:]
    assert out.count("Interrupted after") == 1 and "Traceback" not in out
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    state = torch.load(run_dir / "LATEST" / "trainer_state.pt", weights_only=False)
    assert 0 < state["example_counter"] < 40000
    assert len(list((run_dir / "LATEST" / "sharded").glob("*.distcp"))) == 2
    leftover = subprocess.run(["pgrep", "-f", f"output_root={tmp_path}"], capture_output=True, text=True).stdout
    assert not leftover.strip(), "worker processes outlived train.py"
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r[k] for r in recs for k in ("loss/train", "loss/eval") if k in r]
    assert len(losses) > 3 and all(math.isfinite(x) for x in losses), losses


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_fsdp_online_dpo_samples_scores_and_logs_completions_without_hanging(tmp_path, topology):
    # Every rank samples its own prompts (one 1-character prompt, one 90-character prompt, so the
    # ranks' generations differ in length) and scores them; the completions table is gathered on
    # rank 0. The peer's equivalent deadlocks under ZeRO-3 when only one rank generates.
    from test_online import save_tiny_reward_model

    rm = save_tiny_reward_model(tmp_path / "rm")
    args = [
        *two_prompt_fsdp_args(tmp_path, topology),
        "online.enabled=true",
        f"reward_model.name_or_path={rm}",
        "online.max_new_tokens=24",
        "online.n_log_completions=2",
        "batch_size=2",
        "eval_batch_size=2",
        "n_eval_examples=2",
        "n_examples=4",
        "eval_every=2",
        "max_length=128",
        "max_prompt_length=100",
        "progress_bar=false",
        "minimum_log_interval_secs=0",
    ]
    run_dir = finished_run(args, tmp_path / "out")
    table = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in table] == [0, 0, 2, 2, 4, 4]
    assert sorted(len(r["prompt"]) for r in table[:2]) == [1, 90]
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if "objective/kl" in r]
    assert train_recs[0]["objective/kl"] == pytest.approx(0.0, abs=1e-4)  # policy = reference at step 0
    if train_recs[0].get("loss/train") is not None:
        assert train_recs[0]["loss/train"] == pytest.approx(math.log(2), abs=1e-4)


def test_under_torchrun_the_presets_sft_stage_is_one_sentence_not_dpo_from_the_random_model(tmp_path):
    # Before: each rank skipped model=tiny's SFT stage without a word and trained DPO from the random model.
    args = [a for a in COMMON if not a.startswith("sft_first")]
    code, text = run_torchrun(["train.py", *args, "trainer=FSDPTrainer", f"output_root={tmp_path / 'out'}"], timeout=180)
    assert code != 0, text[-3000:]  # (torchrun reports its failed ranks with its own traceback)
    n = compose_config([]).sft_first.n_examples
    sentence = (
        f"Error: sft_first.n_examples={n} (set by the model preset) runs two runs (SFT, then this one), and torchrun runs "
        f"each rank as one; run the SFT stage first (loss=sft n_examples={n} sft_first.n_examples=null), then this command "
        "with sft_first.n_examples=null model.archive=<SFT run>/LATEST/policy.pt, or both stages on one node with python "
        "train.py trainer=FSDPTrainer world_size=<processes> (no torchrun)."
    )
    assert text.count(sentence) == 1, text[-3000:]  # said once, by the node
    assert not (tmp_path / "out").exists()
