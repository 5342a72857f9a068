"""Triton kernels behind the public ops in ``dsinfer.ops``: one file per op, each exposing ``<name>_triton``.

Imported lazily by the public functions (only when ``dispatch.use_triton`` says so), so importing
``dsinfer.ops`` never imports Triton, and ``TRITON_INTERPRET`` set by a test before the first call still takes
effect.
"""
