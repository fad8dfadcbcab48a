"""A model's repeated blocks (transformer layers), found from its module tree alone.

The tracer ties the blocks' strategies, depth reduction traces a few of them, the
launcher seeds weights block by block and the exported styles loop over them: all
find them here.
"""

from __future__ import annotations

import torch


def find_block_prefixes(module: torch.nn.Module) -> dict[str, int]:
    """Module FQN of each repeated block -> its index.

    A repeated block is a child named by an integer of a container with at least
    two integer-named children of one class (``nn.ModuleList`` / ``nn.Sequential``
    of layers). The container with the most such children wins.
    """
    best: dict[str, int] = {}
    for name, mod in module.named_modules():
        children = list(mod.named_children())
        numbered = [(k, c) for k, c in children if k.isdigit()]
        if len(numbered) < 2 or len({type(c) for _, c in numbered}) != 1:
            continue
        if len(numbered) > len(best):
            prefix = f"{name}." if name else ""
            best = {f"{prefix}{k}": int(k) for k, _ in numbered}
    return best
