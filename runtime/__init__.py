"""dsedge.runtime — the device side's ground floor: errors, bundle format, backends, scheduling.

Never imports torch, the toolchain or the SDK face (imports run samples → sdk → toolchain → runtime, targets).

Logging: no handler on the ``dsedge`` logger. An application that configures logging gets dsedge's records through
its own handlers (once); one that configures none still sees WARNING and above on stderr (Python's last-resort
handler), e.g. a GPU bundle running on ONNX Runtime's CPU provider. A ``NullHandler`` here would hide those.
"""
