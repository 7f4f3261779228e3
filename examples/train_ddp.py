"""A PyG training loop on graphfeed: DDP, a new shuffle per epoch, validation every epoch
with the best model kept and tested, and inference whose outputs line up with the input
nodes. Prints the best validation accuracy and the test accuracy of that model last.

Run it against running sampling servers (any number of processes)::

    torchrun --nproc-per-node 2 examples/train_ddp.py --servers 127.0.0.1:50051,127.0.0.1:50052

or let graphfeed-local start a server per partition of your graph and stop them after::

    graphfeed-local --partition-dir parts/ --nproc-per-node 2 --trainer-script examples/train_ddp.py \\
        -- --epochs 5
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch_geometric.nn import GraphSAGE

from protos.allocator import keep_freed_memory
from trainer_client import Cluster, RemoteNeighborLoader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", required=True, help="comma-separated host:port of the sampling servers")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256, help="seeds per batch on each rank")
    args = parser.parse_args()

    keep_freed_memory()  # every batch allocates alike: keep freed blocks for the next one
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    cluster = Cluster(args.servers)  # one set of channels for all three loaders
    train_loader = RemoteNeighborLoader(cluster, "train", num_neighbors=[10, 5], batch_size=args.batch_size,
                                        shuffle=True, rank=rank, world_size=world_size, device=device)
    val_loader, test_loader = (RemoteNeighborLoader(cluster, split, num_neighbors=[10, 5], batch_size=1024,
                                                    rank=rank, world_size=world_size, device=device)
                               for split in ("val", "test"))

    model = GraphSAGE(train_loader.num_features, 64, num_layers=2, out_channels=train_loader.num_classes)
    model = model.to(device)
    ddp = DistributedDataParallel(model) if world_size > 1 else model
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def accuracy(loader: RemoteNeighborLoader) -> float:
        model.eval()
        correct = total = torch.zeros((), device=device)
        with torch.no_grad():
            for batch in loader:
                out = model(batch.x, batch.edge_index)[: batch.batch_size]
                y = batch.y[: batch.batch_size]
                correct = correct + (out.argmax(-1) == y).sum()
                total = total + y.numel()
        both = torch.stack([correct, total]).double()
        if world_size > 1:
            dist.all_reduce(both)
        return float(both[0] / both[1].clamp(min=1))

    best_val, best_state = -1.0, None
    for epoch in range(args.epochs):
        train_loader.set_epoch(epoch)  # every rank agrees on the epoch's shuffle and draws
        ddp.train()
        for batch in train_loader:  # the same number of batches on every rank
            optimizer.zero_grad()
            out = ddp(batch.x, batch.edge_index)[: batch.batch_size]
            F.cross_entropy(out, batch.y[: batch.batch_size]).backward()
            optimizer.step()
        val_acc = accuracy(val_loader)
        if val_acc > best_val:
            best_val, best_state = val_acc, copy.deepcopy(model.state_dict())
        if rank == 0:
            print(f"epoch {epoch}: val acc {val_acc:.4f}")
    assert best_state is not None
    model.load_state_dict(best_state)
    test_acc = accuracy(test_loader)  # every rank takes part: the counts are summed over ranks

    # Inference over chosen nodes (original IDs), in their order: one rank, shuffle=False.
    if rank == 0:
        nodes = val_loader.input_nodes[:500]
        loader = RemoteNeighborLoader(cluster, input_nodes=nodes, num_neighbors=[10, 5], batch_size=128,
                                      device=device)
        model.eval()
        with torch.no_grad():
            batches = list(loader)
            out = torch.cat([model(b.x, b.edge_index)[: b.batch_size] for b in batches])
        order = torch.cat([b.input_id for b in batches])
        assert torch.equal(order, torch.arange(nodes.numel()))  # out[i] belongs to nodes[i]
        print(f"predicted {out.shape[0]} nodes, first {nodes[:3].tolist()} -> classes "
              f"{out.argmax(-1)[:3].tolist()}")
        print(f"best val acc {best_val:.4f}, test acc {test_acc:.4f}")
    cluster.close()
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
