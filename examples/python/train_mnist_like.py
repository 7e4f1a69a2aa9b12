"""A small CNN on an MNIST-like synthetic dataset, with iadeep choosing the batch size.

Run it on a cluster started by `iadeep up`:

    source ~/.local/share/iadeep/cluster/cluster.env
    iadeep run --batch-size 64 --min-batch-size 16 --max-batch-size 512 --lr-rule sqrt \\
        -- python examples/python/train_mnist_like.py --epochs 5 --checkpoint mnist-like.pt

The dataset: 28x28 single-channel images of 10 classes, each a fixed random stroke
pattern shifted by a few pixels and blurred with noise (generated from --seed, so no
download). iadeep.torch's AdaptiveDataLoader switches the batch size between steps when
the GPU's tuner says so, at the same position in the epoch, and rescales the
optimizer's learning rate; catch_oom() retries a step that ran out of GPU memory at the
agent's fall-back size.

GPU memory (iadeep.torch.peak_memory_mib): on CUDA, the peak PyTorch reserved since the
last batch-size change; on a machine without a GPU the process's peak resident memory
stands in for it (the tuner needs some memory figure before it grows a batch). On CUDA
the loader also fences PyTorch's allocator at the memory iadeep holds for the job.

Eviction: this is an opportunistic job, which the placer evicts when a production job on
its GPU stays above its slowdown cap. With --checkpoint PATH the loader's on_evict hook
saves the model, the optimizer and the current epoch to PATH; the job then prints why it
was evicted and exits 3 (no traceback), and `iadeep run` re-queues it: it starts the same
command again, which finds PATH and resumes at the start of the saved epoch. Without
--checkpoint nothing is saved and the restarted job starts over from epoch 0. A run that
finds PATH resumes from it, and removes it once it has trained all its epochs.

SIGTERM (`iadeep run` forwards the one it gets, e.g. from `kill` or a pod's deletion)
and Ctrl-C (SIGINT) stop the training after the current step, and the job exits 0, its
agent saying it finished.
"""

import argparse
import os
import signal
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import iadeep
import iadeep.torch

#: The exit code after an eviction (`iadeep run` re-queues the job whatever the code).
EVICTED_EXIT = 3


def mnist_like(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    prototypes = (torch.rand(10, 1, 20, 20, generator=generator) > 0.7).float()
    labels = torch.randint(0, 10, (samples,), generator=generator)
    images = torch.zeros(samples, 1, 28, 28)
    shifts = torch.randint(0, 9, (samples, 2), generator=generator)
    for i in range(samples):
        dy, dx = shifts[i].tolist()
        images[i, :, dy : dy + 20, dx : dx + 20] = prototypes[labels[i]]
    images = F.avg_pool2d(images, 3, stride=1, padding=1)
    images += 0.3 * torch.randn(images.shape, generator=generator)
    return TensorDataset(images, labels)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=12_000)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate at the submitted batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=0, help="data loader worker processes")
    parser.add_argument("--report-interval-s", type=float, default=2.0)
    parser.add_argument("--max-seconds", type=float, default=None, help="stop training after this long")
    parser.add_argument(
        "--checkpoint", metavar="PATH",
        help="on eviction, save the model, optimizer and epoch to PATH; a run that finds PATH resumes from it",
    )
    args = parser.parse_args()
    # Before the agent starts: it then leaves SIGTERM to this handler (a handler set after
    # it would replace the agent's, which finishes the task and ends the process at once).
    # Ctrl-C too, so that it ends the run as SIGTERM does, not with a traceback.
    stopping = threading.Event()
    stopped_by: list[str] = []

    def stop(signum: int, frame: object) -> None:
        stopped_by.append(signal.Signals(signum).name)
        stopping.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    dataset = mnist_like(args.samples, args.seed)
    model = Net().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_epoch = 0
    if args.checkpoint is not None and os.path.exists(args.checkpoint):  # re-queued after an eviction
        saved = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        for group in optimizer.param_groups:
            group["lr"] = args.lr  # the saved rate is scaled for the old batch size; the loader rescales it
        start_epoch = saved["epoch"]
        print(f"resumed from {args.checkpoint} at epoch {start_epoch}", flush=True)
    elif iadeep.requeued() > 0:
        print("re-queued after an eviction, with no checkpoint: starting over", flush=True)

    agent = iadeep.Agent.from_env(
        model="mnist-like-cnn", initial_batch_size=64, min_batch_size=16, max_batch_size=512,
        report_interval_s=args.report_interval_s,
    )

    def changed(change: iadeep.BatchSizeChange) -> None:
        print(
            f"epoch {loader.epoch} sample {loader.position}: {change.reason} (round {change.round}): "
            f"batch size -> {change.batch_size}, lr {optimizer.param_groups[0]['lr']:.4f}",
            flush=True,
        )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # the peak of the new batch size

    saved_epoch: list[int] = []

    def save_checkpoint(reason: str) -> None:
        # The loader calls it once evicted, after the step just trained; Evicted follows.
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": loader.epoch}
        torch.save(state, args.checkpoint + ".tmp")
        os.replace(args.checkpoint + ".tmp", args.checkpoint)  # never half a checkpoint
        saved_epoch.append(loader.epoch)

    loader = iadeep.torch.AdaptiveDataLoader(
        dataset, agent, shuffle=True, seed=args.seed, optimizer=optimizer, on_change=changed,
        on_evict=save_checkpoint if args.checkpoint is not None else None,
        num_workers=args.workers, pin_memory=device.type == "cuda",
    )
    loader.epoch = start_epoch  # the epoch's shuffle, as in the evicted run
    print(f"task {agent.task_id} on {device}: batch size {agent.batch_size}", flush=True)
    deadline = time.monotonic() + args.max_seconds if args.max_seconds is not None else float("inf")
    def should_stop() -> bool:
        return stopping.is_set() or time.monotonic() > deadline

    completed = start_epoch >= args.epochs  # every epoch trained to its end
    try:
        with agent:
            for epoch in range(start_epoch, args.epochs):
                if should_stop():
                    break
                model.train()
                loss_sum, correct, seen = 0.0, 0, 0
                for images, labels in loader:
                    images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
                    with loader.catch_oom():
                        optimizer.zero_grad(set_to_none=True)
                        logits = model(images)
                        loss = F.cross_entropy(logits, labels)
                        loss.backward()
                        optimizer.step()
                        loss_sum += loss.item() * len(labels)
                        correct += int((logits.argmax(1) == labels).sum())
                        seen += len(labels)
                    agent.record_peak_memory(iadeep.torch.peak_memory_mib(device))
                    if should_stop():
                        break
                else:  # the epoch ran to its end
                    completed = epoch == args.epochs - 1
                cut = " (stopped before the epoch's end)" if stopping.is_set() else ""
                print(
                    f"epoch {epoch}: loss {loss_sum / max(seen, 1):.4f}, accuracy {correct / max(seen, 1):.3f}, "
                    f"batch size {loader.batch_size}{cut}",
                    flush=True,
                )
    except iadeep.Evicted as evicted:
        if saved_epoch:
            what = f"epoch {saved_epoch[0]} saved to {args.checkpoint}; iadeep run re-queues the job to resume there"
        else:
            what = "nothing saved (no --checkpoint); iadeep run re-queues the job, which starts over"
        print(f"evicted ({evicted.reason}); {what}", flush=True)
        return EVICTED_EXIT
    if completed and args.checkpoint is not None and os.path.exists(args.checkpoint):
        os.remove(args.checkpoint)  # trained to the end: a later run starts afresh
    if stopped_by:
        print(f"stopped on {stopped_by[0]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
