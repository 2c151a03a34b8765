"""Default (untuned) schedule rules for CPU targets, in the order they are tried."""

from .injective import Injective
from .window_reduction import WindowReduction
from .normalization import Normalization
from .row_reduction import RowReduction

RULES = (Injective, WindowReduction, Normalization, RowReduction)
