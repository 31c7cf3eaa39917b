"""Evaluation and measurement: `dgemma eval` (decode runs, the judge, learning curves, the report), pictures
of traces, `dgemma bench` and `dgemma demo`."""
