"""What a run shows and leaves behind: console, metrics.jsonl, summary.json, accounting, provenance."""
