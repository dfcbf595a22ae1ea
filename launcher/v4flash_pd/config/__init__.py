"""The config chain, one way from raw text to a frozen Config (a module imports only those listed before it):

    values   one check per kind of value (port, host, seconds, GPU list, ...)
    keys     every key declared once: type, default, check, help, optional flag
    types    the frozen Config / WorkerSpec / RouterSpec / ClusterSpec / Speculative it produces
    speculative  the [speculative] table resolved, and the worker flags/env the pinned sglang refuses with it
    layers   defaults < profile < file < V4FLASH_SET < V4FLASH_<OPTION> < --set < flags, as one raw dict
    build    build_config: the raw dict checked into a Config (the one worker builder)
    layout   expand: a cluster's slots placed on its boxes, after build
    load     load_config: all of the above in one call
"""
