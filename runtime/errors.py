"""User-facing errors. Each is one line of message plus a hint; the CLI prints both and exits non-zero."""
from __future__ import annotations


class DsedgeError(Exception):
    """Base of every error a user can cause. ``str(err)`` is the one-line message; ``err.hint`` says what to do."""

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:  # one line, always
        return self.message.replace("\n", " ")


class SourceError(DsedgeError):
    """The model source (path, ONNX file, HF directory, ``module:function``) cannot be used."""


class TargetError(DsedgeError):
    """Unknown target, malformed profile, or something the target cannot do (precision, DLA, opset)."""


class PrecisionNotSupported(TargetError):
    """The requested precision is not available on the target (or not implemented yet)."""


class BundleError(DsedgeError):
    """A bundle is missing, malformed, or from an unknown schema version."""


class BundleIntegrityError(BundleError):
    """A bundle file is missing, truncated or tampered with (sha256 mismatch)."""


class InputError(DsedgeError):
    """Inputs passed to ``Session.run``/``submit`` do not match the bundle's IO specs (name, dtype, shape)."""


class InferenceError(DsedgeError):
    """The backend failed to run inputs that passed the bundle's checks (e.g. a token id past an embedding table the
    manifest gives no range for); the message carries the backend's own first line, the cause is chained."""


class BackendUnavailable(DsedgeError):
    """A backend (TensorRT, an ORT provider) is not installed or cannot run here."""


class CalibrationError(DsedgeError):
    """Calibration or validation data is empty, malformed or does not match the model's inputs."""


class QuantizationError(DsedgeError):
    """A layer cannot be quantized as asked (unsupported type, NaN/Inf weights, impossible block size)."""


class AccuracyGateError(DsedgeError):
    """The accuracy gate could not be met; the message says the best value reached."""


class ConfigError(DsedgeError):
    """A config file (training, target profile) has an unknown key, a bad value or an impossible setting."""


class EngineError(DsedgeError):
    """A TensorRT engine file is corrupt, foreign (other GPU / TensorRT version) or failed to build."""


class TrainingError(DsedgeError):
    """Training cannot go on: the loss stayed non-finite after rolling back, or a run directory is unusable."""


class SessionClosedError(DsedgeError):
    """``submit``/``stream``/``generate`` was called on a session after ``close()`` (a programming error)."""


class BenchError(DsedgeError):
    """A benchmark cannot run or compare: no samples, a missing/malformed/foreign baseline report."""


class OutputMismatchError(DsedgeError):
    """A backend's answers on the bundle's golden inputs are outside the build-time tolerance (the figures say how
    far); ``dsedge verify`` exits 1 on it."""

    exit_code = 1


class SignatureError(BundleIntegrityError):
    """Trusted keys are configured and the bundle is unsigned, signed by an untrusted key, or its signature does not
    match the manifest."""


class StorageError(DsedgeError):
    """The disk refused a write: full, over a quota or file-size limit, read-only, or not permitted."""
