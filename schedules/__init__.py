"""Schedules: how kernels get their schedules and which kernels run.

- `rules`: default schedule rules for untuned kernels, chosen by the target's keys;
- `tuning`: the MetaSchedule records database and the pass that applies its best records;
- `kernel_selection`: op groups, the candidates of every source for them, and the stored
  choices a build applies (making the choices is `gimlet_tvm.selection`).
"""
