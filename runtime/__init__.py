"""dsedge.runtime — the device side's ground floor: errors, bundle format, backends, scheduling.

Never imports torch, the toolchain or the SDK face (imports run samples → sdk → toolchain → runtime, targets).
"""

import logging as _logging

_logging.getLogger("dsedge").addHandler(_logging.NullHandler())  # the application configures logging
