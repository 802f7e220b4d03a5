"""Tools on whole checkpoints: inspect, stats, compare, convert, verify, list (what the CLI calls)."""
