"""Run the autoshard CLI from a checkout: ``python cli.py solve examples/gpt2.py --mesh 2x4``."""

from autoshard.cli.main import entry

if __name__ == "__main__":
    entry()
