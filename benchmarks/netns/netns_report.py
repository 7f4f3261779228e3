"""Ratios, the target check, the table and the plot of ``benchmarks/netns/netns_link.py``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.netns_link")

#: bfloat16 + 20 % cache must deliver this many times float32 without cache's batches/s.
TARGET_SPEEDUP = 3.0
TARGET_RATE_GBIT = 10.0


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Add each row's ratios to float32 without cache over the same link (batches/s per
    trainer and bytes per batch); the target's verdict at 10 Gbit/s."""
    base = {r["link"]: r for r in rows if r["dtype"] == "float32" and r["cache"] == 0}
    for r in rows:
        b = base.get(r["link"])
        r["speedup_vs_float32_no_cache"] = (
            round(r["batches_per_s_per_trainer"] / b["batches_per_s_per_trainer"], 3) if b else None)
        r["bytes_vs_float32_no_cache"] = round(r["bytes_per_batch"] / b["bytes_per_batch"], 3) if b else None
        link_bound = min(filter(None, (r["link_bound_batches_per_s"],
                                       r.get("busiest_link_bound_batches_per_s"))))
        r["bound_by"] = "cpu" if r["cpu_bound_batches_per_s_per_trainer"] < link_bound else "link"
    target = next((r for r in rows if r["rate_gbit"] == TARGET_RATE_GBIT and r["dtype"] == "bfloat16"
                   and r["cache"] == 0.2 and r["speedup_vs_float32_no_cache"] is not None), None)
    verdict: dict[str, Any] = {"target": f"bfloat16 + 20 % cache >= {TARGET_SPEEDUP:g}x the batches/s per "
                                         f"trainer of float32 without cache over {TARGET_RATE_GBIT:g} Gbit/s"}
    if target is None:
        verdict["target_met"] = None
        verdict["target_speedup"] = None
    else:
        verdict["target_speedup"] = target["speedup_vs_float32_no_cache"]
        verdict["target_met"] = target["speedup_vs_float32_no_cache"] >= TARGET_SPEEDUP
    return verdict


def print_table(probes: list[dict[str, Any]], rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """The CLI's own output: the probes, then one line per row."""
    for p in probes:
        print(f"link {p['link']:<22} raw TCP {p['tcp_gbit_per_s']:>6.2f} Gbit/s  "
              f"RTT median {p['rtt_median_us']:>6.0f} us  qdisc: {p['qdisc']}")
    print(f"{'link':<16} {'dtype':<9} {'cache':>5} {'batch/s/tr':>10} {'x f32':>6} {'MB/batch':>8} "
          f"{'wait':>5} {'Gbit/s/tr':>9} {'link use':>8} {'link-bound':>10} {'cpu s/b':>7} "
          f"{'cpu-bound':>9} {'busy':>5} bound")
    for r in rows:
        speedup = r["speedup_vs_float32_no_cache"]
        print(f"{r['link']:<16} {r['dtype']:<9} {r['cache']:>5.0%} {r['batches_per_s_per_trainer']:>10.2f} "
              f"{speedup if speedup is not None else float('nan'):>6.2f} {r['bytes_per_batch'] / 1e6:>8.1f} "
              f"{r['wait_fraction']:>5.0%} {r['received_gbit_per_s_per_trainer']:>9.2f} "
              f"{r['link_utilization']:>8.1%} {r['link_bound_batches_per_s']:>10.1f} "
              f"{r['cpu_seconds_per_batch']:>7.2f} {r['cpu_bound_batches_per_s_per_trainer']:>9.2f} "
              f"{r['machine_busy_fraction']:>5.0%} {r['bound_by']}")
        for name, s in r["servers"].items():
            stages = ", ".join(f"{k[:-3]} {v:.0f} ms" for k, v in s.items()
                               if k.endswith("_ms") and k != "gil_wait_ms")
            gil = f"; interpreter lock wait {s['gil_wait_ms']:.1f} ms" if "gil_wait_ms" in s else ""
            print(f"    {name}: {s['batches']} batches, {s['sent_gbit_per_s']:.2f} Gbit/s sent, "
                  f"CPU {s['cpu_seconds']:.1f} s; per batch: {stages}{gil}")
        if r.get("links"):
            ways = ", ".join(f"{k} {v['gbit_per_s']:.2f}" for k, v in r["links"].items())
            print(f"    links (Gbit/s): {ways}; busiest {r['busiest_link']} at "
                  f"{r['busiest_link_use']:.0%} of the rate")
    met = summary["target_met"]
    verdict = ("not measured" if met is None
               else f"{summary['target_speedup']:.3f}x, {'met' if met else 'NOT met'}")
    print(f"target: {summary['target']}: {verdict}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Batches/s per trainer by row, grouped by link, beside what the link alone allows."""
    try:
        import matplotlib
    except ImportError:
        log.warning("no plot: matplotlib is not installed")
        return
    if not rows:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(r["link"] for r in rows))
    kinds = list(dict.fromkeys((r["dtype"], r["cache"]) for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(kinds)
    for k, (dtype, cache) in enumerate(kinds):
        xs, measured, link_bound, cpu_bound = [], [], [], []
        for i, link in enumerate(links):
            r = next((r for r in rows
                      if r["link"] == link and (r["dtype"], r["cache"]) == (dtype, cache)), None)
            if r is not None:
                xs.append(i + (k - (len(kinds) - 1) / 2) * width)
                measured.append(r["batches_per_s_per_trainer"])
                link_bound.append(r["link_bound_batches_per_s"])
                cpu_bound.append(r["cpu_bound_batches_per_s_per_trainer"])
        ax.bar(xs, measured, width, label=f"{dtype}, cache {cache:.0%}")
        ax.scatter(xs, link_bound, marker="_", s=300, color="black",
                   label="the link alone (rate / bytes per batch)" if k == 0 else None)
        ax.scatter(xs, cpu_bound, marker="o", s=20, color="dimgray",
                   label="the CPU alone (cores / CPU s per batch / trainers)" if k == 0 else None)
    ax.set_xticks(range(len(links)), links)
    ax.set_yscale("log")
    ax.set_ylabel("batches/s per trainer (log)")
    ax.set_title("2 servers -> 2 trainers over tc-shaped links, 2 shared cores")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
