"""Runs the agent: `python -S hostside-<sha> VERB` (the zipapp worker/host_agent.py ships, unpacked on the host: this
file at its top, the package beside it as `hostside`), `python -S worker/hostside VERB` or
`python -m worker.hostside VERB`."""

import os
import sys


def _main():
    # the agent's bytecode is cached beside it (the unpacked agent is ours, under the workspace) even where the host's
    # environment says PYTHONDONTWRITEBYTECODE: else each call, a probe every few seconds, compiles it all again
    sys.dont_write_bytecode = False
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
