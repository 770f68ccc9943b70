"""Benchmarks of spmd_compiler against eager DDP and FSDP2, with a lower bound.

Entry point: ``python -m benchmarks.run --help``. Results go to a JSON file and are rendered into
``docs/benchmarks.md`` (plus a bar chart when matplotlib is installed).
"""
