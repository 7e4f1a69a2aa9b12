"""The cost of one training step's agent calls (`batch_size` + `record_step`) with the GIL
held, measured with timeit over a million steps against an embedded store file."""

import os
import tempfile
import timeit

import iadeep

STEPS = 1_000_000


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        agent = iadeep.Agent("bench", os.path.join(tmp, "state.redb"), "bench", 64, use_nvml=False)

        def step() -> None:
            bs = agent.batch_size
            agent.record_step(bs, 0.01)

        def empty() -> None:
            bs = 64
            del bs

        best = min(timeit.repeat(step, number=STEPS, repeat=3)) / STEPS
        overhead = min(timeit.repeat(empty, number=STEPS, repeat=3)) / STEPS
        agent.finish()
    print(
        f"python: batch_size + record_step: {best * 1e9:.0f} ns per step "
        f"(best of 3 x {STEPS} steps; an empty Python function call: {overhead * 1e9:.0f} ns)"
    )


if __name__ == "__main__":
    main()
