"""Benchmarks and GPU checks of the kernels (not installed: run from the repository root as `python3 -m bench.NAME`).

Each module's docstring gives its command; problems.py owns the problems they share (random paged batches at
MiniMax-M3's layer shape, the trained model's selections), timing.py how they time and the ceilings they compare
against. Their results, with the commands that produced them, are in results/README.md.
"""
