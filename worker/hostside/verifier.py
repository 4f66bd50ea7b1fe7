"""The `verifier` verb: one decoder layer of the deployment's verifier, timed on this host's GPU by the probe script
the worker sends (worker/verifier_probe.py, installed content-addressed under the workspace's .longrun/bin like the
all-reduce sweep), its output handed back raw: the worker reads it as untrusted input. The agent owns the command
line: a request names only the config, tp and ep, passed as arguments (no shell)."""

import sys

from .gpus import captured, install_script


def verifier(req):
    """`python SCRIPT --config PATH --tp N --ep E`, its exit status and bounded output."""
    refused = install_script(req, req["script_path"], req["script_source"])
    if refused is not None:
        return {"error": f"verifier: {refused}"}
    # --config=PATH: a path starting with '-' stays the option's value
    argv = [sys.executable, req["script_path"], f"--config={req['config']}", "--tp", str(int(req["tp"])),
            "--ep", str(int(req["ep"]))]
    return {"probe": captured(argv, float(req.get("timeout", 900)))}
