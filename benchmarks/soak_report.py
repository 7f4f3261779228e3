"""The soak's figures (``benchmarks/soak.py``): per minute, delivered batches, fairness,
server RSS, open streams, time to next batch and errors by status code; seeds lost and
doubled per epoch and trainer; the targets; and a plot over time."""

from __future__ import annotations

import json
import logging
import math
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: Seconds after a fault ends that still count as its (trainers resume, caches refill).
SETTLE_S = 10.0
#: The targets: fairness band, RSS and throughput drift, a newcomer's first batch.
FAIR_BAND, RSS_DRIFT, RATE_DRIFT, NEWCOMER_S = 0.25, 0.10, 0.10, 5.0
_BAD_CODES = ("INTERNAL", "UNKNOWN")


def read_events(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a trainer's log (a line cut by a kill is skipped)."""
    events = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def _minute_of(t: float, t0: float) -> int:
    return int((t - t0) // 60)


def fault_minutes(faults: list[dict[str, Any]], t0: float, minutes: int) -> set[int]:
    """Minutes that overlap a fault (from its start to :data:`SETTLE_S` after its end)."""
    hit: set[int] = set()
    for f in faults:
        first, last = _minute_of(f["start"], t0), _minute_of(f["end"] + SETTLE_S, t0)
        hit.update(m for m in range(first, last + 1) if 0 <= m < minutes)
    return hit


def _restarted(events: list[dict[str, Any]], t0: float) -> set[int]:
    """Minutes in which a trainer (re)started after the clock started (not counted for
    fairness: it was not there the whole minute)."""
    return {_minute_of(e["t"], t0) for e in events if e["event"] == "start" and e["t"] >= t0}


def fairness(counts: dict[str, int], presets: dict[str, str]) -> dict[str, Any]:
    """Each trainer's batches against the mean of its preset's trainers (jobs of one
    preset do the same work; plain and typed batches cost differently)."""
    shares: dict[str, float] = {}
    for preset in sorted(set(presets.values())):
        group = {n: c for n, c in counts.items() if presets[n] == preset}
        mean = sum(group.values()) / len(group) if group else 0.0
        shares.update({n: c / mean for n, c in group.items()} if mean else {})
    if not shares:
        return {"min_share": None, "max_share": None, "outside_band": []}
    return {"min_share": round(min(shares.values()), 3), "max_share": round(max(shares.values()), 3),
            "outside_band": sorted(n for n, s in shares.items() if abs(s - 1) > FAIR_BAND)}


def server_minutes(samples: list[dict[str, Any]], t0: float, minutes: int
                   ) -> tuple[dict[int, dict[str, Any]], dict[int, Counter[str]]]:
    """Per minute: each server's mean RSS (MiB) and open streams; and the status codes the
    servers answered or got from peers (counter differences between samples of one
    process)."""
    per: dict[int, dict[str, Any]] = defaultdict(lambda: {"rss_mib": {}, "streams_open": {}})
    codes: dict[int, Counter[str]] = defaultdict(Counter)
    rss: dict[tuple[int, str], list[float]] = defaultdict(list)
    streams: dict[tuple[int, str], list[float]] = defaultdict(list)
    last: dict[int, dict[str, float]] = {}
    for s in samples:
        m = _minute_of(s["t"], t0)
        metrics = s["metrics"]
        if 0 <= m < minutes:
            rss[m, s["server"]].append(s["rss"] / 2**20)
            streams[m, s["server"]].append(metrics.get("graphfeed_streams_open", 0.0))
            before = last.get(s["pid"], {})
            for key, value in metrics.items():
                match = re.match(r"graphfeed_(requests_rejected|peer_errors|streams_evicted)_total"
                                 r"\{(.*)\}", key)
                if match and value > before.get(key, 0.0):
                    what = {"requests_rejected": "answered", "peer_errors": "peer",
                            "streams_evicted": "evicted"}[match.group(1)]
                    label = re.sub(r"(code|reason)=", "", match.group(2).split(",peer=")[0])
                    codes[m][f"{what} {label}"] += int(value - before.get(key, 0.0))
        last[s["pid"]] = metrics
    for (m, server), values in rss.items():
        per[m]["rss_mib"][server] = round(float(np.mean(values)), 1)
    for (m, server), values in streams.items():
        per[m]["streams_open"][server] = round(float(np.mean(values)), 1)
    return per, codes


def rss_drift(samples: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """Per server process, from its second minute of the soak (and of its life) on: the
    spread of its per-minute mean RSS over the lowest, worst process first."""
    by_pid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        by_pid[s["pid"]].append(s)
    drifts = {}
    for pid, rows in by_pid.items():
        born = rows[0]["t"]
        minutes: dict[int, list[float]] = defaultdict(list)
        for s in rows:
            if s["t"] >= max(t0 + 60, born + 60):
                minutes[_minute_of(s["t"], t0)].append(s["rss"])
        means = [float(np.mean(v)) for v in minutes.values() if v]
        if len(means) >= 2:
            drifts[f"{rows[0]['server']} (pid {pid})"] = round((max(means) - min(means)) / min(means), 3)
    worst = max(drifts.values(), default=None)
    return {"worst": worst, "per_process": drifts}


def _trainer_minute(events: list[dict[str, Any]], t0: float, t_end: float, minutes: int
                    ) -> tuple[dict[int, int], dict[int, list[float]], dict[int, Counter[str]]]:
    batches: dict[int, int] = Counter()
    waits: dict[int, list[float]] = defaultdict(list)
    codes: dict[int, Counter[str]] = defaultdict(Counter)
    for e in events:
        m = _minute_of(e["t"], t0)
        if not 0 <= m < minutes or e["t"] >= t_end:  # the epochs finished after the time
            continue
        if e["event"] == "batch":
            batches[m] += 1
            waits[m].append(e["wait"])
        elif e["event"] == "resume":
            codes[m][f"trainer resumed after {e['code']}"] += 1
        elif e["event"] == "error":
            codes[m][f"trainer failed: {e.get('code') or e.get('error')}"] += 1
    return batches, waits, codes


def per_minute(trainers: list[tuple[str, str, list[dict[str, Any]]]], samples: list[dict[str, Any]],
               faults: list[dict[str, Any]], t0: float, t_end: float) -> list[dict[str, Any]]:
    """One row per minute of the soak."""
    minutes = max(1, math.ceil((t_end - t0 - 1.0) / 60))  # a last second over is no minute
    faulty = fault_minutes(faults, t0, minutes)
    servers, server_codes = server_minutes(samples, t0, minutes)
    presets = {name: preset for name, preset, _ in trainers}
    counts: dict[int, dict[str, int]] = defaultdict(dict)
    waits: dict[int, list[float]] = defaultdict(list)
    codes: dict[int, Counter[str]] = defaultdict(Counter)
    absent: dict[int, set[str]] = defaultdict(set)
    for name, _, events in trainers:
        b, w, c = _trainer_minute(events, t0, t_end, minutes)
        for m in range(minutes):
            counts[m][name] = b.get(m, 0)
            waits[m] += w.get(m, [])
            codes[m].update(c.get(m, Counter()))
        for m in _restarted(events, t0):
            absent[m].add(name)
    for f in faults:
        if f["fault"] == "fuzz":
            codes[_minute_of(f["start"], t0)].update({f"fuzz {k}": v for k, v in f.get("codes", {}).items()})
    rows = []
    for m in range(minutes):
        seconds = min(60.0, t_end - (t0 + 60 * m))
        present = {n: c for n, c in counts[m].items() if n not in absent[m]}
        waited = np.asarray(waits[m]) if waits[m] else np.zeros(1)
        rows.append({
            "minute": m, "faults": m in faulty, "seconds": round(seconds, 1),
            "batches_per_s": round(sum(counts[m].values()) / seconds, 2),
            "per_trainer_batches": counts[m],
            "fairness": fairness(present, presets) if seconds >= 59 else None,
            "next_batch_p50_s": round(float(np.percentile(waited, 50)), 4),
            "next_batch_p99_s": round(float(np.percentile(waited, 99)), 4),
            "server_rss_mib": servers[m]["rss_mib"], "streams_open": servers[m]["streams_open"],
            "status_codes": dict(codes[m] + server_codes[m]),
        })
    return rows


def seeds(trainers: list[tuple[str, str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Seeds lost and doubled per epoch and trainer (every finished epoch)."""
    epochs = [(name, e) for name, _, events in trainers for e in events if e["event"] == "epoch"]
    bad = [{"trainer": n, "epoch": e["epoch"], "lost": e["lost"], "doubled": e["doubled"]}
           for n, e in epochs if e["lost"] or e["doubled"]]
    return {"epochs_checked": len(epochs), "seeds_checked": sum(e["seeds"] for _, e in epochs),
            "lost": sum(e["lost"] for _, e in epochs), "doubled": sum(e["doubled"] for _, e in epochs),
            "epochs_with_loss_or_doubles": bad[:20],
            "epochs_per_trainer": dict(Counter(n for n, _ in epochs))}


def server_log_errors(run_dir: Path) -> list[str]:
    """ERROR lines of every server log (unexpected failures; INTERNAL answers are logged so)."""
    lines = []
    for path in sorted(run_dir.glob("*-server*.log")):
        lines += [f"{path.name}: {ln[:300]}" for ln in path.read_text(errors="replace").splitlines()
                  if " ERROR " in ln]
    return lines


def _target(value: Any, target: str, ok: bool | None) -> dict[str, Any]:
    return {"value": value, "target": target, "pass": ok}


def targets(rows: list[dict[str, Any]], seed_check: dict[str, Any], bad_codes: int,
            hung: list[str], drift: dict[str, Any], faults: list[dict[str, Any]]) -> dict[str, Any]:
    """Every target of the soak, measured (``pass`` None: not measured in this run)."""
    clean = [r for r in rows if not r["faults"] and r["fairness"] and r["fairness"]["min_share"]]
    worst_share = max((max(1 - r["fairness"]["min_share"], r["fairness"]["max_share"] - 1)
                       for r in clean), default=None)
    full = [r for r in rows if r["seconds"] >= 59]
    rate: dict[str, Any] = {"value": None}
    if len(full) >= 3 and not full[1]["faults"] and not full[-1]["faults"]:
        second, last = full[1]["batches_per_s"], full[-1]["batches_per_s"]
        rate = {"value": round(abs(last - second) / second, 3), "second": second, "last": last}
        per_core = (full[1]["batches_per_soak_core_s"], full[-1]["batches_per_soak_core_s"])
        if all(per_core):  # the same, for the cores the soak got (a shared machine's others vary)
            rate["per_soak_core"] = round(abs(per_core[1] - per_core[0]) / per_core[0], 3)
    probes = [p for f in faults for p in f.get("newcomer_first_batch_s", [])]
    served = [p for p in probes if isinstance(p, int | float)]
    newcomer_ok = (len(served) == len(probes) and max(served) <= NEWCOMER_S) if probes else None
    return {
        "seeds_lost": _target(seed_check["lost"], "0", seed_check["lost"] == 0),
        "seeds_doubled": _target(seed_check["doubled"], "0", seed_check["doubled"] == 0),
        "internal_or_unknown": _target(bad_codes, "0", bad_codes == 0),
        "no_hangs": _target(hung, "every trainer ends on its own", not hung),
        "rss_flat": _target(drift["worst"], f"<= {RSS_DRIFT} after the first minute",
                            None if drift["worst"] is None else drift["worst"] <= RSS_DRIFT),
        "throughput_steady": _target(rate, f"last minute within {RATE_DRIFT} of the second",
                                     None if rate["value"] is None else rate["value"] <= RATE_DRIFT),
        "fairness": _target(None if worst_share is None else round(worst_share, 3),
                            f"every trainer within +-{FAIR_BAND} of its preset's mean, each "
                            "minute without faults",
                            None if worst_share is None else worst_share <= FAIR_BAND),
        "newcomer_first_batch": _target(probes, f"<= {NEWCOMER_S} s with every slot held idle",
                                        newcomer_ok),
    }


def cpu_minutes(cpu: list[dict[str, float]], t0: float, minutes: int) -> dict[int, dict[str, float]]:
    """Per minute: cores busy with this soak's processes (``soak``: CPU seconds spent
    since the sample before), with anything else on the machine, and stolen by the
    hypervisor (a shared machine's other work shows here)."""
    out: dict[int, dict[str, float]] = {}
    for m in range(minutes):
        inside = [c for c in cpu if t0 + 60 * m <= c["t"] < t0 + 60 * (m + 1)]
        if len(inside) < 2:
            continue
        first, last = inside[0], inside[-1]
        seconds = last["t"] - first["t"]
        soak = sum(c["soak"] for c in inside[1:]) / seconds
        busy = (last["busy"] - first["busy"]) / seconds
        out[m] = {"soak_cores": round(soak, 2), "other_cores": round(max(0.0, busy - soak), 2),
                  "stolen_cores": round((last["steal"] - first["steal"]) / seconds, 2)}
    return out


def analyse(run_dir: Path, *, t0: float, t_end: float, trainers: list[tuple[str, str, Path]],
            samples: list[dict[str, Any]], cpu: list[dict[str, float]], faults: list[dict[str, Any]],
            trainer_exits: dict[str, list[int | None]], server_exits: dict[str, list[int | None]],
            cycle_s: float) -> dict[str, Any]:
    """The soak's results (JSON-ready) from its logs, samples and faults."""
    loaded = [(name, preset, read_events(path)) for name, preset, path in trainers]
    rows = per_minute(loaded, samples, faults, t0, t_end)
    machine_cpu = cpu_minutes(cpu, t0, len(rows))
    for row in rows:
        row["cpu"] = machine_cpu.get(row["minute"])
        cores = (row["cpu"] or {}).get("soak_cores")
        row["batches_per_soak_core_s"] = round(row["batches_per_s"] / cores, 2) if cores else None
    seed_check = seeds(loaded)
    errors = server_log_errors(run_dir)
    bad = sum(v for r in rows for k, v in r["status_codes"].items()
              if any(c in k for c in _BAD_CODES) or k.startswith("fuzz FAILED:"))
    hung = [name for name, exits in trainer_exits.items() if not exits or exits[-1] is None]
    failed = [name for name, exits in trainer_exits.items() if exits and exits[-1] not in (0, None)]
    drift = rss_drift(samples, t0)
    return {
        "t0": t0, "seconds": round(t_end - t0, 1), "cycle_s": cycle_s,
        "faults": [{**f, "start_s": round(f["start"] - t0, 1), "end_s": round(f["end"] - t0, 1)}
                   for f in faults],
        "minutes": rows, "seeds": seed_check, "rss_drift": drift,
        "trainer_exits": trainer_exits, "trainers_failed": failed, "server_exits": server_exits,
        "server_log_errors": errors[:20], "server_log_error_count": len(errors),
        "targets": targets(rows, seed_check, bad + len(errors), hung, drift, faults),
    }


def plot(results: dict[str, Any], path: Path) -> None:
    """Batches/s, fairness, server RSS, time to next batch and the machine's busy cores
    per minute, faults shaded."""
    try:
        import matplotlib
    except ImportError:
        log.warning("no plot: matplotlib is not installed")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["minutes"]
    x = [r["minute"] + 0.5 for r in rows]
    fig, axes = plt.subplots(5, 1, figsize=(9, 13), sharex=True)
    axes[0].plot(x, [r["batches_per_s"] for r in rows], marker="o")
    axes[0].set_ylabel("batches/s (all trainers)")
    shares = [r["fairness"] or {} for r in rows]
    axes[1].plot(x, [s.get("min_share") for s in shares], marker="v", label="lowest")
    axes[1].plot(x, [s.get("max_share") for s in shares], marker="^", label="highest")
    for bound in (1 - FAIR_BAND, 1 + FAIR_BAND):
        axes[1].axhline(bound, color="grey", linestyle=":")
    axes[1].set_ylabel("trainer's batches /\npreset mean")
    axes[1].legend(loc="lower left")
    servers = sorted({s for r in rows for s in r["server_rss_mib"]})
    for server in servers:
        axes[2].plot(x, [r["server_rss_mib"].get(server) for r in rows], marker=".", label=server)
    axes[2].set_ylabel("server RSS (MiB)")
    axes[2].legend(loc="lower left", ncol=4, fontsize="small")
    for key, label in (("next_batch_p50_s", "p50"), ("next_batch_p99_s", "p99")):
        # a batch already prefetched waits 0 s: drawn at 0.1 ms on the log scale
        axes[3].plot(x, [max(r[key], 1e-4) for r in rows], marker="o", label=label)
    axes[3].set_yscale("log")
    axes[3].set_ylabel("time to next batch (s)")
    axes[3].legend(loc="upper left")
    cpu = [r.get("cpu") or {} for r in rows]
    for key, label in (("soak_cores", "this soak"), ("other_cores", "other work"),
                       ("stolen_cores", "stolen")):
        axes[4].plot(x, [c.get(key) for c in cpu], marker=".", label=label)
    axes[4].set_ylabel("busy cores")
    axes[4].legend(loc="center left", fontsize="small")
    axes[4].set_xlabel("minute of the soak (faults shaded)")
    for ax in axes:
        for f in results["faults"]:
            ax.axvspan(f["start_s"] / 60, f["end_s"] / 60, color="tab:red", alpha=0.12)
    machine = results.get("machine", {})
    fig.suptitle(f"soak: {results['seconds'] / 60:.0f} min, {len(rows[0]['per_trainer_batches'])} "
                 f"trainers, {machine.get('cores')} cores ({machine.get('cpu', '')[:40]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
