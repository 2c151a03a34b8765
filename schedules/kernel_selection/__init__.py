"""Kernel selection's parts below the compiler: which ops form groups (`op_kinds`), their
signatures and candidates (`candidates`), where candidates come from (`sources`: generated,
library, hand-written, external), rewriting a model into chosen candidates (`apply`), the
stored choices a build applies (`choices`) and the targets' built-in choices for the op groups
no selection covers (`defaults`). Verifying, timing and choosing is
`gimlet_tvm.selection`."""
