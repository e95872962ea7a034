"""``python -m burstgym.latency``: see `burstgym.latency.cli`."""

from burstgym.latency.cli import main

main()
