#!/usr/bin/env python3
"""Derive (not measure) peak training memory of transformer models vs batch size.

No GPU and no PyTorch were available when this file was written, so these numbers come from
published analytic formulas, not from a device. See README.md next to this script.

Components (bytes):
- model states with mixed-precision Adam: 16 per parameter (fp16 weights and gradients,
  fp32 master weights, momentum, variance) -- Rajbhandari et al., "ZeRO", SC 2020, sec. 3.1;
- activations per transformer layer: s*b*h*(34 + 5*a*s/h) -- Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models", MLSys 2023, eq. (1), no parallelism,
  no recomputation;
- output layer: logits in fp16 plus their fp32 softmax copy, 6*s*b*V;
- a fixed CUDA context and allocator reserve of 400 MiB (typical for a PyTorch process; an
  assumption, not a measurement).
Parameters: 12*L*h^2 + 13*L*h + (V + s)*h (Korthikanti et al., sec. 3 / Narayanan et al.).
"""
import sys

MIB = 1024 * 1024
CONTEXT_MIB = 400

# name: (layers L, hidden h, heads a, vocabulary V, sequence length s)
MODELS = {
    "gpt2-small-s512": (12, 768, 12, 50257, 512),
    "gpt2-small-s1024": (12, 768, 12, 50257, 1024),
    "gpt2-medium-s1024": (24, 1024, 16, 50257, 1024),
    "gpt2-large-s1024": (36, 1280, 20, 50257, 1024),
    "bert-base-s128": (12, 768, 12, 30522, 128),
    "bert-base-s512": (12, 768, 12, 30522, 512),
    "bert-large-s128": (24, 1024, 16, 30522, 128),
    "bert-large-s512": (24, 1024, 16, 30522, 512),
}
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


def peak_mib(layers, hidden, heads, vocab, seq, batch):
    params = 12 * layers * hidden**2 + 13 * layers * hidden + (vocab + seq) * hidden
    states = 16 * params
    activations = layers * seq * batch * hidden * (34 + 5 * heads * seq / hidden)
    logits = 6 * seq * batch * vocab
    return CONTEXT_MIB + (states + activations + logits) / MIB


def main(out):
    out.write("model,batch_size,memory_mib\n")
    for name, (layers, hidden, heads, vocab, seq) in MODELS.items():
        for batch in BATCH_SIZES:
            out.write(f"{name},{batch},{peak_mib(layers, hidden, heads, vocab, seq, batch):.1f}\n")


if __name__ == "__main__":
    main(sys.stdout)
