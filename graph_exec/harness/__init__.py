"""The training harness of ``graph-exec run`` and ``graph-exec bench``, apart from the library.

:mod:`.worker` is the script ``msrun`` starts on every rank; :mod:`.training` trains the job's
example runs there and records them. Both are tooling: they use the library only through its
public API (the schedules, ``DeviceMesh``, the checkpoint functions, ``create_executor``), so
nothing in the core depends on them.
"""
