"""A stand-in for torch holding only `torch.distributed.run`, for test jobs that need no torch of their own.

The suite's toy jobs (examples/toy_train.py, stdlib only) are started the way every longrun job is, by
`python -m torch.distributed.run`. The real launcher imports torch first: about 2.3 CPU-seconds an attempt, most of
the integration lane's CPU on a 2-core machine. `tests.service.toy_spec` puts this folder on the job's PYTHONPATH,
so the same command line starts `torch/distributed/run.py` here instead; the tests that assert on the real
launcher leave it off, and so do jobs whose ranks meet in torch.distributed: the real launcher holds their
rendezvous store's port, where this one could only pick a free port for rank 0 to bind later (a race with every
other process on a busy test machine). Importing anything else from this package fails loudly.
"""
