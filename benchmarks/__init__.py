"""Maintained benchmarks, run as modules from the repository root: ``python -m benchmarks.NAME``.
Each prints measured ratios and keeps a ``--small`` mode that ``tests/test_benchmarks.py`` runs
(see docs/development.md, "Benchmarks"; figures in docs/results.md)."""
