"""The op-rule table with autoshard's own rules in it: look ops up here.

:mod:`autoshard.strategies.registry` holds the mechanism; importing this module loads
autoshard's own rules into it (the ATen ops whose DTensor rule is mended, the fused
attention and experts ops), so :func:`op_rule` answers for them wherever it is asked. A
model's own op rules are in the table once its model file has been imported.
"""

from __future__ import annotations

from autoshard.strategies import aten_rules, attention, experts, loss_parallel
from autoshard.strategies.registry import OpRule, op_rule, op_rules

BUILTIN = (aten_rules, attention, experts, loss_parallel)
"""The modules of autoshard's own rules (each registers its rules when imported)."""

__all__ = ["BUILTIN", "OpRule", "op_rule", "op_rules"]
