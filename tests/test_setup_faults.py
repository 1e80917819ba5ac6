"""Faults around a run's setup (issue 24): each job of a Hydra multirun reports its own peak memory."""

from __future__ import annotations

from pathlib import Path

from conftest import TINY, compose_config, metric_records


def _rss_mib() -> float:
    """This process's resident memory now, MiB (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def test_each_job_of_a_multirun_reports_its_own_peak_memory(tmp_path):
    """A multirun runs its jobs in one process (train.main once per job); a job's memory/*
    peak is its own: 1 GiB touched and freed between two jobs does not reach the second job's peak
    (the process's peak would be at least 1 GiB above the memory in use when it starts)."""
    import train

    first, _ = train.main(compose_config([*TINY, f"output_root={tmp_path / 'a'}"]))
    block = bytearray(2**30)
    block[:: 2**12] = b"\x01" * (2**30 // 2**12)  # every page touched: resident
    del block  # one mmap'd block: back to the kernel at once
    before = _rss_mib()
    second, _ = train.main(compose_config([*TINY, f"output_root={tmp_path / 'b'}"]))
    for run_dir in (first, second):
        memory = next(r for r in metric_records(Path(run_dir)) if "memory/rank0_peak_rss_mib" in r)
        assert memory["memory/rank0_peak_rss_mib"] > 0
    memory = next(r for r in metric_records(Path(second)) if "memory/rank0_peak_rss_mib" in r)
    assert memory["memory/rank0_peak_rss_mib"] < before + 512, (memory, before)
    assert memory["memory/rank0_peak_setup_rss_mib"] < before + 512, (memory, before)


def test_a_peak_that_cannot_be_reset_says_it_is_the_processes(monkeypatch):
    """Where the kernel's peak cannot be reset (not Linux), a later job's line says whose peak it is."""
    import trainers
    import utils

    monkeypatch.setitem(utils._PEAK, "jobs", 2)
    monkeypatch.setitem(utils._PEAK, "reset", False)
    line = trainers.format_peak_memory({"rss": [812.0], "setup_rss": [600.0]})
    assert line.startswith("Peak memory (this process's, over the earlier jobs of this multirun too")
    monkeypatch.setitem(utils._PEAK, "reset", True)
    assert trainers.format_peak_memory({"rss": [812.0], "setup_rss": [600.0]}) == (
        "Peak memory: 812 MiB resident (600 MiB by the end of model loading)."
    )
