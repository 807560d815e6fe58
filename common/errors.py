"""Errors that reach users: each carries a message that says what is wrong and where."""


class WedlmError(Exception):
    """Base class for problems caused by input (files, flags, requests), not by bugs."""


class CheckpointError(WedlmError):
    """A model folder or file is missing, corrupt, or describes an unsupported model."""


class InvalidRequest(WedlmError):
    """A generation request or decoding parameter is out of range."""


class PromptTooLong(InvalidRequest):
    """A prompt that cannot fit the model's context, refused before or while tokenizing."""
