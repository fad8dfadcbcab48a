"""``torchrun ... -m autoshard.calibrate --mesh SHAPE --out FILE``: one rank of a calibration."""

from autoshard.calibrate.rank import rank_command

rank_command()
