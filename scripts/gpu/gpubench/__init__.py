"""Shared parts of iadeep's GPU measurement scripts (scripts/gpu/*.py).

- :mod:`gpubench.catalogue`: the models measured, their batch sizes, the job mix;
- :mod:`gpubench.backend`: what runs a training step: PyTorch on a GPU, or the
  clearly labelled synthetic backend of ``--dry-run`` (:mod:`gpubench.synthetic`);
- :mod:`gpubench.worker`: the child process that holds one model on the GPU and
  answers the measuring script's commands (one JSON object per line);
- :mod:`gpubench.device`: the GPU as NVML or ``nvidia-smi`` describe it;
- :mod:`gpubench.outputs`: output folders, metadata, and the file formats iadeep reads;
- :mod:`gpubench.svg`: a small step-line plot without matplotlib.

Nothing here imports torch at module level: the scripts' ``--help`` and ``--dry-run``
run on a machine without PyTorch.
"""
