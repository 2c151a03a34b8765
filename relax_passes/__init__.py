"""Relax passes: graph fusion (GELU, normalization, attention, epilogues), hand-off to a
target's kernel libraries, cross-device placement and the multi-device bookkeeping after it;
one pass per module, each docstring saying where it goes in the pipeline."""
