"""The cost model of ``benchmarks/scale.py``: a server's memory and start-up time and the
servers' CPU per batch, as functions of the graph (nodes ``N``, edges ``E``, feature
bytes ``F``), its partitions ``P`` and the batches, fitted on every server measured and
checked against each; its figures for ogbn-papers100M.

A server's partition is ``B = (24 N + 8 E + F) / P`` bytes (CSC offsets, original IDs and
labels: 8 bytes a node each; source IDs: 8 bytes an edge; its features), memory-mapped;
while it loads it reads ``S = (16 N + 8 E) / P`` of them (offsets and source IDs, for its
hot order). Its resident memory is its own (anonymous) plus the pages of its partition
it has touched (file-backed):

    after start-up:  memory = m0 + rho0 * S
    after the runs:  anonymous = a1 + beta * W + 4 * w * N,   file-backed = f1 + rho * B
    peak (while the runs stream):  anonymous = q0 + gamma * k * W + delta * W + 4 * w * N,
                                   file-backed as above

``W`` is the bytes of a batch on the wire (what each stream keeps ``prefetch`` of in
flight, with the arrays that make it; once the streams have ended a server gives that
memory back, :func:`protos.allocator.release_free_memory`), ``k`` the batches a stream samples ahead
(``--prefetch``, or as many as ``--prefetch-bytes`` holds: :func:`ahead`), ``w`` the
sampling workers (each samples a batch through a relabel map of 4 bytes a node of the
graph), ``rho`` the share of the partition's pages the runs touched (a long job touches
them all: ``rho`` = 1). Start-up: ``t = t0 + kappa * S`` (page cache cold). CPU: the
servers' CPU seconds per batch ``c = n * (u + v * P)`` for ``n`` nodes a batch (a peer
call per peer, hop and batch); a server with 2 cores of its own then delivers ``2 / c``
batches/s. ``m0``, ``rho0``, ``a1``, ``beta``, ``f1``, ``rho``, ``q0``, ``gamma``,
``delta``, ``t0``, ``kappa``, ``u``, ``v``: non-negative least squares on relative
errors, over every run measured (each the mean of its servers).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from common import describe_machine, pyplot

log = logging.getLogger("bench.scale")

GIB = 2**30
#: ogbn-papers100M: papers, citations stored in both directions, float32 features.
PAPERS100M = {"nodes": 111_059_956, "edges": 2 * 1_615_685_872, "feature_bytes": 111_059_956 * 128 * 4}
#: Nodes of a batch of 1024 seeds with fanouts [15, 10, 5] when no two are the same: the
#: most a batch holds whatever the graph's size.
MAX_BATCH_NODES = 1024 * (1 + 15 + 15 * 10 + 15 * 10 * 5)
#: Largest relative error on a measured point that the docs allow.
TOLERANCE = 0.15


#: A server's --prefetch by default.
PREFETCH = 4


def ahead(batch_bytes: float, prefetch: int = PREFETCH, prefetch_bytes: int | None = None) -> int:
    """Batches a stream samples ahead (:class:`sampling_server.pipeline.Ahead`)."""
    if not prefetch_bytes:
        return prefetch
    return max(1, min(prefetch, int(prefetch_bytes // max(batch_bytes, 1))))


def held_bytes(nodes: float, edges: float, feature_bytes: float, parts: int) -> float:
    """``B``: one partition's offsets, original IDs, labels, source IDs and features."""
    return (24 * nodes + 8 * edges + feature_bytes) / parts


def read_bytes(nodes: float, edges: float, parts: int) -> float:
    """``S``: what a server reads while it loads."""
    return (16 * nodes + 8 * edges) / parts


def _points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per run (scale and partitions): the mean over its servers of each one's
    partition sizes (as those of a graph of P partitions like it) and what it measured, in
    bytes and seconds. The servers of one run are replicates: their memory after the runs
    differs by up to a quarter (batches in flight, allocator arenas) and their start-up
    by the machine's other work."""
    out = []
    for row in rows:
        servers = _server_points(row)
        if servers:
            fixed = ("scale", "partitions", "nodes")
            out.append({k: servers[0][k] if k in fixed else float(np.mean([p[k] for p in servers]))
                        for k in servers[0]})
    return out


def _server_points(row: dict[str, Any]) -> list[dict[str, Any]]:
    """One point per server of ``row``."""
    out = []
    n, f, parts = row["nodes"], row["feature_bytes"], row["partitions"]
    batch_bytes = max((r["bytes_per_batch"] for r in row.get("runs", [])), default=0)
    for server in row.get("servers", []):
        p = server["partition"]
        nodes, edges = row["part_nodes"][p] * parts, row["part_edges"][p] * parts
        out.append({
            "scale": row["scale"], "partitions": parts, "nodes": n,
            "workers": row.get("sampling_workers") or 2,
            "held": held_bytes(nodes, edges, f * nodes / n, parts),
            "read": read_bytes(nodes, edges, parts),
            "batch_bytes": batch_bytes, "loaded_seconds": server["loaded_seconds"],
            "ahead": ahead(batch_bytes, row.get("server_prefetch", PREFETCH),
                           row.get("server_prefetch_bytes")),
            **{f"{when}_{kind}": server[when][f"{kind}_gib"] * GIB
               for when in ("after_start", "after_runs") for kind in ("rss", "anon", "file", "peak")}})
    return out


def _nnls(columns: list[np.ndarray], target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative least squares of ``target`` on ``columns`` weighted by 1/target
    (relative errors): the coefficients and the model's values."""
    from scipy.optimize import nnls

    a = np.stack(columns, axis=1)
    coef, _ = nnls(a / target[:, None], np.ones_like(target))
    return coef, a @ coef


def _errors(model: np.ndarray, measured: np.ndarray) -> dict[str, Any]:
    err = model / measured - 1
    return {"max_error": round(float(np.abs(err).max()), 4), "errors": [round(float(x), 4) for x in err]}


def fit(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The fitted model (see the module doc), its error on each measured point, and its
    figures for ogbn-papers100M in 8 and 16 partitions."""
    pts = _points(rows)
    if len(pts) < 3:
        return {}

    def col(key: str) -> np.ndarray:
        return np.array([p[key] for p in pts], dtype=np.float64)

    one, maps = np.ones(len(pts)), 4 * col("workers") * col("nodes")
    coef, start = _nnls([one, col("read")], col("after_start_rss"))
    model: dict[str, Any] = {"start_memory": {"m0_gib": round(coef[0] / GIB, 3), "rho0": round(coef[1], 4),
                                              **_errors(start, col("after_start_rss"))}}
    coef, anon = _nnls([one, col("batch_bytes")], col("after_runs_anon") - maps)
    runs: dict[str, Any] = {"a1_gib": round(coef[0] / GIB, 3), "beta": round(coef[1], 3)}
    coef, file = _nnls([one, col("held")], col("after_runs_file"))
    runs.update(f1_gib=round(coef[0] / GIB, 3), rho=round(coef[1], 4))
    model["runs_memory"] = {**runs, **_errors(anon + maps + file, col("after_runs_rss"))}
    # the peak's file-backed part is taken as the runs' (pages once touched stay): its own part
    coef, peak = _nnls([one, col("ahead") * col("batch_bytes"), col("batch_bytes")],
                       col("after_runs_peak") - col("after_runs_file") - maps)
    model["peak_memory"] = {"q0_gib": round(coef[0] / GIB, 3), "gamma": round(coef[1], 3),
                            "delta": round(coef[2], 3), **_errors(peak + maps + file, col("after_runs_peak"))}
    coef, seconds = _nnls([one, col("read")], col("loaded_seconds"))
    model["startup"] = {"t0_seconds": round(coef[0], 2), "kappa_seconds_per_gib": round(coef[1] * GIB, 3),
                        **_errors(seconds, col("loaded_seconds"))}
    model["cpu_per_batch"] = _fit_cpu(rows)
    model["batch"] = _batch_bytes(rows)
    in_gib = {"held", "read", *(f"{when}_{kind}" for when in ("after_start", "after_runs")
                                for kind in ("rss", "anon", "file", "peak"))}
    model["points"] = [{k: round(v / GIB, 4) if k in in_gib else v for k, v in p.items()} for p in pts]
    prefetch_bytes = rows[0].get("server_prefetch_bytes")
    model["papers100m"] = [
        {"feature_dtype": dtype, "prefetch_bytes": prefetch_bytes,
         **predict(model, PAPERS100M["nodes"], PAPERS100M["edges"],
                   PAPERS100M["feature_bytes"] * itemsize / 4, parts=parts, prefetch_bytes=prefetch_bytes)}
        for dtype, itemsize in (("float32", 4), ("float16", 2)) for parts in (8, 16)]
    model["within_tolerance"] = all(model[k]["max_error"] <= TOLERANCE
                                    for k in ("start_memory", "runs_memory", "peak_memory", "startup"))
    return model


def check(model: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A fitted ``model`` (another run's) against the runs of ``rows``: per run and figure
    what it measured, what the model says and the relative error."""
    s, r, q, t = model["start_memory"], model["runs_memory"], model["peak_memory"], model["startup"]
    out = []
    for p in _points(rows):
        maps, file = 4 * p["workers"] * p["nodes"], r["f1_gib"] * GIB + r["rho"] * p["held"]
        w = p["batch_bytes"]
        ahead_bytes = (q["gamma"] * p["ahead"] + q["delta"]) * w
        said = {"after_start_rss": s["m0_gib"] * GIB + s["rho0"] * p["read"],
                "after_runs_rss": r["a1_gib"] * GIB + r["beta"] * w + maps + file,
                "after_runs_peak": q["q0_gib"] * GIB + ahead_bytes + maps + file,
                "loaded_seconds": t["t0_seconds"] + t["kappa_seconds_per_gib"] * p["read"] / GIB}
        scale = {k: 1 if k == "loaded_seconds" else GIB for k in said}
        out.append({"scale": p["scale"], "partitions": p["partitions"],
                    **{k: {"measured": round(p[k] / scale[k], 3), "model": round(v / scale[k], 3),
                           "error": round(v / p[k] - 1, 4)} for k, v in said.items()}})
    worst = max((abs(row[k]["error"]) for row in out for k in row if isinstance(row[k], dict)), default=0.0)
    return {"points": out, "max_error": worst, "within_tolerance": worst <= TOLERANCE}


def _fit_cpu(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``u``, ``v`` of the servers' CPU seconds per batch ``n * (u + v * P)``."""
    runs = [(row["partitions"], run["server_cpu_seconds_per_batch"],
             float(np.mean([r["nodes_per_batch"] for r in run["ranks"]])))
            for row in rows for run in row.get("runs", [])]
    parts, cpu, nodes = (np.array(x, dtype=np.float64) for x in zip(*runs, strict=True))
    coef, model = _nnls([nodes, nodes * parts], cpu)
    return {"u_us_per_node": round(coef[0] * 1e6, 4), "v_us_per_node": round(coef[1] * 1e6, 4),
            **_errors(model, cpu)}


def _batch_bytes(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes a batch node costs on the wire (at the largest scale measured) and the nodes of
    a batch there."""
    row = max(rows, key=lambda r: (r["nodes"], -r["partitions"]))
    run = max(row["runs"], key=lambda r: r["trainers"])
    nodes = float(np.mean([r["nodes_per_batch"] for r in run["ranks"]]))
    return {"bytes_per_node": round(run["bytes_per_batch"] / nodes, 1), "nodes_per_batch": round(nodes),
            "at_nodes": row["nodes"]}


def predict(model: dict[str, Any], nodes: float, edges: float, feature_bytes: float, parts: int,
            batch_nodes: float = MAX_BATCH_NODES, workers: int = 2, prefetch_bytes: int | None = None
            ) -> dict[str, Any]:
    """The model's figures for a graph of these sizes in ``parts`` partitions, its batches
    of ``batch_nodes`` nodes (default: the most a batch can hold, so that memory and CPU
    are upper bounds), ``workers`` sampling workers a server and its ``--prefetch-bytes``."""
    held, read = held_bytes(nodes, edges, feature_bytes, parts), read_bytes(nodes, edges, parts)
    s, r, t, c = model["start_memory"], model["runs_memory"], model["startup"], model["cpu_per_batch"]
    batch_bytes = batch_nodes * model["batch"]["bytes_per_node"]
    anon = r["a1_gib"] * GIB + r["beta"] * batch_bytes + 4 * workers * nodes
    q = model["peak_memory"]
    in_flight = (q["gamma"] * ahead(batch_bytes, PREFETCH, prefetch_bytes) + q["delta"]) * batch_bytes
    peak = q["q0_gib"] * GIB + in_flight + 4 * workers * nodes + r["f1_gib"] * GIB
    cpu = batch_nodes * (c["u_us_per_node"] + c["v_us_per_node"] * parts) / 1e6
    return {"partitions": parts, "held_gib": round(held / GIB, 2),
            "start_memory_gib": round(s["m0_gib"] + s["rho0"] * read / GIB, 2),
            "runs_memory_gib": round((anon + r["f1_gib"] * GIB + r["rho"] * held) / GIB, 2),
            "long_run_memory_gib": round((anon + r["f1_gib"] * GIB + held) / GIB, 2),
            "peak_memory_gib": round((peak + r["rho"] * held) / GIB, 2),
            "long_run_peak_gib": round((peak + held) / GIB, 2),
            "startup_seconds": round(t["t0_seconds"] + t["kappa_seconds_per_gib"] * read / GIB, 2),
            "cpu_seconds_per_batch": round(cpu, 3), "batches_per_s_per_server_2_cores": round(2 / cpu, 2)}


def plot(payload: dict[str, Any], path: Path) -> None:
    """Memory per server (after start-up, after the runs) and start-up time against the
    graph's size: measured (points) and the model (lines, 4 partitions)."""
    plt = pyplot()
    model = payload.get("model") or {}
    if plt is None or not model:
        return
    pts = model["points"]
    fig, (mem, start) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, parts in enumerate(sorted({p["partitions"] for p in pts})):
        mine = [p for p in pts if p["partitions"] == parts]
        x = [p["nodes"] / 1e6 for p in mine]
        marker = "os^v"[k % 4]
        mem.scatter(x, [p["after_runs_peak"] for p in mine], marker=marker, color="C3",
                    label=f"peak while streaming, {parts} partitions")
        mem.scatter(x, [p["after_runs_rss"] for p in mine], marker=marker, color="C1",
                    label=f"after the runs, {parts} partitions")
        mem.scatter(x, [p["after_start_rss"] for p in mine], marker=marker, color="C0",
                    label=f"after start-up, {parts} partitions")
        start.scatter(x, [p["loaded_seconds"] for p in mine], marker=marker, color="C2",
                      label=f"{parts} partitions")
    sizes = sorted({(p["nodes"], p["batch_bytes"]) for p in pts if p["partitions"] == 4})
    if sizes:
        grid = np.linspace(sizes[0][0], sizes[-1][0], 40)
        nodes_per_batch = np.interp(grid, [n for n, _ in sizes], [b for _, b in sizes]) / \
            model["batch"]["bytes_per_node"]
        share = grid / PAPERS100M["nodes"]
        first = payload["rows"][0]
        per_node = first["feature_bytes"] / first["nodes"]  # as the runs stored them
        curves = [predict(model, g, PAPERS100M["edges"] * s, per_node * g, 4, nb,
                          prefetch_bytes=first.get("server_prefetch_bytes"))
                  for g, s, nb in zip(grid, share, nodes_per_batch, strict=True)]
        mem.plot(grid / 1e6, [c["runs_memory_gib"] for c in curves], color="C1", lw=1,
                 label="model, 4 partitions")
        mem.plot(grid / 1e6, [c["start_memory_gib"] for c in curves], color="C0", lw=1)
        mem.plot(grid / 1e6, [c["peak_memory_gib"] for c in curves], color="C3", lw=1)
        start.plot(grid / 1e6, [c["startup_seconds"] for c in curves], color="C2", lw=1,
                   label="model, 4 partitions")
    mem.set_xlabel("papers-like nodes (M; 29 edges a node)")
    mem.set_ylabel("resident memory per server (GiB)")
    mem.set_title("server memory, measured and modelled", fontsize=10)
    mem.legend(fontsize=7)
    start.set_xlabel("papers-like nodes (M)")
    start.set_ylabel("seconds from start to partition loaded")
    start.set_title("start-up, page cache cold", fontsize=10)
    start.legend(fontsize=7)
    fig.suptitle(f"papers-like, 1/100 to 1/10 of ogbn-papers100M ({describe_machine(payload)})", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log.info("wrote %s", path)


def print_table(payload: dict[str, Any]) -> None:
    """The run's table and the model on stdout (the CLI's own output)."""
    print(f"{'scale':>6} {'P':>2} {'nodes':>11} {'edges':>12} {'gen s':>6} {'gen GiB':>7} {'part s':>6} "
          f"{'part GiB':>8} {'load s':>6} {'start GiB':>9} {'runs GiB':>8} {'T':>2} {'batch/s':>7} "
          f"{'MB/batch':>8}")
    for row in payload["rows"]:
        servers = row.get("servers", [])
        for run in row.get("runs", []):
            print(f"{row['scale']:>6g} {row['partitions']:>2} {row['nodes']:>11,} {row['edges']:>12,} "
                  f"{row['generate']['seconds']:>6.0f} {row['generate']['peak_rss_gib']:>7.2f} "
                  f"{row['partition']['seconds']:>6.0f} {row['partition']['peak_rss_gib']:>8.2f} "
                  f"{max(s['loaded_seconds'] for s in servers):>6.1f} "
                  f"{max(s['after_start']['rss_gib'] for s in servers):>9.2f} "
                  f"{max(s['after_runs']['rss_gib'] for s in servers):>8.2f} {run['trainers']:>2} "
                  f"{run['batches_per_s']:>7.2f} {run['bytes_per_batch'] / 1e6:>8.1f}")
    for skipped in payload.get("skipped", []):
        print(f"scale {skipped['scale']:g} skipped: {skipped['reason']}")
    model = payload.get("model") or {}
    for key in ("start_memory", "runs_memory", "peak_memory", "startup", "cpu_per_batch", "batch"):
        if key in model:
            print(f"{key}: " + ", ".join(f"{k} {v}" for k, v in model[key].items() if k != "errors"))
    for figures in model.get("papers100m", []):
        print("ogbn-papers100M: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
