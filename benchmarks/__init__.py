"""ckpt's benchmarks: save and restore side by side with peers, on tmpfs and on disk.

Run ``python -m benchmarks`` from the repository root (``python -m benchmarks --help``);
``pip install ".[bench]"`` adds the peers (safetensors; torch is used when installed).
Results are recorded in docs/benchmarks.md.
"""
