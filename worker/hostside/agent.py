"""The verb dispatch: `VERB` in argv, its request one JSON object on stdin, its answer one JSON line on stdout."""

import json
import os
import sys

from . import files
from .attempt import cancel, probe
from .clean import clean
from .gpus import gpus, interconnect
from .launch import launch, wrap

VERBS = {"launch": launch, "probe": probe, "cancel": cancel, "clean": clean, "gpus": gpus,
         "interconnect": interconnect}


def main(argv):
    # the attempt's files hold its token and env: private to this user
    files.CALLER_UMASK = os.umask(0o077)
    if len(argv) == 3 and argv[0] == "wrap":
        wrap(argv[1], argv[2])
        return 0
    if len(argv) != 1 or argv[0] not in VERBS:
        sys.stdout.write(json.dumps({"error": f"usage: hostside-<sha>.pyz {'|'.join(VERBS)} < JSON"}) + "\n")
        return 2
    try:
        request = json.loads(sys.stdin.readline())
    except ValueError as exc:
        request = exc
    if not isinstance(request, dict):
        sys.stdout.write(json.dumps({"error": f"{argv[0]}: the request on stdin is not a JSON object"}) + "\n")
        return 2
    result = VERBS[argv[0]](request)
    sys.stdout.write(json.dumps(result) + "\n")
    return 2 if "error" in result else 0
