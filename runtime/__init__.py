"""dsedge.runtime — the device side's ground floor: errors, bundle format, backends, scheduling.

Never imports torch, the toolchain or the SDK face (imports run samples → sdk → toolchain → runtime, targets).
"""
