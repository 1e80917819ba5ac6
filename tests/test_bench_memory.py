"""bench/bench_memory.py (issue 14: memory and speed on a real vocabulary, ours vs TRL) and the
variants of bench/bench_gpu_dpo.py: the command line, the ratios and the targets' verdicts
(figures by hand), where a saved tensor is counted, and the harness itself on stories260K at a
tiny size (one end-to-end run in subprocesses; the SFT and profile workers in this process)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, needs_shared

sys.path.insert(0, str(REPO / "bench"))
import bench_gpu_dpo  # noqa: E402
import bench_memory as bm  # noqa: E402
import memory_profile  # noqa: E402

LN2 = math.log(2)


def needs_trl():
    """Skip unless TRL (requirements-bench.txt) and peft are installed."""
    pytest.importorskip("trl", reason="TRL is not installed: pip install -r requirements-bench.txt")
    pytest.importorskip("peft", reason="peft is not installed")


# ---------------------------------------------------------------------------- command line


def test_defaults_are_the_issue_settings_and_subsets_parse(capsys):
    args = bm.build_parser().parse_args([])
    assert (args.batch_size, args.max_length, args.threads, args.steps, args.warmup) == (8, 512, 2, 2, 1)
    assert args.configs == ["dpo-full", "dpo-full-ac", "dpo-lora", "dpo-lora-ac", "sft"]
    assert args.sides == ["ours", "trl"]
    args = bm.build_parser().parse_args(["--configs", "sft, dpo-lora-ac", "--sides", "ours", "--steps", "5"])
    assert args.configs == ["sft", "dpo-lora-ac"] and args.sides == ["ours"] and args.steps == 5
    with pytest.raises(SystemExit) as exc:
        bm.build_parser().parse_args(["--configs", "dpo-full,dpo-qlora"])
    assert exc.value.code == 2
    assert "unknown configuration 'dpo-qlora'; choose from dpo-full" in capsys.readouterr().err


def test_a_missing_model_is_one_sentence_naming_the_build_script(tmp_path):
    with pytest.raises(SystemExit) as exc:
        bm.main(["--model", str(tmp_path / "smollm2")])
    message = str(exc.value)
    assert message.startswith("Error: no model at ") and str(tmp_path / "smollm2") in message
    assert "get-smollm2.sh" in message and message.count("\n") == 0


def test_each_configuration_asks_both_sides_for_the_same_thing():
    base = {"beta": 0.1, "lora_r": 16}
    ours = bm.config_spec(base, "dpo-lora-ac", "ours", ["output_layer_chunk=null"])
    trl = bm.config_spec(base, "dpo-lora-ac", "trl", [])
    assert ours["loss"] == "dpo" and ours["activation_checkpointing"] and trl["activation_checkpointing"]
    assert ours["overrides"] == [
        "activation_checkpointing=true",
        "model.lora.r=16",
        "model.lora.alpha=32",
        "model.lora.dropout=0.0",
        "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
        "output_layer_chunk=null",  # the user's own last: they win
    ]
    assert trl["lora"] == {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ours["lora"]["target_modules"]}
    assert "overrides" not in trl
    sft = bm.config_spec(base, "sft", "ours", [])
    assert sft["loss"] == "sft" and sft["overrides"] == ["activation_checkpointing=false"] and sft["lora"] is None


# ---------------------------------------------------------------------------- ratios and targets


def side(per_s: float, rss_mib: float, losses=(0.693147, 0.5)) -> dict:
    return {
        "per_s": per_s,
        "tokens_per_s": per_s * 100,
        "rss_peak_mib": rss_mib,
        "rss_peak_gb": rss_mib * 2**20 / 1e9,
        "losses": list(losses),
    }


def test_ratios_are_ours_over_trl_and_the_targets_judge_them():
    rows = [
        bm.compare("dpo-full", side(2.0, 3000), side(0.4, 12000)),  # 5.0x as fast, 0.25x the memory
        bm.compare("dpo-full-ac", side(1.5, 4000), side(0.3, 9000)),  # 4000 MiB = 4.194 GB > 4 GB
        bm.compare("sft", side(1000.0, 1000, (2.0,)), side(600.0, 1500, (2.0001,))),  # 1.67x, 0.67x
        bm.compare("dpo-lora", side(1.0, 1000), {"error": "FAILED"}),
    ]
    full, ac, sft, lora = rows
    assert full["speed_ratio"] == pytest.approx(5.0) and full["rss_ratio"] == pytest.approx(0.25)
    assert ac["ours_rss_gb"] == pytest.approx(4000 * 1048576 / 1e9)
    assert full["max_loss_diff"] == 0.0 and sft["max_loss_diff"] == pytest.approx(1e-4)
    assert lora["speed_ratio"] is None and lora["ours_rss_gb"] == pytest.approx(1000 * 1048576 / 1e9)
    got = {(c["config"], c["figure"]): c["verdict"] for c in bm.verdicts(rows)}
    assert got == {
        ("dpo-full", "rss_ratio"): "pass",  # 0.25 <= 0.3
        ("dpo-full", "speed_ratio"): "pass",  # 5.0 >= 4
        ("dpo-full-ac", "ours_rss_gb"): "FAIL",  # 4.19 GB > 4
        ("dpo-lora", "speed_ratio"): "not measured",  # TRL's side failed
        ("dpo-lora", "rss_ratio"): "not measured",
        ("dpo-lora-ac", "ours_rss_gb"): "not measured",  # not run
        ("sft", "speed_ratio"): "FAIL",  # 1.67 < 2
        ("sft", "rss_ratio"): "FAIL",  # 0.67 > 0.5
    }
    text = bm.results_markdown(rows, bm.verdicts(rows), "## title")
    assert "| dpo-full | 2 pairs/s | 0.4 pairs/s | 5.00 |" in text
    assert "| DPO full, AC on both: ours <= 4 GB | dpo-full-ac | 4.19 | FAIL |" in text
    assert "- dpo-lora trl: FAILED" in text


def test_a_variant_row_is_judged_on_its_own_against_the_same_trl_run():
    """``--ours-variant``: ours again with extra overrides, a row of its own beside the default one;
    each target is judged per row (both figures of "in one run" from the same row)."""
    trl = side(0.1, 20000)
    variant = ["malloc_mmap_threshold_mib=1"]
    rows = [
        bm.compare("dpo-full", side(0.6, 6200), trl),  # 6.0x, 0.31x: memory fails
        bm.compare("dpo-full", side(0.45, 5800), trl, variant),  # 4.5x, 0.29x: both pass
        bm.compare("dpo-full-ac", side(0.5, 4000), side(0.1, 9000)),  # 4.19 GB
        bm.compare("dpo-full-ac", side(0.4, 3700), side(0.1, 9000), variant),  # 3.88 GB
    ]
    assert rows[1]["label"] == "dpo-full + malloc_mmap_threshold_mib=1" and rows[1]["variant"] == variant
    assert rows[1]["speed_ratio"] == pytest.approx(4.5) and rows[1]["rss_ratio"] == pytest.approx(0.29)
    got = {(c["label"], c["figure"]): c["verdict"] for c in bm.verdicts(rows) if c["config"].startswith("dpo-full")}
    assert got == {
        ("dpo-full", "rss_ratio"): "FAIL",
        ("dpo-full", "speed_ratio"): "pass",
        ("dpo-full + malloc_mmap_threshold_mib=1", "rss_ratio"): "pass",
        ("dpo-full + malloc_mmap_threshold_mib=1", "speed_ratio"): "pass",
        ("dpo-full-ac", "ours_rss_gb"): "FAIL",
        ("dpo-full-ac + malloc_mmap_threshold_mib=1", "ours_rss_gb"): "pass",
    }
    text = bm.results_markdown(rows, bm.verdicts(rows), "## title")
    assert "| dpo-full + malloc_mmap_threshold_mib=1 | 0.45 pairs/s | 0.1 pairs/s | 4.50 |" in text
    assert "| DPO full, no AC: peak RSS <= 0.3x TRL's | dpo-full + malloc_mmap_threshold_mib=1 | 0.29 | pass |" in text
    assert bm.build_parser().parse_args([]).ours_variant == ["malloc_mmap_threshold_mib=1"]
    assert bm.build_parser().parse_args(["--ours-variant"]).ours_variant == []


def test_a_saved_tensor_is_counted_where_it_was_saved():
    decoder = "base_model.model.model"  # peft's LlamaForCausalLM: the blocks' stack
    cases = {
        "base_model.model.model.layers.3.self_attn.q_proj.lora_A.default": "attention",
        "base_model.model.model.layers.0.mlp.down_proj": "MLP",
        "base_model.model.model.layers.11.input_layernorm": "blocks: norms, residual adds",
        "base_model.model.model.layers.11": "blocks: norms, residual adds",
        "base_model.model.model.embed_tokens": "embeddings",
        "base_model.model.model.norm": "base model outside the blocks (final norm, rotary, masks)",
        "base_model.model.model": "base model outside the blocks (final norm, rotary, masks)",
        "base_model.model.lm_head": "output layer and log-probs",
        "base_model.model": "output layer and log-probs",  # the CausalLM: its logits
        None: "output layer and log-probs",  # outside any module: log-softmax, gather
    }
    for name, part in cases.items():
        assert memory_profile.part_of(name, decoder) == part, name


def test_bench_gpu_dpo_variants_are_measured_against_ours_defaults():
    ours = {"step_s": 0.5, "cuda_peak_mib": 6000.0, "losses": [0.693147, 0.60]}
    trl = {"step_s": 1.0, "cuda_peak_mib": 9000.0, "losses": [0.693147, 0.61]}
    variants = {
        "chunk-off": {"step_s": 0.625, "cuda_peak_mib": 9000.0, "rss_peak": 2000.0, "losses": [0.693147, 0.6001]},
        "trl-lora": {"step_s": 0.8, "cuda_peak_mib": 3000.0, "rss_peak": 2500.0, "losses": [0.693147, 0.58]},
        "lora": {"error": "FAILED: Error: model.lora ..."},
    }
    rows = {r["variant"]: r for r in bench_gpu_dpo.variant_rows(variants, ours, trl, batch_size=16, tok_per_step=8000)}
    off = rows["chunk-off"]
    assert off["pairs_per_s"] == pytest.approx(16 / 0.625) and off["tokens_per_s"] == pytest.approx(8000 / 0.625)
    assert off["speed_vs_ours"] == pytest.approx(0.8) and off["cuda_vs_ours"] == pytest.approx(1.5)
    assert off["max_loss_diff_vs_ours"] == pytest.approx(1e-4) and "speed_vs_trl" not in off
    tl = rows["trl-lora"]
    assert tl["speed_vs_trl"] == pytest.approx(1.25) and tl["cuda_vs_trl"] == pytest.approx(1 / 3)
    assert rows["lora"]["status"].startswith("FAILED")
    with pytest.raises(Exception, match="unknown variant 'qlora'"):
        bench_gpu_dpo.parse_variants("chunk-off,qlora")
    assert bench_gpu_dpo.parse_variants("none") == []


# ---------------------------------------------------------------------------- the harness on stories260K


def bare_import_rss_mib() -> float:
    """Peak RSS (VmHWM: of this process's own memory, which ru_maxrss is not: Linux carries the
    peak of the process that started it across exec) of a fresh interpreter that imports torch
    and transformers and nothing else: less than any worker of the harness can report, more than
    its torch-free parent holds."""
    code = "import torch, transformers; print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0])"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout) / 1024


def not_started_by_pytest(cmd: list[str]) -> list[str]:
    """``cmd`` run by a bash that forks it, so its ru_maxrss starts from that small bash and not
    from this test process's peak (inherited across exec, as a shell's child does not)."""
    return ["bash", "-c", '"$@"; exit $?', "bash", *cmd]


@pytest.mark.timeout(300)
def test_end_to_end_on_stories260k_with_activation_checkpointing(tmp_path):
    """One configuration, both sides, each in its own process: the same work (step-0 loss ln 2 on
    both, the losses agree), each side's own peak RSS, the ratios and verdicts written."""
    needs_trl()
    model = needs_shared("models", "stories260K")
    needs_shared("data", "hh-rlhf")
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "bench" / "bench_memory.py"), "--model", str(model), "--configs", "dpo-full-ac"]
    cmd += ["--steps", "1", "--warmup", "1", "--batch-size", "2", "--max-length", "128", "--wait-quiet", "0", "--out", str(out)]
    done = subprocess.run(not_started_by_pytest(cmd), capture_output=True, text=True, timeout=280, cwd=REPO)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    row, variant = result["rows"]  # ours as configured, then ours with --ours-variant's default
    ours, trl = row["ours"], row["trl"]
    assert variant["label"] == "dpo-full-ac + malloc_mmap_threshold_mib=1" and variant["trl"] == trl
    assert variant["ours"]["losses"] == pytest.approx(ours["losses"], abs=1e-6)  # the allocator changes no number
    assert ours["malloc_mmap_threshold_mib"] is None and variant["ours"]["malloc_mmap_threshold_mib"] == 1
    for s in (ours, trl):
        assert s["losses"][0] == pytest.approx(LN2, abs=1e-5)  # policy == reference at step 0
        assert len(s["steps_s"]) == 2 and s["pairs_per_s"] == pytest.approx(2 / s["step_s"])
    assert row["max_loss_diff"] < 1e-4  # the same batches, the same model, the same optimizer
    floor = bare_import_rss_mib()  # each side's process imported torch and transformers, then trained
    assert ours["rss_peak_mib"] > floor and trl["rss_peak_mib"] > floor, (ours["rss_peak_mib"], trl["rss_peak_mib"], floor)
    assert row["speed_ratio"] == pytest.approx(ours["per_s"] / trl["per_s"])
    assert row["rss_ratio"] == pytest.approx(ours["rss_peak_mib"] / trl["rss_peak_mib"])
    verdict = {c["label"]: c["verdict"] for c in result["targets"] if c["config"] == "dpo-full-ac"}
    assert verdict == {"dpo-full-ac": "pass", "dpo-full-ac + malloc_mmap_threshold_mib=1": "pass"}  # well under 4 GB
    assert "| dpo-full-ac |" in (out / "results.md").read_text()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """bench_memory's prepare worker, run in this process on stories260K: 8 pairs in 4 batches of 2."""
    needs_trl()
    model = needs_shared("models", "stories260K")
    needs_shared("data", "hh-rlhf")
    import torch

    threads = torch.get_num_threads()
    tmp = tmp_path_factory.mktemp("bench_memory")
    base = {
        "threads": 1,
        "seed": 0,
        "batch_size": 2,
        "max_length": 128,
        "max_prompt_length": 64,
        "lr": 1e-4,
        "max_grad_norm": 1.0,
        "beta": 0.1,
        "lora_r": 4,
        "warmup": 1,
        "steps": 1,
        "n_pairs": 8,
        "trl_optim": "adamw_torch",
        "pairs_file": str(tmp / "pairs.json"),
        "tmp": str(tmp),
        "models": [],
        "model_dir": str(model),
        "tokenizer_dir": str(model),
    }
    prep = bm.worker_prepare(base)
    yield base, prep
    torch.set_num_threads(threads)


def test_sft_same_work_on_both_sides(prepared):
    base, prep = prepared
    pairs = json.loads(Path(base["pairs_file"]).read_text())
    # SFT tokens of a batch: prompt + chosen of its 2 pairs, no padding
    assert prep["sft_tokens_per_batch"][0] == sum(len(p["prompt_ids"]) + len(p["chosen_ids"]) for p in pairs[:2])
    ours = bm.worker_ours(bm.config_spec(base, "sft", "ours", []))
    trl = bm.worker_trl_sft(bm.config_spec(base, "sft", "trl", []))
    assert ours["n_trainable"] == ours["n_params"]
    assert len(ours["losses"]) == len(trl["losses"]) == 2
    for a, b in zip(ours["losses"], trl["losses"]):
        assert a == pytest.approx(b, abs=1e-4)  # mean NLL of the same chosen tokens, same updates


def test_profile_counts_the_floor_and_where_the_activations_are(prepared):
    base, _ = prepared
    from transformers import AutoModelForCausalLM

    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(base["model_dir"]).parameters())
    p = bm.worker_profile(bm.config_spec(base, "dpo-full", "ours", []))
    held = p["held"]
    assert held["policy_params"] == n and held["policy_weights"] == 4 * n  # fp32
    assert held["reference_weights"] == 4 * n  # a separate copy
    assert held["gradients"] == 4 * n and held["optimizer_state"] == 2 * 4 * n  # AdamW: exp_avg, exp_avg_sq
    parts = p["saved_by_part"]
    assert parts["attention"] > 0 and parts["MLP"] > 0 and parts["output layer and log-probs"] > 0
    assert p["saved_total"] == sum(parts.values())
    assert p["rss_peak_step"] >= p["rss_before_step"] > 0
    assert 0 < p["vocab_ops_self_cpu_s"] < p["ops_self_cpu_s"] and p["vocab"] == 512
    text = bm.profile_markdown("dpo-full", p)
    assert "sum: the floor" in text and "saved for backward" in text
