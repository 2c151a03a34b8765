"""Tuning records: MetaSchedule's database of measured schedules per target, its operations
(merge, prune, show) and the build pass that applies the best records (`records`). The tuning
run itself is `gimlet_tvm.tuning`."""
