"""Flow-GRPO cost benchmark: `python -m bench [--quick]` prints one JSON object of ratios.

See `bench/README.md` for what each figure means.
"""
