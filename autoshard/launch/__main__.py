"""``torchrun ... -m autoshard.launch PLAN MODEL [OPTIONS]``: one rank of a launch."""

from autoshard.launch.rank import rank_command

rank_command()
