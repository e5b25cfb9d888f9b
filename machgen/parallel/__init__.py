"""One generation on several ranks (GPUs, or CPU processes in the tests).

- ``layout``: a parallel layout (``cfg=2,ulysses=2,ring=2``) and what a
  family allows; no torch (the build CLI and the manifest read it).
- ``mesh``: which rank does what, and the process groups of each axis.
- ``cfg``: classifier-free-guidance parallel: the guidance rows split over
  ranks, gathered once per step.
- ``ulysses``: heads scattered and sequence gathered by one stacked
  all-to-all, attention on whole sequences, the output all-to-all back.
- ``ring``: key/value blocks passed round the ring while the current block
  is computed, partial results merged by log-sum-exp in float32.
- ``usp``: Ulysses inside ring, the attention every sequence layout runs.
- ``state``: the parallel state of the process and of the call running now (the mesh, whether the call is
  split, its stale blocks, the values exchanges in flight, the parent's rank pools); no torch.
- ``ranks``: the rank processes (forked from a clean forkserver, gloo or NCCL) and their teardown.
- ``program``: a component's program on the ranks, called like one on a device (the parent's side);
  ``messages``: what it says to the ranks; ``rank_programs``: the ranks' side, one handler per message.
"""
