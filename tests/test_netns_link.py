"""benchmarks/netns/netns_link.py (links shaped by tc): its argument parsing, topology and
shaping plans, metrics parsing and report, without root; and, as root where `ip` and `tc`
work, a shaped link between two namespaces that carries no more than its rate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    """benchmarks/netns/netns_link.py, imported as it runs (its folder and benchmarks/ on the path)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # common
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "netns"))
    import netns_link

    return netns_link


@pytest.fixture
def nt(bench: Any) -> Any:
    """benchmarks/netns/netns_topology.py, the module netns_link uses."""
    return sys.modules["netns_topology"]


def test_arguments_default_to_four_rows_at_10_and_25_gbit(bench: Any) -> None:
    args = bench.parse_args([])
    assert args.rates == [10e9, 25e9]
    assert args.rows == [("float32", 0.0), ("bfloat16", 0.0), ("float32", 0.2), ("bfloat16", 0.2)]
    plans = bench.plan_rows(args.rates, args.delay_us, args.rows)
    assert len(plans) == 8
    assert [p.link.rate_bits for p in plans] == [10e9] * 4 + [25e9] * 4  # reshaped once per rate
    assert {(p.dtype, p.cache) for p in plans} == set(args.rows)
    args = bench.parse_args(["--rates", "1gbit", "500mbit", "2.5", "--rows", "bfloat16:0.2",
                             "--step-ms", "0"])
    assert args.rates == [1e9, 500e6, 2.5e9] and args.rows == [("bfloat16", 0.2)] and args.step_ms == 0


def test_repeats_interleave_and_merge_to_the_median(bench: Any) -> None:
    rows = [("float32", 0.0), ("bfloat16", 0.2)]
    plans = bench.plan_rows([10e9, 25e9], 0.0, rows, repeat=3)
    assert [(p.link.rate_bits, p.dtype) for p in plans[:4]] == [
        (10e9, "float32"), (10e9, "bfloat16"), (10e9, "float32"), (10e9, "bfloat16")]
    assert len(plans) == 12
    measured = [{"link": p.link.label, "dtype": p.dtype, "cache": p.cache, "batches_per_s_per_trainer": v}
                for p, v in zip(plans, [1, 5, 3, 4, 2, 6, 1, 1, 1, 1, 1, 1], strict=True)]
    merged = bench.merge_repeats(measured)
    assert len(merged) == 4
    first = merged[0]
    assert (first["link"], first["dtype"], first["batches_per_s_per_trainer"]) == ("10 Gbit/s", "float32", 2)
    assert first["repeats_batches_per_s_per_trainer"] == [1, 3, 2]
    assert merged[1]["batches_per_s_per_trainer"] == 5


@pytest.mark.parametrize("argv", [["--rates", "fast"], ["--rates", "0gbit"], ["--rows", "float64:0"],
                                  ["--rows", "float32:2"], ["--rows", "float32"], ["--batches", "0"],
                                  ["--step-ms", "-1"], ["--server-workers", "0"],
                                  ["--server-threads", "0"], ["--server-switch-interval-ms", "0"],
                                  ["--server-switch-interval-ms", "nan"]])
def test_bad_arguments_are_refused(bench: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_server_commands_pass_the_server_settings_and_set_the_switch_interval(
        bench: Any, tmp_path: Path) -> None:
    import subprocess
    import sys

    addresses = ["10.0.0.1:50051", "10.0.0.2:50051"]
    plain = bench.server_command(bench.parse_args([]), tmp_path, 1, addresses)
    assert plain[1:3] == ["-m", "sampling_server"]
    assert plain[plain.index("--partition") + 1] == "1"
    assert plain[plain.index("--listen") + 1] == addresses[1]
    assert plain[plain.index("--peers") + 1] == ",".join(addresses)
    assert "--workers" not in plain and "--threads" not in plain
    assert "--insecure" in plain  # beyond loopback, on the run's own bridge, explicitly
    args = bench.parse_args(["--server-workers", "3", "--server-threads", "2",
                             "--server-switch-interval-ms", "0.5"])
    tuned = bench.server_command(args, tmp_path, 0, addresses)
    assert tuned[tuned.index("--workers") + 1] == "3" and tuned[tuned.index("--threads") + 1] == "2"
    args.server_switch_interval_ms = None
    assert tuned[1] == "-c" and tuned[4:] == bench.server_command(args, tmp_path, 0, addresses)[3:]
    # the launcher sets the interval, then runs the server's own main with its arguments
    probe = tuned[2].replace("'sampling_server'", "'platform'")
    out = subprocess.run([sys.executable, "-c",
                          probe.replace("runpy.run_module", "print(sys.getswitchinterval(), "
                                        "sys.argv[1:]) or runpy.run_module"), tuned[3], "--x"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.splitlines()[0] == "0.0005 ['--x']"


def test_topology_gives_each_host_a_namespace_an_address_and_a_switch_port(nt: Any) -> None:
    topo = nt.plan_topology(["server0", "server1", "trainer0", "trainer1"], "gfl42", "10.1.2")
    assert topo.switch == "gfl42-sw"
    assert [h.address for h in topo.hosts] == ["10.1.2.1", "10.1.2.2", "10.1.2.3", "10.1.2.4"]
    assert topo.namespaces == ["gfl42-sw", "gfl42-server0", "gfl42-server1", "gfl42-trainer0",
                               "gfl42-trainer1"]
    cmds = nt.setup_commands(topo)
    assert [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]] == topo.namespaces
    for h in topo.hosts:  # a veth pair per host: eth0 in the host, its port on the bridge
        assert ["ip", "link", "add", h.port, "netns", "gfl42-sw", "type", "veth", "peer", "name", "eth0",
                "netns", h.namespace] in cmds
        assert ["ip", "-n", "gfl42-sw", "link", "set", h.port, "master", "br0", "up"] in cmds
        assert ["ip", "-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", "eth0"] in cmds
    with pytest.raises(KeyError, match="trainer9"):
        topo.host("trainer9")


@pytest.mark.parametrize("names, tag, subnet, field", [
    (["a", "a"], "t", "10.0.0", "names"), (["Server"], "t", "10.0.0", "names"),
    (["averyveryverylongname"], "t", "10.0.0", "names"), ([], "t", "10.0.0", "names"),
    (["a"], "T!", "10.0.0", "tag"), (["a"], "t", "10.0.300", "subnet"), (["a"], "t", "10.0", "subnet")])
def test_bad_topologies_are_refused(nt: Any, names: list[str], tag: str, subnet: str, field: str) -> None:

    with pytest.raises(ValueError, match=f"^{field}:"):
        nt.plan_topology(names, tag, subnet)


def test_shaping_covers_both_directions_of_every_link(nt: Any) -> None:
    topo = nt.plan_topology(["server0", "trainer0"], "gfl1")
    shape = nt.LinkShape(nt.parse_rate("10gbit"), delay_us=150)
    cmds = nt.shape_commands(topo, shape, netem=True)
    tbf = [c for c in cmds if "tbf" in c]
    assert {(c[2], c[6]) for c in tbf} == {("gfl1-server0", "eth0"), ("gfl1-sw", "pserver0"),
                                           ("gfl1-trainer0", "eth0"), ("gfl1-sw", "ptrainer0")}
    assert all(c[c.index("rate") + 1] == "10000000000bit" for c in tbf)
    assert all(int(c[c.index("burst") + 1]) == 625_000 for c in tbf)  # 0.5 ms of 10 Gbit/s
    netem = [c for c in cmds if "netem" in c]
    assert len(netem) == 4 and all(c[c.index("delay") + 1] == "150us" for c in netem)
    assert not [c for c in nt.shape_commands(topo, shape, netem=False) if "netem" in c]
    assert all(c[3:6] == ["qdisc", "del", "dev"] for c in nt.shape_commands(topo, None, netem=True))
    assert nt.LinkShape(100e6).burst_bytes() == 128 << 10  # never below one GSO packet
    assert shape.label == "10 Gbit/s + 150 us" and nt.LinkShape(5e8).label == "500 Mbit/s"


def test_stale_namespaces_are_only_those_of_dead_runs(nt: Any) -> None:

    dead = 2**22 + 17  # above the default pid_max: no such process
    listing = (f"gfl{dead}-sw (id: 3)\ngfl{dead}-server0\ngfl1-trainer0\nother-ns\n"
               f"gflx-sw\n")  # gfl1: pid 1 (init) is alive
    assert nt.stale_namespaces("gfl", listing) == [f"gfl{dead}-sw", f"gfl{dead}-server0"]


def test_server_metrics_are_parsed_by_stage(bench: Any) -> None:
    text = "\n".join([
        "# HELP graphfeed_stage_seconds Seconds per batch stage",
        'graphfeed_stage_seconds_bucket{le="0.1",partition="0",stage="sample"} 3.0',
        'graphfeed_stage_seconds_count{partition="0",stage="sample"} 4.0',
        'graphfeed_stage_seconds_sum{partition="0",stage="sample"} 1.5',
        'graphfeed_stage_seconds_sum{partition="0",stage="gather"} 0.5',
        'graphfeed_batches_sent_total{partition="0"} 4.0',
        'graphfeed_gil_wait_seconds_bucket{le="0.005",partition="0"} 7.0',
        'graphfeed_gil_wait_seconds_sum{partition="0"} 0.25',
        "graphfeed_bytes_sent_total NaN"])
    values = bench.parse_metrics(text)
    assert values["graphfeed_stage_seconds_count[sample]"] == 4.0
    assert values["graphfeed_stage_seconds_sum[sample]"] == 1.5
    assert values["graphfeed_batches_sent_total"] == 4.0
    assert values["graphfeed_gil_wait_seconds_sum"] == 0.25
    assert not any("bucket" in k for k in values)


def _trainer(batches_per_s: float, nbytes: int) -> dict[str, Any]:
    return {"batches": 8, "batches_per_s": batches_per_s, "bytes_per_batch": nbytes,
            "wait_fraction": 0.5, "hit_rate": 0.0, "received_gbit_per_s": 8 * nbytes * batches_per_s / 1e9,
            "cpu_seconds_per_batch": 0.5}


def _counters(batches: float, cpu: float, busy: float) -> dict[str, dict[str, float]]:
    server = {"graphfeed_batches_sent_total": batches, "graphfeed_bytes_sent_total": 1e9 * batches,
              "graphfeed_stage_seconds_count[sample]": batches,
              "graphfeed_stage_seconds_sum[sample]": 0.2 * batches, "cpu_seconds": cpu,
              "graphfeed_gil_wait_seconds_count": 100 * batches,
              "graphfeed_gil_wait_seconds_sum": 0.0005 * 100 * batches}
    return {"server0": server, "server1": dict(server), "machine": {"busy": busy, "total": 2 * busy}}


def _links(scale: float) -> dict[str, dict[str, float]]:
    """Interface byte counters: server0 sends most (batches and answers to server1)."""
    sent = {"server0 out": 5e9, "server0 in": 1e9, "server1 out": 3e9, "server1 in": 1e9,
            "trainer0 in": 3.5e9, "trainer0 out": 1e7, "trainer1 in": 3.5e9, "trainer1 out": 1e7}
    return {"links": {k: scale * v for k, v in sent.items()}}


def test_rows_get_ratios_bounds_and_the_target_verdict(bench: Any, nt: Any) -> None:
    summarize = sys.modules["netns_report"].summarize

    link = nt.LinkShape(10e9)
    base = bench.row_result(bench.RowPlan(link, "float32", 0.0), [_trainer(1.0, 200_000_000)] * 2,
                            _counters(0, 0, 100), _counters(8, 4, 200), 8.0, cores=2)
    lean = bench.row_result(bench.RowPlan(link, "bfloat16", 0.2), [_trainer(3.5, 60_000_000)] * 2,
                            _counters(0, 0, 100), _counters(8, 4, 200), 8.0, cores=2)
    assert base["servers"]["server0"] == {"batches": 8, "sent_gbit_per_s": 8.0, "cpu_seconds": 4.0,
                                          "sample_ms": 200.0, "gil_wait_ms": 0.5}
    assert base["link_bound_batches_per_s"] == 6.25  # 1.25 GB/s / 200 MB
    assert base["cpu_seconds_per_batch"] == 1.0  # (4 + 4) server / 16 sent + 0.5 trainer
    busy = bench.row_result(bench.RowPlan(link, "float32", 0.0), [_trainer(1.0, 200_000_000)] * 2,
                            _counters(0, 0, 100), _counters(20, 4, 200), 8.0, cores=2)
    assert busy["cpu_seconds_per_batch"] == 0.7  # 8 s over the 40 batches the servers sent
    assert base["machine_busy_fraction"] == 0.5
    assert "links" not in base  # counters absent: no link figures
    shaped = bench.row_result(bench.RowPlan(link, "float32", 0.0), [_trainer(1.0, 200_000_000)] * 2,
                              {**_counters(0, 0, 100), **_links(1)}, {**_counters(8, 4, 200), **_links(2)},
                              8.0, cores=2)
    assert shaped["links"]["server0 out"] == {"gbit_per_s": 5.0, "use": 0.5}  # 5e9 B in 8 s
    assert shaped["servers"]["server0"]["link_out_gbit_per_s"] == 5.0
    assert shaped["servers"]["server1"]["link_in_gbit_per_s"] == 1.0
    assert shaped["busiest_link"] == "server0 out" and shaped["busiest_link_use"] == 0.5
    assert shaped["busiest_link_bound_batches_per_s"] == 2.0  # 1 batch/s at half the rate
    summary = summarize([base, lean])
    assert base["speedup_vs_float32_no_cache"] == 1.0 and lean["speedup_vs_float32_no_cache"] == 3.5
    assert lean["bytes_vs_float32_no_cache"] == 0.3
    assert base["cpu_bound_batches_per_s_per_trainer"] == 1.0  # 2 cores / 1 s / 2 trainers
    assert base["bound_by"] == "cpu"  # 1.0 < 6.25
    shaped["cpu_bound_batches_per_s_per_trainer"] = 3.0  # above the busiest link's 2.0
    summarize([shaped])
    assert shaped["bound_by"] == "link"
    assert summary["target_met"] is True and summary["target_speedup"] == 3.5
    assert summarize([base])["target_met"] is None


def test_without_root_it_says_why_and_exits_2(bench: Any, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert bench.main([]) == 2
    assert "needs root" in capsys.readouterr().err


# -- as root: a real shaped link -------------------------------------------------------------

def _why_not_here(nt: Any) -> str | None:
    reason = nt.why_not_root()
    if reason:
        return reason
    probe = subprocess.run(["ip", "netns", "add", "gflprobe-t"], capture_output=True, timeout=30)
    subprocess.run(["ip", "netns", "del", "gflprobe-t"], capture_output=True, timeout=30)
    return None if probe.returncode == 0 else "network namespaces are unavailable here"


def test_a_shaped_link_carries_no_more_than_its_rate(nt: Any) -> None:
    reason = _why_not_here(nt)
    if reason:
        pytest.skip(reason)
    roles = str(ROOT / "benchmarks" / "netns" / "netns_roles.py")
    topo = nt.plan_topology(["server0", "trainer0"], f"gflt{os.getpid()}", "10.231.80")
    shape = nt.LinkShape(200e6)  # far below what any machine's veth carries
    with nt.Network(topo) as net:
        namespaces = set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                        timeout=30).stdout.split())
        assert set(topo.namespaces) <= namespaces
        net.shape(shape)
        sink = net.popen("trainer0", [sys.executable, roles, "tcp-sink", "--port", "5300", "--timeout", "60"],
                         stdout=subprocess.PIPE)
        source = net.popen("server0", [sys.executable, roles, "tcp-source", "--host", "10.231.80.2",
                                       "--port", "5300", "--seconds", "2", "--timeout", "60"],
                           stdout=subprocess.PIPE)
        try:
            result = json.loads(sink.communicate(timeout=120)[0].strip().splitlines()[-1])
            assert source.wait(60) == 0
        finally:
            for p in (sink, source):
                if p.poll() is None:
                    p.kill()
        stats = net.qdisc_stats("server0")
    assert result["bytes"] > 0
    assert result["gbit_per_s"] <= 0.2 * 1.15, result  # the token bucket holds the rate
    assert "tbf" in stats and int(stats.split("Sent ")[1].split()[0]) >= result["bytes"]
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert not set(topo.namespaces) & set(listing.split())  # removed on exit
