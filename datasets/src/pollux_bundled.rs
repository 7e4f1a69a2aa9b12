// One entry per model folder under data/pollux (regenerate by listing the folders when adding a model).

const BUNDLED: &[BundledModel] = &[
    BundledModel {
        name: "bert",
        placements: include_str!("../../data/pollux/bert/placements.csv"),
        validations: &[
            (12, include_str!("../../data/pollux/bert/validation-12.csv")),
            (24, include_str!("../../data/pollux/bert/validation-24.csv")),
            (48, include_str!("../../data/pollux/bert/validation-48.csv")),
            (96, include_str!("../../data/pollux/bert/validation-96.csv")),
            (192, include_str!("../../data/pollux/bert/validation-192.csv")),
            (384, include_str!("../../data/pollux/bert/validation-384.csv")),
        ],
    },
    BundledModel {
        name: "cifar10",
        placements: include_str!("../../data/pollux/cifar10/placements.csv"),
        validations: &[
            (128, include_str!("../../data/pollux/cifar10/validation-128.csv")),
            (256, include_str!("../../data/pollux/cifar10/validation-256.csv")),
            (512, include_str!("../../data/pollux/cifar10/validation-512.csv")),
            (1024, include_str!("../../data/pollux/cifar10/validation-1024.csv")),
            (2048, include_str!("../../data/pollux/cifar10/validation-2048.csv")),
            (4096, include_str!("../../data/pollux/cifar10/validation-4096.csv")),
        ],
    },
    BundledModel {
        name: "deepspeech2",
        placements: include_str!("../../data/pollux/deepspeech2/placements.csv"),
        validations: &[
            (20, include_str!("../../data/pollux/deepspeech2/validation-20.csv")),
            (40, include_str!("../../data/pollux/deepspeech2/validation-40.csv")),
            (80, include_str!("../../data/pollux/deepspeech2/validation-80.csv")),
            (160, include_str!("../../data/pollux/deepspeech2/validation-160.csv")),
            (320, include_str!("../../data/pollux/deepspeech2/validation-320.csv")),
            (640, include_str!("../../data/pollux/deepspeech2/validation-640.csv")),
        ],
    },
    BundledModel {
        name: "imagenet",
        placements: include_str!("../../data/pollux/imagenet/placements.csv"),
        validations: &[
            (200, include_str!("../../data/pollux/imagenet/validation-200.csv")),
            (400, include_str!("../../data/pollux/imagenet/validation-400.csv")),
            (800, include_str!("../../data/pollux/imagenet/validation-800.csv")),
            (1600, include_str!("../../data/pollux/imagenet/validation-1600.csv")),
            (3200, include_str!("../../data/pollux/imagenet/validation-3200.csv")),
            (6400, include_str!("../../data/pollux/imagenet/validation-6400.csv")),
            (12800, include_str!("../../data/pollux/imagenet/validation-12800.csv")),
        ],
    },
    BundledModel {
        name: "ncf",
        placements: include_str!("../../data/pollux/ncf/placements.csv"),
        validations: &[
            (256, include_str!("../../data/pollux/ncf/validation-256.csv")),
            (512, include_str!("../../data/pollux/ncf/validation-512.csv")),
            (1024, include_str!("../../data/pollux/ncf/validation-1024.csv")),
            (2048, include_str!("../../data/pollux/ncf/validation-2048.csv")),
            (4096, include_str!("../../data/pollux/ncf/validation-4096.csv")),
            (8192, include_str!("../../data/pollux/ncf/validation-8192.csv")),
            (16384, include_str!("../../data/pollux/ncf/validation-16384.csv")),
            (32768, include_str!("../../data/pollux/ncf/validation-32768.csv")),
        ],
    },
    BundledModel {
        name: "yolov3",
        placements: include_str!("../../data/pollux/yolov3/placements.csv"),
        validations: &[
            (8, include_str!("../../data/pollux/yolov3/validation-8.csv")),
            (16, include_str!("../../data/pollux/yolov3/validation-16.csv")),
            (32, include_str!("../../data/pollux/yolov3/validation-32.csv")),
            (64, include_str!("../../data/pollux/yolov3/validation-64.csv")),
            (128, include_str!("../../data/pollux/yolov3/validation-128.csv")),
            (256, include_str!("../../data/pollux/yolov3/validation-256.csv")),
            (512, include_str!("../../data/pollux/yolov3/validation-512.csv")),
        ],
    },
];
