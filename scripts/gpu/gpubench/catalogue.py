"""The models the GPU scripts measure, and with what.

Every model trains on random data of its input's shape (no data set, no download,
no pretrained weights): images of 3x224x224 with 1000 classes, or token sequences
for the language models. Convolutional networks train with SGD (momentum 0.9),
vision transformers and language models with AdamW, as they usually are.

``lm-small`` and ``gpt2-small-s512`` are decoder-only transformer language models
built from ``torch.nn`` in :mod:`gpubench.backend` (the device machine has no
``transformers`` package); the second has GPT-2 small's shape (12 layers, width 768,
12 heads, vocabulary 50257) at sequence length 512, the configuration that
``tuner/data/transformer_memory_derived.csv`` derives from formulas, so the two can
be compared.

``synthetic`` holds the numbers of the ``--dry-run`` backend (:mod:`gpubench.synthetic`):
**invented, not measured**; they only make the synthetic curves differ per model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class SyntheticProfile:
    """Parameters of the synthetic backend's formulas (not measurements)."""

    #: Weights, gradients and optimiser state, MiB.
    fixed_mib: float
    #: Activation memory per sample, MiB.
    per_sample_mib: float
    #: Step time at batch size 0, seconds.
    step_fixed_s: float
    #: Step time per sample, seconds.
    step_per_sample_s: float


@dataclass(frozen=True)
class ModelSpec:
    #: Our name, used in every output file.
    name: str
    #: "torchvision", "timm" or "builtin" (a transformer LM built here from torch.nn).
    library: str
    #: "cnn", "vit" or "lm".
    family: str
    #: The constructor's name in its library (builtin: a key of LM_SHAPES).
    constructor: str
    synthetic: SyntheticProfile

    @property
    def optimizer(self) -> str:
        return "sgd-momentum" if self.family == "cnn" else "adamw"


#: Decoder-only LM shapes: (layers, width, heads, vocabulary, sequence length).
LM_SHAPES: Dict[str, Tuple[int, int, int, int, int]] = {
    "lm-small": (6, 512, 8, 32000, 256),
    "gpt2-small-s512": (12, 768, 12, 50257, 512),
}


def _spec(name: str, library: str, family: str, constructor: str, syn: Tuple[float, float, float, float]) -> ModelSpec:
    return ModelSpec(name, library, family, constructor, SyntheticProfile(*syn))


MODELS: Dict[str, ModelSpec] = {
    m.name: m
    for m in [
        _spec("resnet18", "torchvision", "cnn", "resnet18", (180, 38, 0.004, 0.00055)),
        _spec("resnet50", "torchvision", "cnn", "resnet50", (300, 105, 0.008, 0.0014)),
        _spec("mobilenet_v3_large", "torchvision", "cnn", "mobilenet_v3_large", (80, 60, 0.006, 0.0006)),
        _spec("efficientnet_b0", "torchvision", "cnn", "efficientnet_b0", (90, 95, 0.007, 0.0011)),
        _spec("densenet121", "torchvision", "cnn", "densenet121", (120, 140, 0.012, 0.0016)),
        _spec("vgg16", "torchvision", "cnn", "vgg16", (1650, 95, 0.006, 0.0030)),
        _spec("convnext_tiny", "torchvision", "cnn", "convnext_tiny", (340, 110, 0.008, 0.0018)),
        _spec("vit_b_16", "torchvision", "vit", "vit_b_16", (1320, 120, 0.007, 0.0035)),
        _spec("vit_small_patch16_224", "timm", "vit", "vit_small_patch16_224", (350, 55, 0.005, 0.0012)),
        _spec("deit_tiny_patch16_224", "timm", "vit", "deit_tiny_patch16_224", (95, 28, 0.004, 0.0004)),
        _spec("swin_tiny_patch4_window7_224", "timm", "vit", "swin_tiny_patch4_window7_224", (450, 115, 0.010, 0.0019)),
        _spec("efficientnet_b2", "timm", "cnn", "efficientnet_b2", (130, 150, 0.009, 0.0017)),
        _spec("lm-small", "builtin", "lm", "lm-small", (620, 70, 0.005, 0.0021)),
        _spec("gpt2-small-s512", "builtin", "lm", "gpt2-small-s512", (2000, 420, 0.010, 0.0120)),
    ]
}

#: Batch sizes of the memory data set: the same ladder for every model, so
#: ``iadeep memory eval --fit-upto 64`` predicts exactly 2x beyond the fitted sizes.
MEMORY_BATCH_SIZES: List[int] = [2, 4, 8, 16, 32, 64, 128]

#: Job types of the interference data set: model and two batch sizes each.
INTERFERENCE_JOBS: Dict[str, List[int]] = {
    "resnet18": [32, 128],
    "resnet50": [32, 128],
    "mobilenet_v3_large": [32, 128],
    "efficientnet_b0": [32, 128],
    "vit_small_patch16_224": [32, 128],
    "lm-small": [8, 32],
}

#: The end-to-end job mix: (model, submitted batch size m0, steps at m0).
E2E_MIX: List[Tuple[str, int, int]] = [
    ("resnet18", 64, 600),
    ("resnet50", 32, 400),
    ("mobilenet_v3_large", 64, 600),
    ("vit_small_patch16_224", 64, 400),
    ("lm-small", 16, 500),
    ("efficientnet_b0", 64, 500),
]


def model(name: str) -> ModelSpec:
    """The catalogue's model `name`; the error lists the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def parse_job_types(text: str) -> Dict[str, List[int]]:
    """Parses ``model:b1/b2,model:b1`` into {model: [batch sizes]}."""
    jobs: Dict[str, List[int]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, sizes = item.partition(":")
        model(name)
        if not sep or not sizes:
            raise ValueError(f"{item!r}: expected MODEL:B1/B2")
        try:
            values = sorted({int(s) for s in sizes.split("/")})
        except ValueError:
            raise ValueError(f"{item!r}: batch sizes must be integers") from None
        if any(v <= 0 for v in values):
            raise ValueError(f"{item!r}: batch sizes must be positive")
        jobs[name] = values
    if not jobs:
        raise ValueError("no job types given")
    return jobs
