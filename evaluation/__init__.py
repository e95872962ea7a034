"""The parts of `evaluate.py`, importable and tested as modules:

- `statistics`: confidence intervals, paired differences against the baseline, pooled percentiles
  with seed-bootstrap intervals, the table rows and the one-line summary of a scenario;
- `experiments`: routers on scenarios until the paired intervals resolve, the regime map (best
  router of each family per cell), and running tasks locally or as Ray tasks;
- `plots`: latency CDFs, load shares and the regime map;
- `report`: the markdown table and the results folder (checked before any work, written whole,
  marked with the run that wrote it).
"""
