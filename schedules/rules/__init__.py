"""Default (untuned) schedule rules: CPU rules one per module in `cpu/`, DLight's GPU rules with
ours around them, and the choice of a target's set (`default_rules`)."""

from .defaults import RULE_SETS, default_rules
