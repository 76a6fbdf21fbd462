"""Packaging for convnets: the ``convnets`` and ``processing_utils`` packages, one console script.

The distribution is ``convnets-hub``: the name ``convnets`` on the package index belongs to another
project, so ``pip install 'convnets-hub[export]'`` is what every install hint says (checked by
``tests/test_packaging_name.py``). The import names stay ``convnets`` and ``processing_utils``.

The torch / torchvision pair is not pinned here (a library should not pin); ``constraints.txt``
names the pair that CI and the README install.
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

setup(
    name="convnets-hub",
    version="0.1.0",
    description=(
        "NVIDIA's ResNeXt101-32x4d, SE-ResNeXt101-32x4d and ResNet-50 with verified NGC weights, "
        "torch.hub compatible, plus preprocessing, fine-tuning and deployment tools"
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    packages=find_packages(include=["convnets", "convnets.*", "processing_utils", "processing_utils.*"]),
    # weights_manifest.json inside the package is a symlink to the repository's one source of truth;
    # setuptools copies the file it points to into the wheel.
    package_data={
        # py.typed (PEP 561): type checkers read the inline annotations of an installed copy.
        # constraints.txt (a symlink too): the versions CI installs, which the install hints of an installed
        # copy pass to pip (-c), as a checkout's do (convnets/extras.py).
        "convnets": ["weights_manifest.json", "py.typed", "constraints.txt"],
        "processing_utils": ["py.typed"],
        "convnets.preprocessing": ["imagenet_classes.tsv"],
        # The example photos: export verification runs on them when the user passes no images.
        # (`examples/` at the repository's top holds the notebooks and a link to each photo.)
        "convnets.assets": ["examples/*.png", "examples/*.jpg", "examples/LICENSES.md"],
    },
    install_requires=[
        "torch>=2.3",
        "torchvision>=0.18",
        "numpy>=1.24",
        "pillow>=10.0",
        "requests>=2.28",
        "urllib3>=2",  # processing_utils bounds each socket read to keep a total download deadline
        "validators>=0.22",
        # convnets.locking.exclusive_lock: 4.3 is the version tested; its waiters start over when the lock
        # file was deleted under them, which lets the holder delete it on release.
        "filelock>=4.3",
        "tqdm>=4.60",
        # Reading .safetensors weights is part of loading any checkpoint (--weights, load_model,
        # pretrained_from_file); small, no dependencies of its own, wheels for every platform.
        "safetensors>=0.4",
    ],
    extras_require={
        "export": ["onnx>=1.15", "onnxruntime>=1.17"],
        # --format timm: verification loads the written folder with timm
        "timm": ["timm>=1.0"],
        # nncf: precision="int8" (post-training quantization of the OpenVINO graph)
        "openvino": ["openvino>=2025.0", "nncf>=2.16"],
        "dali": ["nvidia-dali-cuda130>=1.40"],
        # convnets train: OUT/tensorboard/ event files; OUT/curves.png and `convnets plot`.
        "tensorboard": ["tensorboard>=2.14"],
        "plots": ["matplotlib>=3.7"],
        # `convnets serve`: PyTriton ships the Triton Inference Server binary and its Python backend (Linux
        # wheels only); it needs numpy < 2. tritonclient is the client of the docs' examples, and its KServe
        # protobufs are what the gRPC front parses. httptools (llhttp) parses the HTTP front's requests and
        # Triton's answers, on uvloop's event loop (both as under uvicorn); psutil finds the server's backend
        # processes without trusting a PID saved earlier. grpcio 1.64 is the first to bound the gRPC front's
        # connections (grpc.max_allowed_incoming_connections; 1.62 lacks it).
        "serve": ["nvidia-pytriton>=0.7; platform_system == 'Linux'", "tritonclient[http,grpc]>=2.50",
                  "httptools>=0.6", "uvloop>=0.19; platform_system != 'Windows'", "psutil>=5.9", "grpcio>=1.64"],
        # `convnets explain`, convnets.explain: Grad-CAM and its variants (pytorch-grad-cam; it brings OpenCV)
        "explain": ["grad-cam>=1.5"],
        # Jupyter, to open examples/quickstart.ipynb (which also needs the plots and explain extras).
        "notebook": ["notebook>=7", "ipykernel>=6.29"],
        # `convnets export --triton`: config.pbtxt is written with the ModelConfig protobuf that tritonclient ships
        # (its grpc part holds it).
        "triton": ["tritonclient[grpc]>=2.50"],
        # `convnets evaluate` on ImageNet's devkit layout (meta.mat; torchvision's devkit parser needs it too)
        "imagenet": ["scipy>=1.8"],
        # `convnets predict --output FILE.parquet`, `convnets embed --output FILE.parquet`
        "parquet": ["pyarrow>=14"],
        # `convnets predict/embed --ray ADDRESS` and convnets.ray (Classifier, Embedder for Dataset.map_batches)
        "ray": ["ray[data]>=2.40"],
        # The documentation site: `mkdocs build --strict` (mkdocs.yml; ruff formats the signatures;
        # matplotlib draws the benchmark charts, docs/charts.py).
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.6", "mkdocstrings>=1", "mkdocstrings-python>=2", "ruff>=0.5",
                 "matplotlib>=3.7"],
        "test": [
            "pytest>=8",
            "pytest-xdist>=3.6",  # pyproject.toml's addopts runs the tests on parallel workers (-n, --dist loadscope)
            "pytest-randomly>=3.15",  # off by default (pyproject.toml); `-p randomly` runs the tests in a random order
            "mypy>=1.11",  # tests/test_typing.py type-checks the package as pyproject.toml configures
            "timm>=1.0",
            "scikit-image>=0.22",
            "scikit-learn>=1.3",
            "scipy>=1.8",  # the evaluate tests write a devkit meta.mat
            "onnx>=1.15",
            "onnxruntime>=1.17",
            "openvino>=2025.0",
            "nncf>=2.16",
            # its ModelConfig protobuf parses the generated config.pbtxt back; tests/test_serve.py's clients
            # (the server itself runs in an environment with the serve extra, which pins numpy < 2: see there)
            "tritonclient[http,grpc]>=2.50",
            "psutil>=5.9",  # tests/test_serve.py: every process a server started is gone after it stops
            "httptools>=0.6",  # tests/test_serve.py reads the HTTP front's timeouts from its module
            "uvloop>=0.19; platform_system != 'Windows'",  # mypy checks the serve fronts' use of it
            "protobuf>=4",
            "tensorboard>=2.14",  # its EventAccumulator reads the training run's event files back
            "matplotlib>=3.7",
            "pyarrow>=14",
            "ray[data]>=2.40",  # tests/test_ray.py starts real Ray clusters (two nodes) on this machine
            "grad-cam>=1.5",  # the explain extra: tests/test_explain.py
            # The DALI backend's CPU pipelines are tested too; wheels exist for Linux x86-64 only.
            "nvidia-dali-cuda130>=2.0; platform_system == 'Linux' and platform_machine == 'x86_64'",
            # tests/test_notebook.py runs examples/quickstart.ipynb in a kernel.
            "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29",
            # tests/test_docs_build.py builds the site (the docs extra, repeated: extras are literals here).
            "mkdocs>=1.6", "mkdocs-material>=9.6", "mkdocstrings>=1", "mkdocstrings-python>=2", "ruff>=0.5",
        ],
    },
    entry_points={"console_scripts": ["convnets=convnets.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
