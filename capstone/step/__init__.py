"""What a step keeps and judges, below every mode: the optimizer shard and the run's progress a
checkpoint restores (state), the divergence guard's verdicts (guard), the test seam's points (hooks)."""
