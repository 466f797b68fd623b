"""The exceptions a forward raises for bad input.

Each is the documented ``ValueError`` / ``TypeError`` (docs/reliability.md) and also a ``RuntimeError``,
which is what FBGEMM's TBE raises for the same input (its ops' ``TORCH_CHECK``s, and FATAL's bounds check
on the CPU): code written to catch FBGEMM's errors catches these, and code catching ours keeps working.
"""


class InputError(ValueError, RuntimeError):
    """A forward input with a wrong value, shape, length or device, or out-of-range data under FATAL."""


class InputTypeError(TypeError, RuntimeError):
    """A forward input of the wrong type or dtype."""
