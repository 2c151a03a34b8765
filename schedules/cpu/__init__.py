"""Default (untuned) schedule rules for LLVM CPU targets, in the order they are tried."""

from .injective import Injective
from .normalization import Normalization
from .window_reduction import WindowReduction
from .row_reduction import RowReduction

RULES = (Injective, Normalization, WindowReduction, RowReduction)
