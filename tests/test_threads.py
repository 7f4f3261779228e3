"""How many CPU threads a sampling call may use: the CPUs the process may run on (affinity
capped by the cgroup's CPU quota), unless ``threads`` says otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from protos import cpus
from sampling_server import threads
from sampling_server.config import ConfigError, ServerConfig


def _proc_cgroup(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("cpu_max", "expected"), [("150000 100000\n", 1.5), ("max 100000\n", None),
                                                   ("400000 100000", 4.0)])
def test_cgroup_v2_quota(tmp_path: Path, cpu_max: str, expected: float | None) -> None:
    (tmp_path / "svc").mkdir()
    (tmp_path / "svc" / "cpu.max").write_text(cpu_max)
    assert cpus._cgroup_quota(tmp_path, _proc_cgroup(tmp_path, "0::/svc\n")) == expected


@pytest.mark.parametrize(("quota", "expected"), [("200000", 2.0), ("-1", None), ("50000", 0.5)])
def test_cgroup_v1_quota(tmp_path: Path, quota: str, expected: float | None) -> None:
    cpu = tmp_path / "cpu,cpuacct"
    cpu.mkdir()
    (cpu / "cpu.cfs_quota_us").write_text(quota + "\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    text = "4:memory:/x\n2:cpu,cpuacct:/\n0::/\n"
    assert cpus._cgroup_quota(tmp_path, _proc_cgroup(tmp_path, text)) == expected


def test_no_cgroup_files_means_no_quota(tmp_path: Path) -> None:
    assert cpus._cgroup_quota(tmp_path, tmp_path / "missing") is None
    assert cpus._cgroup_quota(tmp_path, _proc_cgroup(tmp_path, "0::/a\n1:cpu:/b\n")) is None
    (tmp_path / "cpu.max").write_text("garbage\n")
    assert cpus._cgroup_quota(tmp_path, _proc_cgroup(tmp_path, "0::/\n")) is None


def test_usable_cpus_rounds_a_quota_up_and_never_exceeds_the_affinity(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(cpus, "_cgroup_quota", lambda: 1.5)
    assert cpus.usable_cpus() == 2
    monkeypatch.setattr(cpus, "_cgroup_quota", lambda: 64.0)
    assert cpus.usable_cpus() == 4
    monkeypatch.setattr(cpus, "_cgroup_quota", lambda: 0.1)
    assert cpus.usable_cpus() == 1
    monkeypatch.setattr(cpus, "_cgroup_quota", lambda: None)
    assert cpus.usable_cpus() == 4


def test_kernel_threads_are_the_usable_cpus_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    assert threads.kernel_threads(None) == 8
    assert threads.kernel_threads(3) == 3


@pytest.mark.parametrize("bad", [0, -1, "2", 1.5, True])
def test_config_threads_must_be_a_positive_integer(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match="threads: expected an integer >= 1"):
        ServerConfig(partition_dir=tmp_path, partition=0, threads=bad)  # type: ignore[arg-type]
    assert ServerConfig(partition_dir=tmp_path, partition=0, threads=3).threads == 3


@pytest.mark.parametrize(("cpus", "expected"), [(1, 2), (2, 2), (5, 2), (6, 3), (9, 4), (16, 6), (128, 6)])
def test_sampling_workers_are_half_the_usable_cpus_from_2_to_6(
    monkeypatch: pytest.MonkeyPatch, cpus: int, expected: int
) -> None:
    monkeypatch.setattr(threads, "usable_cpus", lambda: cpus)
    assert threads.sampling_workers(None) == expected
    assert threads.sampling_workers(1) == 1 and threads.sampling_workers(12) == 12


def test_the_pipeline_resolves_automatic_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    from sampling_server.pipeline import SamplingPipeline

    monkeypatch.setattr(threads, "usable_cpus", lambda: 10)
    pipeline = SamplingPipeline(None, None)  # type: ignore[arg-type]  # the store is not used here
    try:
        assert pipeline.workers == 5 and pipeline._pool.workers == 5
        assert pipeline.lookups._max_workers == 10
    finally:
        pipeline.close()


@pytest.mark.parametrize("bad", [0, -1, "2", 1.5, True])
def test_config_workers_must_be_a_positive_integer_or_automatic(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ConfigError, match="workers: expected an integer >= 1 or None"):
        ServerConfig(partition_dir=tmp_path, partition=0, workers=bad)  # type: ignore[arg-type]
    assert ServerConfig(partition_dir=tmp_path, partition=0).workers is None
    assert ServerConfig(partition_dir=tmp_path, partition=0, workers=3).workers == 3
