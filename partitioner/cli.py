"""Command line: ``graphfeed-partition`` / ``python -m partitioner``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

from partitioner.algorithms import METHODS
from partitioner.format import MANIFEST_FILE, PartitionFormatError, check_files, read_manifest
from partitioner.graph import GraphData, GraphDataError, TypedGraphData, parse_edge_type
from partitioner.manifest import FEATURE_DTYPES
from partitioner.summary import format_summary
from partitioner.synthetic import PLAIN_PRESETS, TYPED_PRESETS

log = logging.getLogger("partitioner")

EXAMPLES = """\
examples:
  # the embedded demo graph, 2 partitions with METIS
  graphfeed-partition partition --synthetic small --num-parts 2 --out data/small-2
  # an OGB dataset already unzipped under ~/ogb (never downloads, never prompts)
  graphfeed-partition partition --ogb ogbn-products --ogb-root ~/ogb --num-parts 4 --out parts/
  # your own graph: an .npz with edge_index, x, y, train_idx/val_idx/test_idx
  graphfeed-partition partition --npz graph.npz --num-parts 4 --method metis --out parts/
  # a graph bigger than memory: write it as a graph directory, then stream it
  graphfeed-partition generate --preset products-like --out data/products-like
  graphfeed-partition partition --graph-dir data/products-like --num-parts 4 \\
      --method range --out data/products-like-4
  # ogbn-papers100M's shape at a tenth of its size (11M nodes, 320M edges), streamed
  graphfeed-partition generate --preset papers-like --scale 1/10 --out data/papers-like-10
  graphfeed-partition partition --graph-dir data/papers-like-10 --num-parts 4 \\
      --method range --out data/papers-like-10-4
  # a typed graph (format v2): synthetic ogbn-mag-shaped, reverse relations added
  graphfeed-partition partition --synthetic mag-small --add-reverse --num-parts 2 \
      --out data/mag-small-2
  # a graph whose labels only its edge features tell (8 features per edge)
  graphfeed-partition partition --synthetic edge-feat-small --num-parts 2 --out data/edge-feat-2
  # ogbn-mag with all its node types and relations, unzipped under ~/ogb
  graphfeed-partition partition --ogb ogbn-mag --ogb-root ~/ogb --add-reverse \
      --num-parts 4 --out parts/mag-4
  # link prediction: hold out 5 % / 10 % of the edges (and their reverses) as val / test
  # link splits, with 100 negatives per held-out edge, before partitioning
  graphfeed-partition partition --synthetic small --link-split "val=0.05,test=0.1,neg=100" \
      --num-parts 2 --out data/small-links-2
  # an OGB link dataset (train edges as the graph, its val/test edges as link splits)
  graphfeed-partition partition --ogb ogbl-citation2 --ogb-root ~/ogb --num-parts 4 --out parts/
  # check a partition directory against its manifest and print its summary
  graphfeed-partition info data/small-2 --verify
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphfeed-partition",
        description="Partition a graph once for graphfeed's sampling servers: one directory "
        "with a manifest and one sub-directory per partition (format v1; v2 for typed "
        "graphs).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_partition(sub)
    gen = sub.add_parser("generate", help="write a synthetic graph as a graph directory",
                         description="Write a synthetic graph (reproducible from --seed) as a "
                         "directory of .npy files that `partition --graph-dir` streams.")
    gen.add_argument("--preset", choices=sorted(PLAIN_PRESETS), default="small")
    _add_scale(gen, "--preset")
    gen.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    gen.add_argument("--out", type=Path, required=True, help="output graph directory")
    info = sub.add_parser("info", help="validate a partition directory and print its summary",
                          description="Read a partition directory's manifest, check its "
                          "files, and print the partition summary.")
    info.add_argument("path", type=Path, help="partition directory (holds manifest.json)")
    info.add_argument("--verify", action="store_true",
                      help="also check every file's SHA-256 (reads all data)")
    return parser


def _add_partition(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "partition", help="partition a graph into --num-parts parts",
        description="Read a graph from one source, assign its nodes to partitions and write "
        "format v1 (v2 for typed graphs: the mag-* presets, ogbn-mag, typed .npz files). "
        "Methods: metis (fewest cut edges, balances nodes, edges and training "
        "nodes; needs the graph in memory), range and hash (streaming: memory O(nodes), for "
        "graphs bigger than RAM), random.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--synthetic", choices=sorted(PLAIN_PRESETS) + sorted(TYPED_PRESETS),
                     help="a synthetic graph preset (mag-*: typed; edge-feat-*: with edge features)")
    src.add_argument("--ogb", metavar="NAME", help="an OGB node dataset, e.g. ogbn-products "
                     "(ogbn-mag is read typed, with all node types and relations), or an OGB "
                     "link dataset (ogbl-citation2, ogbl-collab: its train edges as the graph, "
                     "its splits as link splits)")
    src.add_argument("--npz", type=Path, metavar="FILE",
                     help="an .npz graph file (typed when it has edge_index__* keys)")
    src.add_argument("--graph-dir", type=Path, metavar="DIR",
                     help="a graph directory (memory-mapped; see `generate`)")
    _add_scale(p, "--synthetic")
    p.add_argument("--ogb-root", type=Path, default=Path("data/ogb"),
                   help="where OGB datasets are unzipped (default data/ogb)")
    p.add_argument("--to-undirected", action="store_true",
                   help="add reverse edges and drop repeats (OGB sources)")
    p.add_argument("--add-reverse", action="store_true",
                   help="typed graphs: add a rev_<relation> for each relation between two "
                   "types and make same-type relations undirected (as PyG's ToUndirected)")
    p.add_argument("--mag-papers-only", action="store_true",
                   help="ogbn-mag: read only paper cites paper as a homogeneous graph (v1)")
    p.add_argument("--link-split", metavar="SPEC",
                   help="hold out edges as link splits before partitioning (as PyG's "
                   "RandomLinkSplit): comma-separated key=value of val (fraction, default 0.05), "
                   "test (default 0.1), neg (negatives per val/test edge, default 0), "
                   "edge-type (src__rel__dst, default the first), seed (default --seed), "
                   "undirected (true/false, default: detected)")
    p.add_argument("--feature-dtype", choices=FEATURE_DTYPES, default=None,
                   help="store node features in this dtype (default: as the source holds them); "
                   "float16 halves their bytes on disk and in a server's memory, and is refused "
                   "where a value does not fit")
    p.add_argument("--num-parts", type=int, required=True, help="number of partitions (>= 1)")
    p.add_argument("--method", choices=METHODS, default="metis", help="default: metis")
    p.add_argument("--out", type=Path, required=True, help="output partition directory")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--skip-existing", action="store_true",
                   help="do nothing when --out already holds a complete partition with the same "
                   "--num-parts, --method, --seed (and --synthetic preset): for jobs that may run "
                   "more than once, e.g. compose or Kubernetes; a different partition there is an "
                   "error unless --overwrite is given too")
    p.add_argument("--no-progress", action="store_true",
                   help="hide progress bars (shown only when stderr is a terminal)")


def _scale(text: str) -> float:
    from partitioner.synthetic_papers import parse_scale

    try:
        return parse_scale(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("scale: ")) from None


def _add_scale(parser: argparse.ArgumentParser, preset_flag: str) -> None:
    parser.add_argument("--scale", type=_scale, default=1.0, metavar="FRACTION",
                        help=f"{preset_flag} papers-like only: this fraction of ogbn-papers100M's "
                        "size, e.g. 0.1 or 1/10 (default 1: the full size)")


def _check_scale(scale: float, preset: str | None, flag: str) -> None:
    from partitioner.synthetic import SCALABLE_PRESETS

    if scale != 1 and preset not in SCALABLE_PRESETS:
        raise ValueError(f"--scale: only {flag} {', '.join(SCALABLE_PRESETS)} scales; got --scale {scale:g} "
                         f"with {f'{flag} {preset}' if preset else 'a graph read from its source'}")


def _progress(args: argparse.Namespace) -> bool:
    """Progress bars only on a terminal: into a file or a pipe they would write a line
    per update."""
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()


def _read_source(args: argparse.Namespace) -> GraphData | TypedGraphData:
    graph = _read_graph(args)
    if args.add_reverse and not isinstance(graph, TypedGraphData):
        raise ValueError("--add-reverse: only for typed graphs; use --to-undirected for "
                         "homogeneous OGB graphs")
    if args.add_reverse and isinstance(graph, TypedGraphData):
        graph = graph.add_reverse()
    if getattr(args, "link_split", None):
        from partitioner.links import random_link_split

        graph = random_link_split(graph, **parse_link_split(args.link_split, args.seed))
    return graph


_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_link_split(spec: str, seed: int = 0) -> dict[str, Any]:
    """``--link-split``'s ``key=value,...`` as :func:`~partitioner.links.random_link_split`'s
    keyword arguments; errors name the key."""
    out: dict[str, Any] = {"seed": seed}
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        key, eq, value = (s.strip() for s in item.partition("="))
        try:
            if not eq:
                raise ValueError("expected key=value")
            if key in ("val", "test"):
                out[key] = float(value)
            elif key == "neg":
                out["num_negatives"] = int(value)
            elif key == "seed":
                out["seed"] = int(value)
            elif key == "edge-type":
                out["edge_type"] = parse_edge_type(value)
            elif key == "undirected":
                if value.lower() not in _BOOLS:
                    raise ValueError("expected true or false")
                out["undirected"] = _BOOLS[value.lower()]
            else:
                raise ValueError("expected one of val, test, neg, edge-type, seed, undirected")
        except ValueError as exc:
            raise ValueError(f"--link-split: {key or item!r}: {exc} (got {item!r})") from None
    return out


def _read_graph(args: argparse.Namespace) -> GraphData | TypedGraphData:
    """The graph the arguments name, plain or typed as the source is."""
    if args.synthetic:
        from partitioner.synthetic import generate

        return generate(args.synthetic, seed=args.seed, progress=_progress(args), scale=args.scale)
    if args.ogb:
        from partitioner.readers.ogb_links import is_ogb_link, read_ogb_link

        if is_ogb_link(args.ogb):
            return read_ogb_link(args.ogb, args.ogb_root, to_undirected=args.to_undirected)
        from partitioner.readers.ogb import read_ogb

        return read_ogb(args.ogb, args.ogb_root, to_undirected=args.to_undirected,
                        papers_only=args.mag_papers_only)
    if args.npz:
        from partitioner.readers.npz import read_npz

        return read_npz(args.npz)
    from partitioner.readers.graphdir import read_graph_dir

    return read_graph_dir(args.graph_dir)


def _existing_differs(args: argparse.Namespace) -> str | None:
    """How the complete partition already in ``--out`` differs from the one asked for
    (None: it is the same); a partial or damaged one raises PartitionFormatError."""
    manifest = read_manifest(args.out)
    check_files(args.out, manifest.records(), "size")
    have = {"--num-parts": manifest.num_partitions,
            "--method": manifest.algorithm.get("method"),
            "--seed": manifest.algorithm.get("seed")}
    want = {"--num-parts": args.num_parts, "--method": args.method, "--seed": args.seed}
    if args.synthetic:
        from partitioner.synthetic import resolve_preset

        have["--synthetic"] = manifest.graph_name
        want["--synthetic"] = resolve_preset(args.synthetic, args.scale)[0]
    have["--link-split"] = manifest.algorithm.get("link_split")
    want["--link-split"] = args.link_split
    have["--feature-dtype"] = manifest.algorithm.get("feature_dtype")
    want["--feature-dtype"] = args.feature_dtype
    if manifest.typed:
        have["--add-reverse"] = bool(manifest.algorithm.get("add_reverse"))
        want["--add-reverse"] = bool(args.add_reverse)
    diffs = [f"{k} {have[k]} there, {want[k]} asked" for k in want if have[k] != want[k]]
    return "; ".join(diffs) or None


def _cmd_partition(args: argparse.Namespace) -> int:
    from partitioner.writer import partition_graph

    if args.num_parts < 1:
        raise ValueError(f"--num-parts: expected an integer >= 1, got {args.num_parts}")
    if args.link_split:  # a malformed spec fails before the graph is read
        parse_link_split(args.link_split, args.seed)
    _check_scale(args.scale, args.synthetic, "--synthetic")
    if args.skip_existing and (args.out / MANIFEST_FILE).is_file():
        try:
            differs = _existing_differs(args)
        except PartitionFormatError as exc:
            if not args.overwrite:
                raise
            differs = f"damaged: {exc}"
        if differs is None:
            print(f"{args.out} already holds this partition ({args.num_parts} parts, "
                  f"{args.method}, seed {args.seed}); nothing to do")
            return 0
        if not args.overwrite:
            raise FileExistsError(f"--out: {args.out} holds a different partition ({differs}); "
                                  "add --overwrite to replace it")
    if args.out.exists() and any(args.out.iterdir()) and not args.overwrite:
        raise FileExistsError(f"--out: {args.out} is not empty (add --overwrite to replace it)")
    started = time.perf_counter()
    graph = _read_source(args)
    log.info("read %s in %.1f s", graph.name, time.perf_counter() - started)
    typed = isinstance(graph, TypedGraphData)
    extra: dict[str, Any] = {"add_reverse": bool(args.add_reverse)} if typed else {}
    if args.link_split:
        extra["link_split"] = args.link_split
    manifest = partition_graph(graph, args.num_parts, args.out, method=args.method, seed=args.seed,
                               overwrite=args.overwrite, progress=_progress(args), extra=extra,
                               feature_dtype=args.feature_dtype)
    print(format_summary(manifest))
    print(f"total time {time.perf_counter() - started:.1f} s; written to {args.out}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from partitioner.readers.graphdir import read_graph_dir, save_graph_dir
    from partitioner.synthetic import generate_plain, resolve_preset
    from partitioner.synthetic_papers import PapersPreset, write_papers_dir

    started = time.perf_counter()
    _check_scale(args.scale, args.preset, "--preset")
    _, params = resolve_preset(args.preset, args.scale)
    if isinstance(params, PapersPreset):  # streamed to the directory
        graph = read_graph_dir(write_papers_dir(params, args.out, seed=args.seed, progress=_progress(args)))
    else:
        graph = generate_plain(args.preset, seed=args.seed, progress=_progress(args))
        save_graph_dir(graph, args.out)
    if not isinstance(graph, GraphData):
        raise ValueError(f"--preset: expected a plain preset, got {args.preset!r}")
    edge_feats = "" if graph.edge_attr is None else \
        f"edge features {list(graph.edge_attr.shape[1:])} {graph.edge_attr.dtype}, "
    print(f"{graph.name}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, "
          f"{graph.feature_dim} features, {edge_feats}{graph.num_classes} classes -> {args.out} "
          f"({time.perf_counter() - started:.1f} s)")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    manifest = read_manifest(args.path)
    records = manifest.records()
    check_files(args.path, records, "full" if args.verify else "size")
    print(format_summary(manifest))
    print(f"{len(records)} files {'verified (SHA-256)' if args.verify else 'checked (sizes)'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {"partition": _cmd_partition, "generate": _cmd_generate, "info": _cmd_info}
    try:
        return commands[args.command](args)
    except (PartitionFormatError, GraphDataError, FileNotFoundError, FileExistsError,
            ValueError) as exc:
        print(f"graphfeed-partition: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
