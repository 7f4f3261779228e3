"""``graphfeed-train``: train a GNN node classifier (or, with ``--task link``, a link
predictor) on minibatches streamed by graphfeed servers, with DDP (torchrun-compatible);
typed graphs (format v2, e.g. ogbn-mag) train ``--model rgcn`` or ``hetero-sage`` on
``HeteroData`` batches; either kind trains from the servers or, with ``--partition-dir``,
sampled in this process from the partition files::

    graphfeed-train --servers node0:50051,node1:50051 --fanouts 10,5 --epochs 10
    torchrun --nproc-per-node 4 -m trainer_client.train --servers ... --checkpoint-dir ckpt
    graphfeed-train --partition-dir parts/mag-2 --model rgcn --fanouts 10,5 --epochs 10

This module is the command line; the loop (one for every task and both kinds of graph)
is :mod:`trainer_client.loop`, the tasks :mod:`trainer_client.node_task` and
:mod:`trainer_client.link_task`, the process group and checkpoints
:mod:`trainer_client.ddp`. Every wait on the service is bounded by ``--timeout``, and each
collective by the process group's timeout, so a failure ends the job with a clear error
instead of a hang; Ctrl-C ends it with one line saying what was saved and how to resume.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shlex
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from protos.allocator import keep_freed_memory
from protos.channel import GraphfeedError
from protos.security import Security, read_token, set_default_security
from trainer_client.cache import parse_cache_size
from trainer_client.cluster import Cluster
from trainer_client.connect import REFUSED_GRACE
from trainer_client.ddp import DIST_BACKENDS, env_int, last_saved, setup_distributed, teardown_distributed
from trainer_client.evaluate import EVAL_MODES
from trainer_client.export import check_directory
from trainer_client.featureless import SPARSE_OPTIMIZERS
from trainer_client.link_models import DECODERS
from trainer_client.link_task import EXCLUDE_CHOICES, cluster_link_task
from trainer_client.loop import run, stop_requested
from trainer_client.models import MODELS
from trainer_client.node_task import cluster_task, partition_dir_task
from trainer_client.typed_models import TYPED_MODELS

log = logging.getLogger("trainer_client.train")

#: Flags whose value is a comma-separated list, which may start with a minus sign
#: (``--fanouts -1,-1``).
LIST_FLAGS = ("--fanouts", "--eval-fanouts")
_LIST_VALUE = re.compile(r"^-\d+(\s*,\s*-?\d+)*\s*,?$")


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def joined_list_values(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--fanouts -1,-1`` as ``--fanouts=-1,-1`` (every :data:`LIST_FLAGS`
    flag): argparse takes a value that starts with "-" and is not one number for a flag."""
    args, out, i = list(argv), list[str](), 0
    while i < len(args) and args[i] != "--":  # what follows "--" is left as it is
        joined = args[i] in LIST_FLAGS and i + 1 < len(args) and _LIST_VALUE.match(args[i + 1])
        out.append(f"{args[i]}={args[i + 1]}" if joined else args[i])
        i += 2 if joined else 1
    return out + args[i:]


def _no_zero_hop(flag: str, fanouts: Sequence[int]) -> str | None:
    """Why ``fanouts`` is refused when a hop draws 0 neighbors (None: it is not)."""
    if 0 not in fanouts:
        return None
    hop = list(fanouts).index(0)
    fix = f"use {flag} {','.join(map(str, fanouts[:hop]))} (with --layers {len(fanouts)} for as many " \
        "layers)" if hop else "-1 draws every neighbor"
    return (f"{flag}: a fanout of 0 at hop {hop + 1} samples no neighbors there, so no later hop samples any "
            f"either (got {','.join(map(str, fanouts))}); {fix}")


def _eval_fanouts(text: str) -> list[int] | None:
    if text.strip().lower() == "full":
        return None
    fanouts = _int_list(text)
    if not fanouts or any(f < -1 for f in fanouts):
        raise argparse.ArgumentTypeError(f"expected 'full' or comma-separated fanouts >= -1, got {text!r}")
    return fanouts


def _positive(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a value > 0, got {text}")
        return value
    return parse


def _cache_size(text: str) -> float | str | None:
    if text.strip().lower() == "auto":
        return None
    try:
        parse_cache_size(text, "--cache-size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphfeed-train", description="Train a GNN on minibatches from graphfeed sampling servers.")
    p.add_argument("--task", choices=["node", "link"], default="node",
                   help="node: node classification on the node splits; link: link prediction on the "
                        "graph's link splits (train, val, test; docs/training.md, 'Link prediction')")
    p.add_argument("--servers", default=None, help="comma-separated host:port of the sampling servers")
    p.add_argument("--partition-dir", type=Path, default=None,
                   help="instead of --servers: sample in this process from a partition directory "
                        "on this machine (either kind of graph; evaluation sampled)")
    p.add_argument("--fanouts", type=_int_list, default=[10, 5], help="neighbors per hop (default 10,5)")
    p.add_argument("--batch-size", type=_positive(int), default=1024,
                   help="training seeds per batch on each rank: one optimizer step sees "
                        "world size x this (PyG's per-process batch_size)")
    p.add_argument("--eval-batch-size", type=_positive(int), default=None, help="default: --batch-size")
    p.add_argument("--eval", choices=EVAL_MODES, default=None,
                   help="how validation and test are evaluated: layerwise (exact: each layer once over every "
                        "node, the layer tables on the servers, docs/training.md 'Layer-wise inference') or "
                        "sampled (on sampled neighborhoods, --eval-fanouts; faster, inexact). Default, "
                        "measured (sampling every neighbor, as exact, exceeds --max-batch-edges on large "
                        "graphs): layerwise from --servers for --task node and --task link, plain and "
                        "typed; sampled with --partition-dir")
    p.add_argument("--eval-fanouts", type=_eval_fanouts, default=argparse.SUPPRESS,
                   help="sampled evaluation's neighbors per hop, or 'full' (every neighbor); default "
                        "--fanouts. Given without --eval it means --eval sampled, except 'full' for --task "
                        "node on a plain graph, which means --eval layerwise")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=_positive(float), default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--model", choices=[*sorted(MODELS), *TYPED_MODELS], default="sage",
                   help="sage, gcn, gat, gin, gine (homogeneous graphs; gine takes the edge features); "
                        "rgcn, hetero-sage (typed graphs)")
    p.add_argument("--edge-features", action="store_true",
                   help="gat: attend with the graph's edge features too (edge_dim); gine always "
                        "takes them")
    p.add_argument("--hidden", type=_positive(int), default=256)
    p.add_argument("--layers", type=_positive(int), default=None, help="default: number of fanouts")
    p.add_argument("--heads", type=_positive(int), default=4, help="attention heads (gat)")
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK when available), cpu, cuda[:i]")
    p.add_argument("--dist-backend", choices=DIST_BACKENDS, default="auto",
                   help="DDP's process group: auto (NCCL on CUDA, gloo on the CPU), nccl or gloo "
                        "(gloo lets several ranks share one GPU: --device cuda:0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feature-dtype", choices=["float32", "float16", "bfloat16", "stored"], default="float32",
                   help="feature dtype on the wire (cast to float32 on the device)")
    p.add_argument("--cache-size", type=_cache_size, default=None,
                   help="trainer-side hot-feature cache: a fraction of the nodes (0.2, '20%%'), a size "
                        "('2GiB') or 0 for none; default 'auto': on a CUDA device every row when the "
                        "features fit in a quarter of its free memory, else the hottest that do; "
                        "0 on the CPU")
    p.add_argument("--prefetch", type=_positive(int), default=4, help="batches streamed ahead")
    p.add_argument("--checkpoint-dir", type=Path, default=None)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir if it has one")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="also save the checkpoint every N optimizer steps of an epoch, with the epoch's "
                        "progress, which --resume continues from, on any number of ranks (0: at epoch ends "
                        "only)")
    p.add_argument("--metrics-json", type=Path, default=None)
    p.add_argument("--timeout", type=_positive(float), default=120.0,
                   help="seconds to wait for servers at start and for a stalled stream before it is resumed")
    p.add_argument("--refused-grace", type=_positive(float), default=REFUSED_GRACE,
                   help="seconds every server may refuse connections at start (nothing listens there) "
                        f"before the trainer gives up (default {REFUSED_GRACE:g}); servers that answer, "
                        "e.g. while they load their partition, are waited for up to --timeout")
    p.add_argument("--reconnect-timeout", type=_positive(float), default=15.0,
                   help="seconds a broken stream is retried (a server restarted within this time "
                        "is rejoined) before the server counts as gone")
    p.add_argument("--tls-ca", type=Path, default=None,
                   help="CA (PEM) that signed the servers' certificates: connect with TLS")
    p.add_argument("--tls-cert", type=Path, default=None, help="this trainer's certificate (mutual TLS)")
    p.add_argument("--tls-key", type=Path, default=None, help="this trainer's private key (mutual TLS)")
    p.add_argument("--token-file", type=Path, default=None,
                   help="file holding the servers' bearer token (or set GRAPHFEED_TOKEN_FILE / "
                        "GRAPHFEED_TOKEN)")
    link = p.add_argument_group("link prediction (--task link)")
    link.add_argument("--decoder", choices=DECODERS, default="dot",
                      help="scores a pair of embeddings: dot product, or an MLP of their product")
    link.add_argument("--neg-ratio", type=_positive(float), default=1.0,
                      help="binary negatives drawn per positive training edge")
    link.add_argument("--strict-negatives", action="store_true",
                      help="redraw negatives that are edges of the graph")
    link.add_argument("--exclude", choices=EXCLUDE_CHOICES, default="none",
                      help="remove each training batch's positive seed edges (self), and their reverses "
                           "(reverse), from its message-passing edges")
    link.add_argument("--eval-negatives", type=_positive(int), default=100,
                      help="negatives drawn per positive for MRR when a split stores none")
    link.add_argument("--hits-k", type=_positive(int), default=50,
                      help="K of Hits@K where a split's negatives are a '<split>_neg' split (ogbl-collab)")
    emb = p.add_argument_group("node types without features (docs/training.md, 'Embeddings of featureless "
                               "node types')")
    emb.add_argument("--sparse-embedding", action="store_true",
                     help="give every node type without features a learnable embedding held by the servers "
                          "(partitioned like the nodes, updated there by a sparse optimizer from the rows "
                          "each step touched) instead of a dense one in the model, replicated on every "
                          "rank and all-reduced whole every step")
    emb.add_argument("--sparse-optimizer", choices=list(SPARSE_OPTIMIZERS), default="adagrad",
                     help="the servers' optimizer of those embeddings (torch's Adagrad or SparseAdam)")
    emb.add_argument("--sparse-lr", type=_positive(float), default=0.06,
                     help="learning rate of those embeddings")
    emb.add_argument("--embedding-dim", type=_positive(int), default=None,
                     help="width of the featureless types' embeddings (default: --hidden); a linear "
                          "layer projects them to --hidden where they differ")
    out = p.add_argument_group("every node's output (docs/training.md, 'Exporting every node's output')")
    out.add_argument("--export-embeddings", type=Path, default=None, metavar="DIR",
                     help="after training, write the selected model's last-layer output (logits; a link "
                          "predictor's embeddings) of every node, by layer-wise inference, into DIR: per "
                          "node type sharded .npy files in original-ID order and manifest.json, written "
                          "whole or not at all (--epochs 0 --resume exports a checkpoint's model)")
    out.add_argument("--keep-embeddings", default=None, metavar="NAME",
                     help="keep that output on the servers too, as node tensors NAME/<type>")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--log-level", default="INFO")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(joined_list_values(sys.argv[1:] if argv is None else argv))
    args.eval_fanouts_given = hasattr(args, "eval_fanouts")
    args.eval_fanouts = getattr(args, "eval_fanouts", None)
    if (args.servers is None) == (args.partition_dir is None):
        parser.error("--servers or --partition-dir: expected exactly one of them")
    if args.epochs < 0:
        parser.error(f"--epochs: expected >= 0, got {args.epochs}")
    if not args.fanouts or any(f < -1 for f in args.fanouts):
        parser.error(f"--fanouts: expected fanouts >= -1, got {args.fanouts}")
    for flag, fanouts in (("--fanouts", args.fanouts), ("--eval-fanouts", args.eval_fanouts or [])):
        if refused := _no_zero_hop(flag, fanouts):
            parser.error(refused)
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout: expected 0 <= dropout < 1, got {args.dropout}")
    if args.task == "link" and args.partition_dir is not None:
        parser.error("--task link: expected --servers (link batches are sampled by the servers), got "
                     "--partition-dir")
    if args.sparse_embedding and args.partition_dir is not None:
        parser.error("--sparse-embedding: expected --servers (the servers hold the embeddings), got "
                     "--partition-dir")
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every: expected a number of steps >= 0, got {args.checkpoint_every}")
    for flag, given in (("--resume", args.resume), ("--checkpoint-every", args.checkpoint_every)):
        if given and args.checkpoint_dir is None:
            parser.error(f"{flag}: expected --checkpoint-dir too")
    if (args.export_embeddings or args.keep_embeddings) and args.partition_dir is not None:
        parser.error("--export-embeddings, --keep-embeddings: expected --servers (every node's output is "
                     "computed there), got --partition-dir")
    if args.export_embeddings is not None:
        try:
            check_directory(args.export_embeddings)
        except ValueError as exc:
            parser.error(str(exc))
    if args.eval == "layerwise" and args.partition_dir is not None:
        parser.error("--eval layerwise: expected --servers (the layer tables live on the servers), got "
                     "--partition-dir")
    if args.eval == "layerwise" and args.eval_fanouts_given and args.eval_fanouts is not None:
        parser.error(f"--eval layerwise: every neighbor is read; expected no --eval-fanouts (sampled "
                     f"evaluation's), got {','.join(map(str, args.eval_fanouts))}")
    args.layers = args.layers or len(args.fanouts)
    args.eval_batch_size = args.eval_batch_size or args.batch_size
    return args


def interrupted(args: argparse.Namespace, argv: Sequence[str]) -> str:
    """What a run stopped by Ctrl-C leaves in ``--checkpoint-dir``, and the command that
    continues it (``argv``: the run's arguments)."""
    if args.checkpoint_dir is None:
        return "interrupted: nothing saved (no --checkpoint-dir: pass one to continue a run with --resume)"
    last = last_saved(args.checkpoint_dir)
    saved = f"saved {last[1]} in {last[0]}" if last else f"nothing saved yet in {args.checkpoint_dir}"
    again = shlex.join([*argv, *([] if args.resume else ["--resume"])])
    launch = "graphfeed-train" if env_int("WORLD_SIZE", 1) == 1 else \
        "torchrun <the same options> -m trainer_client.train"
    return f"interrupted: {saved}; continue with: {launch} {again}"


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (0 ok, 1 a graphfeed or input error,
    130 interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    keep_freed_memory()  # every batch allocates alike: reuse the blocks, skip page faults
    env = None
    cluster: Cluster | None = None
    previous_security: list[Security | None] = []  # set once this run sets its own
    previous_handler = None
    stop_requested.clear()
    try:
        previous_handler = _catch_sigint()
        rank = env_int("RANK", 0)
        logging.basicConfig(level=args.log_level.upper() if rank == 0 else logging.WARNING,
                            format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
        previous_security.append(set_default_security(Security(
            ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, token=read_token(args.token_file))))
        env = setup_distributed(args.device, args.timeout, args.dist_backend)
        if args.partition_dir is not None:
            metrics = run(args, env, partition_dir_task(args, env))
        else:
            log.info("waiting up to %g s for the servers %s", args.timeout, args.servers)
            cluster = Cluster(args.servers, connect_timeout=args.timeout, refused_grace=args.refused_grace)
            task = cluster_link_task if args.task == "link" else cluster_task
            metrics = run(args, env, task(args, env, cluster))
        if env.rank == 0 and args.metrics_json is not None:
            args.metrics_json.parent.mkdir(parents=True, exist_ok=True)
            args.metrics_json.write_text(json.dumps(metrics, indent=2) + "\n")
        return 0
    except (GraphfeedError, ValueError, OSError) as exc:  # OSError: e.g. a disk full while exporting
        rank = env.rank if env is not None else env_int("RANK", 0)
        log.error("rank %d: %s", rank, exc, exc_info=log.isEnabledFor(logging.DEBUG))
        return 1
    except (KeyboardInterrupt, SystemError) as exc:
        # Ctrl-C inside a compiled kernel surfaces as a SystemError ("returned a result with
        # an exception set"), caused by the interrupt or after it (the handler asked to stop)
        if isinstance(exc, SystemError) and not (
                isinstance(exc.__cause__ or exc.__context__, KeyboardInterrupt) or stop_requested.is_set()):
            raise
        if (env.rank if env is not None else env_int("RANK", 0)) == 0:
            log.warning("%s", interrupted(args, argv))
        return 130
    finally:
        if cluster is not None:
            cluster.close()
        teardown_distributed()
        if previous_security:  # an in-process caller keeps its own
            set_default_security(previous_security[0])
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)
        stop_requested.clear()  # an in-process caller's own runs are not stopped by this one's


def _catch_sigint() -> Any:
    """SIGINT (Ctrl-C) both raises KeyboardInterrupt and sets :data:`stop_requested`
    (which the training loop checks every step); returns the handler it replaced (None
    off the main thread, where none can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupted(signum: int, frame: Any) -> None:
        stop_requested.set()
        raise KeyboardInterrupt

    return signal.signal(signal.SIGINT, interrupted)


if __name__ == "__main__":
    sys.exit(main())
