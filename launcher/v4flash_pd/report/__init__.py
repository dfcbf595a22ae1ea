"""`v4flash-pd report`: everything a new box can tell us, in one directory and one tarball.

Steps, each recorded (or its failure recorded) without stopping the others: the box's facts
(`facts`: fingerprint, PCIe/P2P topology, NUMA map, stack versions, doctor), the kernel
self-check, the step bench (upstream vs ours per op on one GPU), and the end-to-end A/B
(`variants`: a trio started per patch configuration, bench at 1/16/64 streams and the accuracy
gate through its router). `summary` writes the Markdown summary, `scrub` makes sure no secret
(the router key) is in any file before `archive` packs the tarball. In a rehearsal every number
comes from stand-ins and is marked as such.
"""
