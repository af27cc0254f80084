"""The fault probe: hostile-but-fair faults run against the real command, server, client and
library, each judged by what a user would see (`_probe.py`). Run it from the checkout with
`python -m tools.fault_probe` (see `docs/faults.md`)."""
