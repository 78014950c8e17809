"""Measured training runs: the job a launch runs, what each rank records, and what we make of it.

Pure Python (MindSpore is imported only to record its version), shared by ``graph-exec run`` and ``graph-exec bench``:
:mod:`.job` describes the runs one msrun launch performs, :mod:`.records` is the per-rank file
format the workers write, :mod:`.analysis` merges the ranks' records into step times, bubble
and overhead, :mod:`.predict` feeds the measured per-op costs to the simulator, and
:mod:`.trace` turns the measured timeline into a chrome trace or a picture; :mod:`.bench_report`
builds ``graph-exec bench``'s table and JSON document, :mod:`.bench_schema` checks the latter.
"""
