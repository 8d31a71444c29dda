"""What every fake pynvml of the unit tests shares: pynvml's error classes and init/shutdown counts.

pynvml's errors are unhashable (they define __eq__), and each NVML return code has its own subclass
`NVMLError_<Name>`; code under test catches both the base and the subclasses, so the fakes must too."""

from __future__ import annotations

import types

# The return codes either reader handles (a superset: a fake with one more class costs nothing).
ERROR_NAMES = ("LibraryNotFound", "DriverNotLoaded", "NoPermission", "GpuIsLost", "NotSupported", "FunctionNotFound",
               "ArgumentVersionMismatch", "InvalidArgument", "Uninitialized", "Unknown")


class FakePynvmlBase(types.ModuleType):
    """A module named pynvml with the error hierarchy and counters of nvmlInit/nvmlShutdown calls;
    subclasses add the functions their reader calls. `init_error` makes nvmlInit raise."""

    def __init__(self) -> None:
        super().__init__("pynvml")

        class NVMLError(Exception):
            def __eq__(self, other: object) -> bool:
                return isinstance(other, NVMLError) and str(other) == str(self)

            __hash__ = None  # type: ignore[assignment]

        self.NVMLError = NVMLError
        for name in ERROR_NAMES:
            setattr(self, f"NVMLError_{name}", type(f"NVMLError_{name}", (NVMLError,), {}))
        self.init_calls = 0
        self.shutdown_calls = 0
        self.init_error: Exception | None = None

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvml_error(self, name: str, message: str) -> Exception:
        """An instance of this pynvml's `NVMLError_<name>`."""
        error: type[Exception] = getattr(self, f"NVMLError_{name}")
        return error(message)


def nvml_without_library() -> FakePynvmlBase:
    """pynvml on a machine without the driver: nvmlInit raises NVMLError_LibraryNotFound."""
    nvml = FakePynvmlBase()
    nvml.init_error = nvml.nvml_error("LibraryNotFound", "NVML Shared Library Not Found")
    return nvml
