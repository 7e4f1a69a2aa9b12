"""Softmax regression in plain numpy, with the iadeep agent choosing the batch size.

Run it on a cluster started by `iadeep up`:

    source ~/.local/share/iadeep/cluster/cluster.env
    iadeep run --batch-size 64 --min-batch-size 16 --max-batch-size 512 --lr-rule sqrt \\
        -- python examples/python/train_numpy.py --epochs 20

The loop is what any framework-free trainer does: it asks the agent for the batch size
before each step, times the step, and between steps applies the tuner's changes (the
next batch starts where the last one ended, at the new size, with the learning rate
scaled by the change's factor). The data is synthetic (a fixed random linear teacher),
so the example needs nothing but numpy.

On a machine without a GPU the job's peak resident memory stands in for GPU memory
(the tuner needs some memory figure before it grows a batch); a GPU job records what
its framework measures instead.
"""

import argparse
import resource
import sys
import time

import numpy as np

import iadeep


def peak_rss_mib() -> int:
    """This process's peak resident memory, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


def make_data(samples: int, features: int, classes: int, seed: int):
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(features, classes))
    x = rng.normal(size=(samples, features)).astype(np.float32)
    logits = x @ teacher + rng.normal(scale=2.0, size=(samples, classes))
    return x, logits.argmax(axis=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=50_000)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.5, help="learning rate at the submitted batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report-interval-s", type=float, default=2.0)
    args = parser.parse_args()

    x, y = make_data(args.samples, args.features, args.classes, args.seed)
    weights = np.zeros((args.features, args.classes), dtype=np.float32)
    rng = np.random.default_rng(args.seed + 1)

    agent = iadeep.Agent.from_env(
        model="numpy-softmax", initial_batch_size=64, min_batch_size=16, max_batch_size=512,
        report_interval_s=args.report_interval_s,
    )
    lr = args.lr * agent.lr_factor
    print(f"task {agent.task_id}: starting at batch size {agent.batch_size}, lr {lr:.4f}", flush=True)
    with agent:
        for epoch in range(args.epochs):
            order = rng.permutation(args.samples)
            position, loss_sum, steps = 0, 0.0, 0
            while position < args.samples:
                bs = agent.batch_size
                started = time.perf_counter()
                idx = order[position : position + bs]
                xb, yb = x[idx], y[idx]
                logits = xb @ weights
                logits -= logits.max(axis=1, keepdims=True)
                probs = np.exp(logits)
                probs /= probs.sum(axis=1, keepdims=True)
                loss_sum += float(-np.log(probs[np.arange(len(idx)), yb] + 1e-12).mean())
                probs[np.arange(len(idx)), yb] -= 1.0
                weights -= lr * (xb.T @ probs) / len(idx)
                agent.record_step(len(idx), time.perf_counter() - started)
                agent.record_peak_memory(peak_rss_mib())
                position += len(idx)
                steps += 1
                change = agent.poll_change()
                if change is not None:
                    lr = args.lr * change.lr_factor
                    print(
                        f"epoch {epoch} sample {position}: {change.reason} (round {change.round}): "
                        f"batch size {bs} -> {change.batch_size}, lr {lr:.4f}",
                        flush=True,
                    )
            accuracy = float(((x @ weights).argmax(axis=1) == y).mean())
            print(
                f"epoch {epoch}: mean loss {loss_sum / steps:.4f}, accuracy {accuracy:.3f}, "
                f"batch size {agent.batch_size}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
