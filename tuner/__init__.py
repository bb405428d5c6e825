"""kvtune.tuner: measurement, search, studies, export and the `kvtune` CLI."""
