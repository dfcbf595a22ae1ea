"""`v4flash-pd report`: everything a new box can tell us, in one directory and one tarball.

Steps, each recorded (or its failure recorded) without stopping the others: the box's facts
(`facts`: fingerprint, PCIe/P2P topology, NUMA map, stack versions, doctor), the kernel
self-check, the step bench (upstream vs ours per op on one GPU), and the end-to-end A/B
(`variants`: a trio started per patch configuration, bench at 1/16/64 streams and the accuracy
gate through its router; `trio` stops a variant's trio from its run dir's records, also when
`interrupt` turns Ctrl-C/SIGTERM/SIGHUP into a stop). `summary` writes the Markdown summary;
`redact` knows every secret and every spelling of it, `scrub` rewrites every file and scans the
result, `archive` packs the tarball safely and `scrub` scans it once more before the report calls
itself complete. In a rehearsal every number comes from stand-ins and is marked as such.
"""
