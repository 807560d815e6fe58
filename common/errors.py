"""Errors that reach users: each carries a message that says what is wrong and where."""

import re


class WedlmError(Exception):
    """Base class for problems caused by input (files, flags, requests), not by bugs."""


class CheckpointError(WedlmError):
    """A model folder or file is missing, corrupt, or describes an unsupported model."""


class InvalidRequest(WedlmError):
    """A generation request or decoding parameter is out of range."""


class PromptTooLong(InvalidRequest):
    """A prompt that cannot fit the model's context, refused before or while tokenizing."""


class OutOfMemory(WedlmError):
    """A forward could not get the memory it needs, even alone: the request asks for more
    than this machine (or cluster) can hold now."""


# How MLX (Metal, CUDA, CPU), the C++ runtime and a worker's RESOURCE_EXHAUSTED answer
# word a failed allocation.
_OUT_OF_MEMORY = re.compile(
    r"out of memory|insufficient memory|attempting to allocate|bad_alloc|"
    r"cannot allocate memory|outofmemory|failed to allocate",
    re.IGNORECASE,
)


def is_out_of_memory(error: BaseException) -> bool:
    """A failure for lack of memory (a resource to wait for), not a fault to re-plan."""
    return isinstance(error, MemoryError | OutOfMemory) or bool(
        _OUT_OF_MEMORY.search(str(error))
    )
