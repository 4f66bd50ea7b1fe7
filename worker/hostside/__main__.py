"""Runs the agent: `python -S hostside-<sha>.pyz VERB` (the zipapp worker/host_agent.py ships: this file at its top,
the package beside it as `hostside`), `python -S worker/hostside VERB` or `python -m worker.hostside VERB`."""

import os
import sys


def _main():
    if __package__:
        from .agent import main
    else:
        here = os.path.dirname(os.path.abspath(__file__))
        if os.path.isfile(os.path.join(here, "agent.py")):  # this file inside the package (the source tree)
            sys.path[0] = os.path.dirname(here)
        from hostside.agent import main
    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(_main())
